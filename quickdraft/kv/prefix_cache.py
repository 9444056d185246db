"""Prefix caching: full blocks of a runner's KV cache kept by the token prefix that produced them.

`PrefixCache`: full blocks of a runner's cache kept by the token prefix that produced them (a hash chain over
the blocks' tokens, as vLLM keys its blocks), least recently used evicted first, and copied into a new
sequence whose tokens start with that prefix: its prompt is then computed from the first block not found.
Caches stay one contiguous tensor per sequence (what the attention kernels read), so a reused block is
copied (a memcpy of a few hundred KB) rather than shared in place: prefix caching saves the prefill's
compute, not its memory. Kept blocks are slots of slabs allocated SLAB_BLOCKS at a time and reused once
evicted: a block stored as a sequence fills it is one copy into memory already mapped, not an allocation (a
fresh allocation of a block's size faults in its pages, which cost more than the copy on a busy machine).
Under a budget the kept blocks live in the pool's free space and are evicted before any running sequence is
preempted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any

import torch

from quickdraft.kv.pool import BLOCK_SIZE, KVPool, runner_bytes_per_token
from quickdraft.kv.static_cache import StaticSequenceCache


SLAB_BLOCKS = 32  # blocks allocated at once


def _chain(parent: bytes, tokens: list[int]) -> bytes:
    """The digest of a block given its parent's digest and its 16 tokens: equal digests, equal prefixes."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Full blocks of one runner's caches, kept by the token prefix that produced them (see the module doc).

    `load(cache, token_ids)` copies the longest kept prefix of token_ids into an empty cache, leaving at least
    the last token to compute (its logits are needed); `store(cache)` keeps the cache's full blocks of
    committed positions that are not kept yet. A block holds the numbers a fresh prefill of its prefix
    computes only where the runner computes each row alike whatever the call (quickdraft's CPU kernels): the
    LLM turns prefix caching on by default only there.

    Eviction is least recently used, and a prefix's blocks are touched last-block-first so that a prefix is
    evicted from its tail: a kept block's parent is always kept (a chain without its head could never be
    found). With a pool, kept blocks take the pool's free bytes and the pool reclaims them before it refuses a
    grant; without one, at most `max_blocks` are kept."""

    def __init__(self, runner: Any, pool: KVPool | None = None, max_blocks: int | None = None):
        self.runner = runner
        self.block_bytes = runner_bytes_per_token(runner) * BLOCK_SIZE
        self.pool = pool
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # digest -> its slot; LRU first
        self._slabs: list[tuple[torch.Tensor, torch.Tensor]] = []  # keys, values [SLAB_BLOCKS, *a block's shape]
        self._free_slots: list[int] = []
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, loaded from kept blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def copies(runner: Any) -> bool:
        """Whether `runner`'s caches are ones a prefix cache copies block by block (StaticSequenceCache)."""
        return isinstance(runner.new_cache(), StaticSequenceCache)

    @property
    def nbytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def _slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._slabs[slot // SLAB_BLOCKS]
        return keys[slot % SLAB_BLOCKS], values[slot % SLAB_BLOCKS]

    def _new_slot(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """A free slot for a block shaped like keys and values (a new slab when none is free)."""
        if not self._free_slots:
            first = len(self._slabs) * SLAB_BLOCKS
            self._slabs.append((keys.new_empty((SLAB_BLOCKS, *keys.shape)),
                                values.new_empty((SLAB_BLOCKS, *values.shape))))
            self._free_slots = list(range(first + SLAB_BLOCKS - 1, first - 1, -1))
        return self._free_slots.pop()

    def _drop_oldest(self) -> None:
        self._free_slots.append(self._blocks.popitem(last=False)[1])

    def _touch(self, digests: list[bytes]) -> None:
        for digest in reversed(digests):  # the head last: the most recently used
            self._blocks.move_to_end(digest)

    def load(self, cache: StaticSequenceCache, token_ids: list[int]) -> int:
        """Fill the empty `cache` with the longest kept prefix of token_ids; returns the positions loaded. May
        raise KVPoolFull (the cache could not grow to hold them)."""
        self.queried_tokens += len(token_ids)
        if len(cache):
            return 0
        digests, parent = [], b""
        for index in range((len(token_ids) - 1) // BLOCK_SIZE):
            digest = _chain(parent, token_ids[index * BLOCK_SIZE: (index + 1) * BLOCK_SIZE])
            if digest not in self._blocks:
                break
            digests.append(digest)
            parent = digest
        if not digests:
            return 0
        positions = len(digests) * BLOCK_SIZE
        # Read after reserving: reserving may evict them, but no block is stored (no slot rewritten) before the copy.
        slots = [self._blocks[digest] for digest in digests]
        self._touch(digests)
        cache.reserve(positions)
        cache.write_blocks([self._slot(slot) for slot in slots], token_ids[:positions])
        cache.block_digests = digests
        self.hit_tokens += positions
        return positions

    @staticmethod
    def has_new_blocks(cache: StaticSequenceCache) -> bool:
        """Whether `cache` has a full block that store has not seen yet (its digests name those it saw)."""
        return len(cache) // BLOCK_SIZE > len(cache.block_digests)

    def store(self, cache: StaticSequenceCache) -> None:
        """Keep the full blocks of `cache` (its committed positions) that are not kept yet."""
        full = len(cache) // BLOCK_SIZE
        digests = cache.block_digests
        if len(digests) >= full:
            return
        ids = cache.token_ids
        # A block is kept only under a kept parent: the cache's earlier blocks may have been evicted since they
        # were stored, and a block whose chain lost a link can never be found again.
        chained = all(digest in self._blocks for digest in digests)
        for index in range(len(digests), full):
            digest = _chain(digests[-1] if digests else b"", ids[index * BLOCK_SIZE: (index + 1) * BLOCK_SIZE])
            digests.append(digest)
            if not chained:
                continue  # still the cache's digests, for its later blocks
            if digest not in self._blocks:
                if not self._make_room(protect=set(digests)):
                    chained = False  # later blocks could not be found without this one
                    continue
                keys, values = cache.block(index)
                slot = self._new_slot(keys, values)
                slot_keys, slot_values = self._slot(slot)
                slot_keys.copy_(keys)
                slot_values.copy_(values)
                self._blocks[digest] = slot
        self._touch(self._kept_head(digests))

    def _kept_head(self, digests: list[bytes]) -> list[bytes]:
        """The digests of a chain up to its first block that is not kept (the part a load can find)."""
        kept = []
        for digest in digests:
            if digest not in self._blocks:
                break
            kept.append(digest)
        return kept

    def _make_room(self, protect: set[bytes]) -> bool:
        """Room for one more block: free bytes in the pool (or under the cap), else the least recently used
        block's, unless that block is one of `protect` (the chain being stored); False when there is none."""
        if self.pool is not None and self.pool.take(self, self.block_bytes):
            return True
        if self.pool is None and (self.max_blocks is None or len(self._blocks) < self.max_blocks):
            return True
        if not self._blocks or next(iter(self._blocks)) in protect:
            return False
        self._drop_oldest()  # its bytes (or its place under the cap) go to the new block
        return True

    def evict(self, nbytes: int) -> int:
        """Drop least recently used blocks until nbytes are freed (or none is left); returns the bytes freed."""
        freed = 0
        while self._blocks and freed < nbytes:
            self._drop_oldest()
            freed += self.block_bytes
        if self.pool is not None and freed:
            self.pool.give(self, freed)
        return freed

    def clear(self) -> None:
        """Drop every kept block. The slabs stay, as after evictions: a cleared cache refills memory already
        mapped (a block stored into a fresh slab's pages took 76 us here, into mapped ones 18.5 us)."""
        self.evict(self.nbytes)
        total = len(self._slabs) * SLAB_BLOCKS
        self._free_slots = list(range(total - 1, -1, -1))  # popped lowest first

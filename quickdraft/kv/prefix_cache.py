"""Prefix caching: full blocks of a runner's KV cache kept by the token prefix that produced them.

`PrefixCache`: full blocks of a runner's caches kept by the token prefix that produced them (a hash chain over
the blocks' tokens, as vLLM keys its blocks) and copied into a new sequence whose tokens start with that
prefix: its prompt is then computed from the first block not found. Caches stay one contiguous tensor per
sequence (what the attention kernels read), so a reused block is copied into the new cache (a memcpy of a few
hundred KB): prefix caching saves the prefill's compute, not its memory.

Keeping a block copies nothing. While its sequence runs, a kept block is the running cache's own (it is
committed, so no later step rewrites it); when the sequence ends, the prefix cache adopts the finished cache's
tensors instead of letting them go. Copying each block as it filled cost ~50 us a block from cold memory, four
blocks a step at 64 sequences: a third of the step's host time. An adopted cache is evicted whole (least
recently used first): its tensors hold its blocks that were kept before any other cache's, beside positions it
shares with an earlier kept prefix and the room it had not filled, so a kept block takes more bytes than its
own. Under a budget, adopted caches keep the pool bytes their sequences were granted (the pool's free space,
reclaimed before any running sequence is preempted); without one, at most `max_tokens` positions' bytes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any

import torch

from quickdraft.kv.pool import BLOCK_SIZE, KVPool, runner_bytes_per_token
from quickdraft.kv.static_cache import StaticSequenceCache, block_views


def _chain(parent: bytes, tokens: list[int]) -> bytes:
    """The digest of a block given its parent's digest and its 16 tokens: equal digests, equal prefixes."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class _Adopted:
    """A finished sequence's keys and values, kept for the blocks of them a prefix cache keeps."""

    __slots__ = ("keys", "values", "packed_keys", "nbytes", "digests")

    def __init__(self, cache: StaticSequenceCache, nbytes: int, digests: list[bytes]):
        self.keys, self.values = cache.keys, cache.values
        self.packed_keys = cache.runner.packed_keys
        self.nbytes = nbytes  # what it counts against the pool or the cap
        self.digests = digests  # the kept blocks that live here

    def block(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return block_views(self.keys, self.values, self.packed_keys, index)


class PrefixCache:
    """Full blocks of one runner's caches, kept by the token prefix that produced them (see the module doc).

    `store(cache)` keeps the running cache's full blocks of committed positions that are not kept yet (by
    reference); `adopt(cache)` keeps a finished cache's tensors for its kept blocks; `load(cache, token_ids)`
    copies the longest kept prefix of token_ids into an empty cache, leaving at least the last token to compute
    (its logits are needed). A block holds the numbers a fresh prefill of its prefix computes only where the
    runner computes each row alike whatever the call (quickdraft's CPU kernels): the LLM turns prefix caching
    on by default only there.

    Eviction takes adopted caches whole, least recently used first (used: adopted, or loaded from); a load
    touches the caches of a prefix's blocks last-block-first, so the cache holding a chain's head is used no
    earlier than one holding its tail, and a chain is evicted from its tail (a block whose parent went is not
    found by a load, and a running cache keeps no block under a parent that went). Blocks of running caches
    take no memory of their own and are not evicted. With a pool, adopted caches keep their pool bytes and the
    pool reclaims them before it refuses a grant; without one, they take at most `max_tokens` positions."""

    def __init__(self, runner: Any, pool: KVPool | None = None, max_tokens: int | None = None):
        self.runner = runner
        self.bytes_per_token = runner_bytes_per_token(runner)
        self.block_bytes = self.bytes_per_token * BLOCK_SIZE
        self.pool = pool
        self.max_bytes = None if max_tokens is None else max_tokens * self.bytes_per_token
        # digest -> where the block lives (a running cache or an _Adopted) and its block index there
        self._blocks: dict[bytes, tuple[Any, int]] = {}
        self._adopted: OrderedDict[int, _Adopted] = OrderedDict()  # id -> adopted tensors; LRU first
        self.nbytes = 0  # the adopted tensors' bytes
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, loaded from kept blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def copies(runner: Any) -> bool:
        """Whether `runner`'s caches are ones a prefix cache copies block by block (StaticSequenceCache)."""
        return isinstance(runner.new_cache(), StaticSequenceCache)

    def _touch(self, sources: list[tuple[Any, int]]) -> None:
        """Mark the adopted caches a loaded prefix came from as the most recently used, its head's last."""
        for holder, _ in reversed(sources):
            if isinstance(holder, _Adopted):
                self._adopted.move_to_end(id(holder))

    def _find(self, digest: bytes) -> tuple[Any, int] | None:
        """Where a kept block lives; None if it is not kept. A running cache rolled back below a block it kept
        (it is the engine's rule that committed positions stay, but a cache is not bound to it) no longer
        holds it: the entry goes."""
        entry = self._blocks.get(digest)
        if entry is not None and isinstance(entry[0], StaticSequenceCache):
            cache, index = entry
            if index >= len(cache.block_digests) or cache.block_digests[index] != digest:
                del self._blocks[digest]
                return None
        return entry

    def load(self, cache: StaticSequenceCache, token_ids: list[int]) -> int:
        """Fill the empty `cache` with the longest kept prefix of token_ids; returns the positions loaded. May
        raise KVPoolFull (the cache could not grow to hold them)."""
        self.queried_tokens += len(token_ids)
        if len(cache):
            return 0
        digests, sources, parent = [], [], b""
        for index in range((len(token_ids) - 1) // BLOCK_SIZE):
            digest = _chain(parent, token_ids[index * BLOCK_SIZE: (index + 1) * BLOCK_SIZE])
            entry = self._find(digest)
            if entry is None:
                break
            digests.append(digest)
            sources.append(entry)
            parent = digest
        if not digests:
            return 0
        positions = len(digests) * BLOCK_SIZE
        self._touch(sources)  # most recently used: reserving below reclaims others first
        # Views taken after reserving: reserving may reclaim adopted tensors, which the views then keep alive
        # until they are copied (nothing rewrites them).
        cache.reserve(positions)
        cache.write_blocks([holder.block(index) for holder, index in sources], token_ids[:positions])
        cache.block_digests = digests
        self.hit_tokens += positions
        return positions

    @staticmethod
    def has_new_blocks(cache: StaticSequenceCache) -> bool:
        """Whether `cache` has a full block that store has not seen yet (its digests name those it saw)."""
        return len(cache) // BLOCK_SIZE > len(cache.block_digests)

    def store(self, cache: StaticSequenceCache) -> None:
        """Keep the full blocks of the running `cache` (its committed positions) that are not kept yet: where
        they are, without a copy."""
        full = len(cache) // BLOCK_SIZE
        digests = cache.block_digests
        if len(digests) >= full:
            return
        ids = cache.token_ids
        # A block is kept only under a kept parent: the cache's earlier blocks may have been evicted since they
        # were stored, and a block whose chain lost a link is not found by a load.
        kept = not digests or self._find(digests[-1]) is not None
        for index in range(len(digests), full):
            digest = _chain(digests[-1] if digests else b"", ids[index * BLOCK_SIZE: (index + 1) * BLOCK_SIZE])
            digests.append(digest)
            if kept and digest not in self._blocks:
                self._blocks[digest] = (cache, index)
                cache.kept_digests.append(digest)

    def adopt(self, cache: StaticSequenceCache) -> None:
        """`cache`'s sequence is done with it: keep its tensors for the kept blocks that live in them (with a pool,
        with the bytes the pool granted the cache), or let them go when none does."""
        owned = [digest for index, digest in enumerate(cache.block_digests)
                 if self._blocks.get(digest) == (cache, index)]
        if len(cache.kept_digests) > len(owned):  # blocks it kept and lost to a rollback: their entries go
            kept = set(owned)
            for digest in cache.kept_digests:
                entry = self._blocks.get(digest)
                if entry is not None and entry[0] is cache and digest not in kept:
                    del self._blocks[digest]
        cache.kept_digests = []
        if not owned:
            return
        if self.pool is not None:
            nbytes = self.pool.held_bytes(cache)
            self.pool.transfer(cache, self)  # the cache's release then gives back nothing
        else:
            nbytes = cache.nbytes
        adopted = _Adopted(cache, nbytes, owned)
        for digest in owned:
            self._blocks[digest] = (adopted, self._blocks[digest][1])
        self._adopted[id(adopted)] = adopted
        self.nbytes += nbytes
        if self.max_bytes is not None and self.nbytes > self.max_bytes:
            self.evict(self.nbytes - self.max_bytes)

    def evict(self, nbytes: int) -> int:
        """Drop adopted caches, least recently used first, until nbytes are freed (or none is left); returns the
        bytes freed."""
        freed = 0
        while self._adopted and freed < nbytes:
            _, adopted = self._adopted.popitem(last=False)
            for digest in adopted.digests:
                self._blocks.pop(digest, None)
            freed += adopted.nbytes
        self.nbytes -= freed
        if self.pool is not None and freed:
            self.pool.give(self, freed)
        return freed

    def clear(self) -> None:
        """Drop every kept block, those of running caches too (whose later blocks are then not kept: their chains'
        heads are gone)."""
        self.evict(self.nbytes)
        self._blocks.clear()

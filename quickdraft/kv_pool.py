"""KV-cache memory: the per-sequence static cache, a budget in blocks of 16 positions, and prefix caching.

`StaticSequenceCache`: a native runner's keys and values for one sequence in preallocated tensors, grown a
block of 16 positions (the packed key layout's unit) at a time; rollback is a length change.

`KVPool(bytes_per_token, budget_bytes)`: `bytes_per_token` is what one position costs over every runner whose
caches count (the target, and a draft model's own caches), so one block is 16 positions of the target AND the
draft; the budget holds `total_blocks = budget_bytes // (16 * bytes_per_token)` of them. The pool accounts
bytes per holder (a cache of a runner costing b bytes per position and holding C positions, C a multiple of
16, holds C * b bytes), so target and draft caches of different sizes share one budget exactly;
`used_blocks` is the bytes held, in blocks, rounded up. Static caches ask the pool before they grow and never
hold more than it granted; other caches (the transformers runner's) are accounted by their length rounded up
to blocks.

`PrefixCache`: full blocks of a runner's cache kept by the token prefix that produced them (a hash chain over
the blocks' tokens, as vLLM keys its blocks), least recently used evicted first, and copied into a new
sequence whose tokens start with that prefix: its prompt is then computed from the first block not found.
Caches stay one contiguous tensor per sequence (what the attention kernels read), so a reused block is
copied (a memcpy of a few hundred KB) rather than shared in place: prefix caching saves the prefill's
compute, not its memory. Under a budget the kept blocks live in the pool's free space and are evicted
before any running sequence is preempted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any, Callable

import torch

from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError

BLOCK_SIZE = 16


class KVPoolFull(QuickdraftError):
    """The pool cannot grant the positions asked for (the scheduler preempts; it never reaches a user)."""


def round_up(positions: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-positions // block_size) * block_size


def runner_bytes_per_token(runner: Any) -> int:
    """layers x kv_heads x head_dim x 2 (keys and values) x dtype size: one position of one of its caches
    (the Runner's kv_bytes_per_token)."""
    return int(runner.kv_bytes_per_token)


def cache_runners(engine: Any) -> list[Any]:
    """The runners whose per-sequence caches hold KV memory: the target, and the draft's if it runs a model."""
    draft = engine.proposer.draft_runner
    return [engine.target] if draft is None else [engine.target, draft]


def available_memory(device: torch.device) -> int:
    """Bytes free now: torch.cuda.mem_get_info on CUDA; psutil, else /proc/meminfo MemAvailable, otherwise."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil  # type: ignore

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise QuickdraftError("kv_cache_memory: cannot tell how much memory is available here (no psutil, no "
                          "/proc/meminfo); give the budget in bytes")


def check_budget(kv_cache_memory: Any) -> None:
    """Refuse a kv_cache_memory that is neither None, bytes > 0 (an int) nor a fraction in (0, 1] (a float)."""
    if kv_cache_memory is None:
        return
    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)):
        raise QuickdraftError("kv_cache_memory must be bytes (an integer) or a fraction in (0, 1] of the available "
                              f"memory (a float), or None; got {kv_cache_memory!r}")
    if isinstance(kv_cache_memory, int):
        if kv_cache_memory <= 0:
            raise QuickdraftError(f"kv_cache_memory in bytes must be > 0, got {kv_cache_memory}")
        return
    if not (0.0 < kv_cache_memory <= 1.0):  # NaN fails too
        raise QuickdraftError(f"kv_cache_memory as a fraction must be in (0, 1], got {kv_cache_memory!r}; "
                              "give larger budgets in bytes (an integer)")


def resolve_budget(kv_cache_memory: Any, device: torch.device) -> int | None:
    """kv_cache_memory as bytes: an int is bytes, a float in (0, 1] a fraction of the memory available now."""
    check_budget(kv_cache_memory)
    if kv_cache_memory is None or isinstance(kv_cache_memory, int):
        return kv_cache_memory
    return int(available_memory(device) * kv_cache_memory)


class KVPool:
    def __init__(self, bytes_per_token: int, budget_bytes: int, block_size: int = BLOCK_SIZE):
        if bytes_per_token <= 0 or block_size <= 0:
            raise QuickdraftError("KVPool: bytes_per_token and block_size must be > 0")
        self.bytes_per_token = int(bytes_per_token)
        self.block_size = int(block_size)
        self.block_bytes = self.bytes_per_token * self.block_size
        self.total_blocks = int(budget_bytes) // self.block_bytes
        self.budget_bytes = self.total_blocks * self.block_bytes  # whole blocks only
        self.used_bytes = 0
        self._held: dict[int, tuple[Any, int]] = {}  # id(holder) -> (holder, bytes held)
        # Called with a number of bytes when a grant would fail: frees what it can (evictable prefix blocks)
        # and returns the bytes it freed.
        self.reclaim: Callable[[int], int] | None = None

    # --- figures ---
    @property
    def max_tokens(self) -> int:
        return self.total_blocks * self.block_size

    @property
    def used_blocks(self) -> int:
        return -(-self.used_bytes // self.block_bytes)

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def num_caches(self) -> int:
        return len(self._held)

    def held_bytes(self, cache: Any) -> int:
        entry = self._held.get(id(cache))
        return 0 if entry is None else entry[1]

    # --- granting ---
    def grant(self, cache: Any, bytes_per_token: int, need: int, want: int) -> int:
        """Positions `cache` may hold: `want` if the pool has room for it, else the most that fits down to
        `need` (multiples of the block size); raises KVPoolFull when even `need` does not fit."""
        held = self.held_bytes(cache)
        room = self.free_bytes + held  # what this cache could hold in all
        need, want = round_up(need, self.block_size), round_up(max(want, need), self.block_size)
        if need * bytes_per_token > room and self.reclaim is not None:
            self.reclaim(need * bytes_per_token - room)
            room = self.free_bytes + held
        if need * bytes_per_token > room:
            raise KVPoolFull(f"the KV pool cannot grant {need} positions ({need * bytes_per_token} bytes; "
                             f"{self.free_bytes} of {self.budget_bytes} free)")
        positions = min(want, room // bytes_per_token // self.block_size * self.block_size)
        positions = max(positions, need)
        nbytes = positions * bytes_per_token
        self.used_bytes += nbytes - held
        self._held[id(cache)] = (cache, nbytes)
        return positions

    def take(self, holder: Any, nbytes: int) -> bool:
        """Add nbytes to what `holder` holds if they are free now (no reclaiming); False otherwise."""
        if nbytes > self.free_bytes:
            return False
        self.used_bytes += nbytes
        self._held[id(holder)] = (holder, self.held_bytes(holder) + nbytes)
        return True

    def give(self, holder: Any, nbytes: int) -> None:
        """Return nbytes of what `holder` holds."""
        held = self.held_bytes(holder)
        if nbytes > held:
            raise ValueError(f"KVPool.give: {nbytes} bytes returned, {held} held")
        self.used_bytes -= nbytes
        if held == nbytes:
            self._held.pop(id(holder))
        else:
            self._held[id(holder)] = (holder, held - nbytes)

    def release(self, cache: Any) -> None:
        """Return every block `cache` holds (a no-op for a cache that holds none)."""
        entry = self._held.pop(id(cache), None)
        if entry is not None:
            self.used_bytes -= entry[1]

    def ensure(self, cache: Any, length: int, bytes_per_token: int, limit: int) -> bool:
        """Make `cache` able to hold `length` positions (at most `limit`, its runner's max_len), within the
        budget; False (nothing changed beyond what was already held) when the pool cannot grant it."""
        length = min(length, limit)
        if isinstance(cache, StaticSequenceCache):  # it allocates what the pool grants
            cache.attach_pool(self)
            try:
                cache.reserve(length)
            except KVPoolFull:
                return False
            return True
        # Other caches allocate as they go: account their length in whole blocks.
        if round_up(length, self.block_size) * bytes_per_token <= self.held_bytes(cache):
            return True
        try:
            self.grant(cache, bytes_per_token, length, length)
        except KVPoolFull:
            return False
        return True

    def usage(self) -> dict[str, int]:
        return {"used_blocks": self.used_blocks, "total_blocks": self.total_blocks, "block_size": self.block_size,
                "used_bytes": self.used_bytes, "budget_bytes": self.budget_bytes}


class StaticSequenceCache(SequenceCache):
    """A native runner's keys and values for one sequence in preallocated tensors [layers, kv_heads, capacity,
    head_dim] (keys packed [layers, kv_heads, capacity/16, head_dim/2, 16, 2] where the CPU kernels read
    them), position i at index i. Rolling back only shortens the token list (SequenceCache.rollback): later
    writes overwrite the rejected positions.

    Growth is block-granular: the capacity is a multiple of 16 positions and grows by max(64 positions, 25%),
    capped at the runner's max_len, keeping the contents. With a KV pool attached (the scheduler's memory
    budget) the cache asks the pool first and holds exactly what it granted: between what was asked for and
    the policy's size, or KVPoolFull."""

    BLOCK = BLOCK_SIZE

    def __init__(self, runner: Any):  # a quickdraft.models.native.NativeRunner
        super().__init__()
        self._runner = runner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pool: KVPool | None = None  # granting this cache's growth; None: no budget
        # The prefix digests of its first full blocks (PrefixCache's bookkeeping; cut on rollback).
        self.block_digests: list[bytes] = []

    @property
    def runner(self) -> Any:
        return self._runner

    @property
    def capacity(self) -> int:
        return 0 if self.values is None else self.values.shape[2]

    @property
    def bytes_per_token(self) -> int:
        return runner_bytes_per_token(self._runner)

    @property
    def nbytes(self) -> int:
        """The bytes its tensors take now."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def attach_pool(self, pool: KVPool) -> None:
        if self.pool is not None and self.pool is not pool:
            raise ValueError("this cache already draws on another KV pool")
        self.pool = pool

    def reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        need = round_up(length, self.BLOCK)
        limit = max(round_up(self._runner.max_len, self.BLOCK), need)
        want = min(max(need, round_up(self.capacity + max(64, self.capacity // 4), self.BLOCK)), limit)
        if self.pool is not None:
            want = self.pool.grant(self, self.bytes_per_token, need, want)  # raises KVPoolFull below `need`
        self._resize(want)

    def _resize(self, capacity: int) -> None:
        r = self._runner
        shape = (r.num_layers, r.num_kv_heads, capacity, r.head_dim)
        values = torch.empty(shape, dtype=r.dtype, device=r.device)
        if r.packed_keys:  # each head's keys packed like a weight (see kernels/cpu_attention.cpp)
            keys = torch.empty((r.num_layers, r.num_kv_heads, capacity // 16, r.head_dim // 2, 16, 2),
                               dtype=r.dtype, device=r.device)
        else:
            keys = torch.empty(shape, dtype=r.dtype, device=r.device)
        if self.keys is not None:
            used = len(self)
            filled = -(-used // 16) if r.packed_keys else used  # blocks of 16 positions, or positions
            keys[:, :, :filled] = self.keys[:, :, :filled]
            values[:, :, :used] = self.values[:, :, :used]
        self.keys, self.values = keys, values

    def rollback(self, length: int) -> None:
        super().rollback(length)
        del self.block_digests[length // self.BLOCK:]

    def release(self) -> None:
        """Drop every position and the tensors, and give the blocks back to the pool."""
        if self.pool is not None:
            self.pool.release(self)
        self.keys = self.values = None
        self._token_ids = []
        self._pending = []
        self.block_digests = []

    def read_block(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of positions [16 index, 16 index + 16) (all layers and heads)."""
        lo, hi = index * self.BLOCK, (index + 1) * self.BLOCK
        keys = self.keys[:, :, index] if self._runner.packed_keys else self.keys[:, :, lo:hi]
        return keys.clone(), self.values[:, :, lo:hi].clone()

    def write_blocks(self, blocks: list[tuple[torch.Tensor, torch.Tensor]], token_ids: list[int]) -> None:
        """Fill an empty cache with `blocks` (read_block's copies) as the positions of token_ids (16 per
        block). The caller reserved room for them."""
        if len(self) or len(token_ids) != len(blocks) * self.BLOCK or self.capacity < len(token_ids):
            raise ValueError("write_blocks: an empty cache with room for exactly the blocks' tokens")
        for index, (keys, values) in enumerate(blocks):
            lo, hi = index * self.BLOCK, (index + 1) * self.BLOCK
            if self._runner.packed_keys:
                self.keys[:, :, index] = keys
            else:
                self.keys[:, :, lo:hi] = keys
            self.values[:, :, lo:hi] = values
        self._token_ids = list(token_ids)

    def _new_kv(self) -> None:
        return None  # keys and values live in self.keys / self.values

    def _drop_kv(self, count: int) -> None:
        pass  # positions past the length are overwritten by the next writes


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
        self._blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()  # LRU first
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, loaded from kept blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return len(self._blocks) * self.block_bytes

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
        blocks = [self._blocks[digest] for digest in digests]  # held here: reserving may evict them
        self._touch(digests)
        cache.reserve(positions)
        cache.write_blocks(blocks, token_ids[:positions])
        cache.block_digests = digests
        self.hit_tokens += positions
        return positions

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
                self._blocks[digest] = cache.read_block(index)
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
        self._blocks.popitem(last=False)  # its bytes (or its place under the cap) go to the new block
        return True

    def evict(self, nbytes: int) -> int:
        """Drop least recently used blocks until nbytes are freed (or none is left); returns the bytes freed."""
        freed = 0
        while self._blocks and freed < nbytes:
            self._blocks.popitem(last=False)
            freed += self.block_bytes
        if self.pool is not None and freed:
            self.pool.give(self, freed)
        return freed

    def clear(self) -> None:
        self.evict(self.nbytes)


# Without a KV budget, a prefix cache keeps at most this many positions per runner.
DEFAULT_PREFIX_CACHE_TOKENS = 8192


class KVMemory:
    """The KV memory of one LLM: the runners whose caches count, their bytes per token, the pool (None without
    a budget) and a prefix cache per runner with static caches (when enabled). Shared by every scheduler of
    the LLM, so that kept prefixes outlive one `generate` call (multi-turn chat re-sends the conversation)."""

    def __init__(self, engine: Any, budget_bytes: int | None = None, enable_prefix_caching: bool = False):
        self.runners = cache_runners(engine)
        self.bytes_per_token = [runner_bytes_per_token(r) for r in self.runners]
        self.pool: KVPool | None = None
        if budget_bytes is not None:
            self.pool = KVPool(sum(self.bytes_per_token), budget_bytes)
            if self.pool.total_blocks < 1:
                raise QuickdraftError(f"kv_cache_memory of {budget_bytes} bytes holds no block of KV cache "
                                      f"({self.pool.block_bytes} bytes: 16 positions x "
                                      f"{self.pool.bytes_per_token} bytes per token); give more")
        # One prefix cache per runner whose caches are static and keyed by the target's tokens (None for the
        # others: a draft with another tokenizer holds its own tokens).
        aligned = [True, engine.proposer.draft_reads_target_tokens]
        self.prefix_caches: list[PrefixCache | None] = [
            PrefixCache(r, self.pool, None if self.pool else DEFAULT_PREFIX_CACHE_TOKENS // BLOCK_SIZE)
            if enable_prefix_caching and same_tokens and isinstance(r.new_cache(), StaticSequenceCache) else None
            for r, same_tokens in zip(self.runners, aligned)]
        if self.pool is not None:
            self.pool.reclaim = self._reclaim

    @property
    def prefix_caching(self) -> bool:
        return any(p is not None for p in self.prefix_caches)

    def _reclaim(self, nbytes: int) -> int:
        freed = 0
        for prefix in self.prefix_caches:
            if prefix is not None and freed < nbytes:
                freed += prefix.evict(nbytes - freed)
        return freed

    def prefix_bytes(self) -> int:
        return sum(p.nbytes for p in self.prefix_caches if p is not None)

    def clear_prefix_caches(self) -> None:
        for prefix in self.prefix_caches:
            if prefix is not None:
                prefix.clear()


def estimate(engine: Any, budget_bytes: int | None) -> dict[str, Any]:
    """What a budget holds, before running: bytes per token (every counted runner), blocks, max tokens."""
    per_runner = [(runner.name, runner_bytes_per_token(runner)) for runner in cache_runners(engine)]
    bytes_per_token = sum(b for _, b in per_runner)
    out: dict[str, Any] = {"bytes_per_token": bytes_per_token, "bytes_per_token_by_runner": per_runner,
                           "block_size": BLOCK_SIZE, "budget_bytes": budget_bytes,
                           "total_blocks": None, "max_tokens": None}
    if budget_bytes is not None:
        blocks = budget_bytes // (bytes_per_token * BLOCK_SIZE)
        out.update(total_blocks=blocks, max_tokens=blocks * BLOCK_SIZE, budget_bytes=blocks * bytes_per_token
                   * BLOCK_SIZE)
    return out


__all__ = ["KVPool", "KVPoolFull", "KVMemory", "PrefixCache", "StaticSequenceCache", "BLOCK_SIZE", "estimate", "check_budget", "resolve_budget", "runner_bytes_per_token",
           "available_memory", "cache_runners"]

"""The KV budget: blocks of 16 positions, a pool that grants them, and what a budget value means.

`KVPool(bytes_per_token, budget_bytes)`: `bytes_per_token` is what one position costs over every runner whose
caches count (the target, and a draft model's own caches), so one block is 16 positions of the target AND the
draft; the budget holds `total_blocks = budget_bytes // (16 * bytes_per_token)` of them. The pool accounts
bytes per holder (a cache of a runner costing b bytes per position and holding C positions, C a multiple of
16, holds C * b bytes), so target and draft caches of different sizes share one budget exactly;
`used_blocks` is the bytes held, in blocks, rounded up. Caches that allocate what the pool grants
(`PoolGrantedCache`: the native runner's static caches) ask the pool before they grow and never hold more
than it granted; other caches (the transformers runner's) are accounted by their length rounded up to blocks.

The pool knows caches only through `PoolGrantedCache`, declared here: the cache classes import the pool, never
the other way round.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

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


class PoolGrantedCache:
    """A cache that allocates exactly what a KVPool grants it (quickdraft.kv.static_cache.StaticSequenceCache):
    `KVPool.ensure` attaches the pool and asks the cache to reserve, instead of accounting its length."""

    def attach_pool(self, pool: "KVPool") -> None:
        raise NotImplementedError

    def reserve(self, length: int) -> None:
        """Room for `length` positions, granted by the attached pool; KVPoolFull when it cannot grant them."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop every position and give the granted blocks back to the pool."""
        raise NotImplementedError


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

    def transfer(self, holder: Any, to: Any) -> None:
        """Whatever `holder` holds is held by `to` from now on (a finished cache's tensors kept for prefix
        caching): nothing is freed or taken."""
        entry = self._held.pop(id(holder), None)
        if entry is not None:
            self._held[id(to)] = (to, self.held_bytes(to) + entry[1])

    def release(self, cache: Any) -> None:
        """Return every block `cache` holds (a no-op for a cache that holds none)."""
        entry = self._held.pop(id(cache), None)
        if entry is not None:
            self.used_bytes -= entry[1]

    def release_cache(self, cache: Any) -> None:
        """A sequence is done with `cache`: a cache that allocates what the pool grants drops its positions and
        gives its blocks back itself; any other is released here (its blocks were accounted by its length)."""
        if isinstance(cache, PoolGrantedCache):
            cache.release()
        else:
            self.release(cache)

    def ensure(self, cache: Any, length: int, bytes_per_token: int, limit: int) -> bool:
        """Make `cache` able to hold `length` positions (at most `limit`, its runner's max_len), within the
        budget; False (nothing changed beyond what was already held) when the pool cannot grant it."""
        length = min(length, limit)
        if isinstance(cache, PoolGrantedCache):  # it allocates what the pool grants
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

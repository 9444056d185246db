"""A KV-cache memory budget, in blocks of 16 positions (the packed key layout's unit).

`KVPool(bytes_per_token, budget_bytes)`: `bytes_per_token` is what one position costs over every runner whose
caches count (the target, and a draft model's own caches), so one block is 16 positions of the target AND the
draft; the budget holds `total_blocks = budget_bytes // (16 * bytes_per_token)` of them. The pool accounts
bytes per cache (a cache of a runner costing b bytes per position and holding C positions, C a multiple of
16, holds C * b bytes), so target and draft caches of different sizes share one budget exactly;
`used_blocks` is the bytes held, in blocks, rounded up.

Native caches (StaticSequenceCache) ask the pool before they grow and never hold more than it granted;
other caches (the transformers runner's) are accounted by their length rounded up to blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from quickdraft.errors import QuickdraftError

BLOCK_SIZE = 16


class KVPoolFull(QuickdraftError):
    """The pool cannot grant the positions asked for (the scheduler preempts; it never reaches a user)."""


def round_up(positions: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-positions // block_size) * block_size


def runner_bytes_per_token(runner: Any) -> int:
    """layers x kv_heads x head_dim x 2 (keys and values) x dtype size: one position of one of its caches."""
    if all(hasattr(runner, name) for name in ("num_kv_heads", "head_dim")):  # the native runner
        kv_heads, head_dim = runner.num_kv_heads, runner.head_dim
    else:
        config = runner.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    size = torch.empty((), dtype=runner.dtype).element_size()
    return int(runner.num_layers) * int(kv_heads) * int(head_dim) * 2 * size


def cache_runners(engine: Any) -> list[Any]:
    """The runners whose per-sequence caches hold KV memory: the target, and the draft's if it runs a model."""
    runners = [engine.target]
    draft = getattr(engine.proposer, "runner", None)
    if draft is not None and getattr(engine.proposer, "runs_a_model", False):
        runners.append(draft)
    return runners


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
        self._held: dict[int, tuple[Any, int]] = {}  # id(cache) -> (cache, bytes held)

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
        if need * bytes_per_token > room:
            raise KVPoolFull(f"the KV pool cannot grant {need} positions ({need * bytes_per_token} bytes; "
                             f"{self.free_bytes} of {self.budget_bytes} free)")
        positions = min(want, room // bytes_per_token // self.block_size * self.block_size)
        positions = max(positions, need)
        nbytes = positions * bytes_per_token
        self.used_bytes += nbytes - held
        self._held[id(cache)] = (cache, nbytes)
        return positions

    def release(self, cache: Any) -> None:
        """Return every block `cache` holds (a no-op for a cache that holds none)."""
        entry = self._held.pop(id(cache), None)
        if entry is not None:
            self.used_bytes -= entry[1]

    def ensure(self, cache: Any, length: int, bytes_per_token: int, limit: int) -> bool:
        """Make `cache` able to hold `length` positions (at most `limit`, its runner's max_len), within the
        budget; False (nothing changed beyond what was already held) when the pool cannot grant it."""
        length = min(length, limit)
        if hasattr(cache, "attach_pool"):  # a StaticSequenceCache: it allocates what the pool grants
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


__all__ = ["KVPool", "KVPoolFull", "BLOCK_SIZE", "estimate", "check_budget", "resolve_budget", "runner_bytes_per_token",
           "available_memory", "cache_runners"]

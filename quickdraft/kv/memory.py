"""The KV memory of one LLM: which runners' caches count, the pool over them, and their prefix caches.

`KVMemory` puts the pieces of quickdraft.kv together for the scheduler (pool.py: the budget; static_cache.py:
the caches that draw on it; prefix_cache.py: kept prompt blocks); `estimate` says what a budget holds before
anything runs.
"""

from __future__ import annotations

from typing import Any

from quickdraft.errors import QuickdraftError
from quickdraft.kv.pool import BLOCK_SIZE, KVPool, runner_bytes_per_token
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.kv.static_cache import StaticSequenceCache


def cache_runners(engine: Any) -> list[Any]:
    """The runners whose per-sequence caches hold KV memory: the target, and the draft's if it runs a model."""
    draft = engine.proposer.draft_runner
    return [engine.target] if draft is None else [engine.target, draft]


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

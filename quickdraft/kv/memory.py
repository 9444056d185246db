"""The KV memory of one LLM: which caches count, the pool over them, and their prefix caches.

`KVMemory` puts the pieces of quickdraft.kv together for the scheduler (pool.py: the budget; static_cache.py:
the caches that draw on it; prefix_cache.py: kept prompt blocks). It is told which caches count by
`CountedCaches` entries (the engine describes its target and its draft model: Engine.kv_caches), each saying
where a sequence keeps its cache of that runner and what that cache is keyed by, so the scheduler asks for a
sequence's reservation, release and prefix loading by the sequence alone. `estimate` says what a budget holds
before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from quickdraft.errors import QuickdraftError
from quickdraft.kv.pool import BLOCK_SIZE, KVPool, KVPoolFull, round_up, runner_bytes_per_token
from quickdraft.kv.prefix_cache import PrefixCache

# Without a KV budget, a prefix cache keeps at most this many positions per runner.
DEFAULT_PREFIX_CACHE_TOKENS = 8192


@dataclass(frozen=True)
class CountedCaches:
    """A runner whose per-sequence caches hold KV memory, and how a sequence's cache of it is found.

    runner: a models.base.Runner (its new_cache, max_len, kv_bytes_per_token and name are read); cache_of: a
    sequence's cache of this runner (None: it holds none now); history_of: the token ids that cache is keyed by;
    length_of: how many positions a prompt (in the target's tokens) takes in it; shares_prefixes: its caches hold
    the target's tokens, so prefix caching may key them by the target's prefixes."""

    runner: Any
    cache_of: Callable[[Any], Any]
    history_of: Callable[[Any], list[int]]
    length_of: Callable[[list[int]], int] = len
    shares_prefixes: bool = True

    @property
    def bytes_per_token(self) -> int:
        return runner_bytes_per_token(self.runner)


class KVMemory:
    """The KV memory of one LLM: the caches that count, their bytes per token, the pool (None without a budget)
    and a prefix cache per runner with static caches (when enabled). Shared by every scheduler of the LLM, so
    that kept prefixes outlive one `generate` call (multi-turn chat re-sends the conversation).

    counted: the target's caches first (what a request's prompt is checked against), then a draft model's."""

    def __init__(self, counted: list[CountedCaches], budget_bytes: int | None = None,
                 enable_prefix_caching: bool = False):
        self.counted = list(counted)
        self._bytes_per_token = [c.bytes_per_token for c in self.counted]
        self.pool: KVPool | None = None
        if budget_bytes is not None:
            self.pool = KVPool(sum(self._bytes_per_token), budget_bytes)
            if self.pool.total_blocks < 1:
                raise QuickdraftError(f"kv_cache_memory of {budget_bytes} bytes holds no block of KV cache "
                                      f"({self.pool.block_bytes} bytes: 16 positions x "
                                      f"{self.pool.bytes_per_token} bytes per token); give more")
        # One prefix cache per runner whose caches are copied block by block and keyed by the target's tokens
        # (None for the others: a draft with another tokenizer holds its own tokens).
        self.prefix_caches: list[PrefixCache | None] = [
            PrefixCache(c.runner, self.pool, None if self.pool else DEFAULT_PREFIX_CACHE_TOKENS // BLOCK_SIZE)
            if enable_prefix_caching and c.shares_prefixes and PrefixCache.copies(c.runner) else None
            for c in self.counted]
        if self.pool is not None:
            self.pool.reclaim = self._reclaim

    @property
    def runners(self) -> list[Any]:
        return [c.runner for c in self.counted]

    # --- a sequence's caches --------------------------------------------------------------------------------
    def next_step_lengths(self, seq: Any, extra: int) -> list[int]:
        """The positions each counted cache of `seq` needs for its next step: its history plus `extra` (the
        step's drafts and its bonus row)."""
        return [len(c.history_of(seq)) + extra for c in self.counted]

    def reserve(self, seq: Any, extra: int) -> bool:
        """Make every counted cache of `seq` able to hold its next step (next_step_lengths), within the budget;
        False where the pool cannot grant it."""
        for c, bytes_per_token in zip(self.counted, self._bytes_per_token):
            cache = c.cache_of(seq)
            if cache is not None and not self.pool.ensure(cache, len(c.history_of(seq)) + extra, bytes_per_token,
                                                          c.runner.max_len):
                return False
        return True

    def release(self, seq: Any) -> None:
        """Give the pool back the blocks of seq's counted caches (their contents go)."""
        if self.pool is None:
            return
        for c in self.counted:
            cache = c.cache_of(seq)
            if cache is not None:
                self.pool.release_cache(cache)

    def load_prefix(self, seq: Any) -> bool:
        """Before a sequence first runs (or reruns after preemption): copy the kept blocks of its longest known
        prefix into its empty caches. False when the pool could not hold them (the sequence waits)."""
        for c, prefix in zip(self.counted, self.prefix_caches):
            cache = c.cache_of(seq) if prefix is not None else None
            if cache is None or len(cache):
                continue
            if self.pool is not None:
                cache.attach_pool(self.pool)
            try:
                prefix.load(cache, c.history_of(seq))
            except KVPoolFull:
                return False
        return True

    def store_prefix(self, seq: Any) -> None:
        """Keep the full blocks of seq's caches that prefix caching does not hold yet."""
        for c, prefix in zip(self.counted, self.prefix_caches):
            if prefix is not None:
                cache = c.cache_of(seq)
                if cache is not None:
                    prefix.store(cache)

    # --- requests ----------------------------------------------------------------------------------------------
    def prompt_lengths(self, prompt_ids: list[int]) -> list[int]:
        """The positions a prompt takes in each counted cache (a draft with another tokenizer reads it in its
        own tokens)."""
        return [c.length_of(prompt_ids) for c in self.counted]

    def bytes_for(self, lengths: list[int]) -> int:
        """The KV bytes of caches of these lengths (one per counted cache, each capped by its runner's context),
        in whole blocks."""
        return sum(round_up(min(length, c.runner.max_len)) * bytes_per_token
                   for length, c, bytes_per_token in zip(lengths, self.counted, self._bytes_per_token))

    # --- prefix caching ---------------------------------------------------------------------------------------
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


def estimate(counted: list[CountedCaches], budget_bytes: int | None) -> dict[str, Any]:
    """What a budget holds, before running: bytes per token (every counted runner), blocks, max tokens."""
    per_runner = [(c.runner.name, c.bytes_per_token) for c in counted]
    bytes_per_token = sum(b for _, b in per_runner)
    out: dict[str, Any] = {"bytes_per_token": bytes_per_token, "bytes_per_token_by_runner": per_runner,
                           "block_size": BLOCK_SIZE, "budget_bytes": budget_bytes,
                           "total_blocks": None, "max_tokens": None}
    if budget_bytes is not None:
        blocks = budget_bytes // (bytes_per_token * BLOCK_SIZE)
        out.update(total_blocks=blocks, max_tokens=blocks * BLOCK_SIZE, budget_bytes=blocks * bytes_per_token
                   * BLOCK_SIZE)
    return out

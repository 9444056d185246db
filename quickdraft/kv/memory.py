"""The KV memory of one LLM: which caches count, the pool over them, and their prefix caches.

`KVMemory` puts the pieces of quickdraft.kv together for the scheduler (pool.py: the budget; static_cache.py:
the caches that draw on it; prefix_cache.py: kept prompt blocks; paged.py and paged_cache.py: a runner whose
caches are block tables into one paged pool of its own, the CUDA runner's). It is told which caches count by
`CountedCaches` entries (the engine describes its target and its draft model: Engine.kv_caches), each saying
where a sequence keeps its cache of that runner and what that cache is keyed by, so the scheduler asks for a
sequence's reservation, release and prefix loading by the sequence alone. `estimate` says what a budget holds
before anything runs.

A runner with a paged pool (its `kv_pool`: kv/paged.py) is budgeted in that pool's blocks, not in the byte pool:
a step's blocks are reserved ahead in the pool (PagedSequenceCache.reserve), release frees them (kept prefix
blocks stay cached until evicted), and prefix caching shares kept blocks by reference (match_prefix) instead of
copying them. With a byte budget (kv_cache_memory), the budget is split between the paged pools and the byte
pool in proportion to their runners' bytes per token, and each paged pool is sized to its share.
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

    @property
    def paged_pool(self) -> Any:
        """The runner's paged KV pool (kv/paged.PagedKVPool) where its caches live in one, else None."""
        return getattr(self.runner, "kv_pool", None)  # only runners with paged caches declare one


class KVMemory:
    """The KV memory of one LLM: the caches that count, their bytes per token, the pool (None without a budget)
    and a prefix cache per runner with static caches (when enabled). Shared by every scheduler of the LLM, so
    that kept prefixes outlive one `generate` call (multi-turn chat re-sends the conversation).

    counted: the target's caches first (what a request's prompt is checked against), then a draft model's."""

    def __init__(self, counted: list[CountedCaches], budget_bytes: int | None = None,
                 enable_prefix_caching: bool = False):
        self.counted = list(counted)
        paged = [c.paged_pool is not None for c in self.counted]
        if budget_bytes is not None and any(paged):  # each paged pool sized to its runner's share of the budget
            total = sum(c.bytes_per_token for c in self.counted)
            for c, is_paged in zip(self.counted, paged):
                if is_paged:
                    c.runner.size_kv_pool(budget_bytes * c.bytes_per_token // total)
            budget_bytes = budget_bytes * sum(c.bytes_per_token for c, p in zip(self.counted, paged) if not p) // total
            budget_bytes = budget_bytes or None
        # Per counted runner: its paged pool, or None (its caches are budgeted by the byte pool, if any).
        self.paged_pools = [c.paged_pool if is_paged else None for c, is_paged in zip(self.counted, paged)]
        self._bytes_per_token = [0 if p else c.bytes_per_token for c, p in zip(self.counted, paged)]
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
            PrefixCache(c.runner, self.pool, None if self.pool else DEFAULT_PREFIX_CACHE_TOKENS)
            if enable_prefix_caching and c.shares_prefixes and not p and PrefixCache.copies(c.runner) else None
            for c, p in zip(self.counted, paged)]
        # Paged caches share kept prefix blocks by reference (PagedSequenceCache.load_prefix / store_prefix).
        self.shares_paged_prefixes = [enable_prefix_caching and c.shares_prefixes and p
                                      for c, p in zip(self.counted, paged)]
        if self.pool is not None:
            self.pool.reclaim = self._reclaim

    @property
    def runners(self) -> list[Any]:
        return [c.runner for c in self.counted]

    @property
    def bounded(self) -> bool:
        """Whether a sequence's next step must be reserved before it runs: a byte budget, or a paged pool (which
        is always finite)."""
        return self.pool is not None or any(p is not None for p in self.paged_pools)

    # --- a sequence's caches --------------------------------------------------------------------------------
    def next_step_lengths(self, seq: Any, extra: int) -> list[int]:
        """The positions each counted cache of `seq` needs for its next step: its history plus `extra` (the
        step's drafts and its bonus row)."""
        return [len(c.history_of(seq)) + extra for c in self.counted]

    def reserve(self, seq: Any, extra: int) -> bool:
        """Make every counted cache of `seq` able to hold its next step (next_step_lengths), within the budget;
        False where the pool cannot grant it."""
        for c, bytes_per_token, paged in zip(self.counted, self._bytes_per_token, self.paged_pools):
            cache = c.cache_of(seq)
            if cache is None:
                continue
            length = len(c.history_of(seq)) + extra
            if paged is not None:
                try:
                    cache.reserve(min(length, c.runner.max_len))
                except KVPoolFull:
                    return False
            elif self.pool is not None and not self.pool.ensure(cache, length, bytes_per_token, c.runner.max_len):
                return False
        return True

    def release(self, seq: Any) -> None:
        """Give the pools back the blocks of seq's counted caches (their contents go), but for those whose kept
        prefix blocks live in them: prefix caching adopts them."""
        for c, paged, prefix in zip(self.counted, self.paged_pools, self.prefix_caches):
            cache = c.cache_of(seq)
            if cache is None:
                continue
            if paged is not None:
                cache.release()
                continue
            if prefix is not None:
                prefix.adopt(cache)
            if self.pool is not None:
                self.pool.release_cache(cache)

    def load_prefix(self, seq: Any) -> bool:
        """Before a sequence first runs (or reruns after preemption): copy the kept blocks of its longest known
        prefix into its empty caches (point a paged cache's table at them). False when the pool could not hold
        them (the sequence waits)."""
        for c, shares in zip(self.counted, self.shares_paged_prefixes):
            cache = c.cache_of(seq) if shares else None
            if cache is not None and not len(cache):
                cache.load_prefix(c.history_of(seq))  # takes no free block: kept blocks by reference
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
        self.store_prefixes([seq])

    def store_prefixes(self, seqs: list[Any]) -> None:
        """store_prefix for every sequence of a step, in order: the caches that keep prefixes are found once, and
        a byte-pool cache none of whose blocks completed since its last store is passed over at the cost of a
        comparison (PrefixCache.has_new_blocks: a step completes a block for about one sequence in 16)."""
        shared = [c.cache_of for c, shares in zip(self.counted, self.shares_paged_prefixes) if shares]
        kept = [(c.cache_of, prefix) for c, prefix in zip(self.counted, self.prefix_caches) if prefix is not None]
        if not shared and not kept:
            return
        for cache_of in shared:
            for seq in seqs:
                cache = cache_of(seq)
                if cache is not None:
                    cache.store_prefix()
        for cache_of, prefix in kept:
            has_new_blocks = prefix.has_new_blocks
            for cache in map(cache_of, seqs):
                if cache is not None and has_new_blocks(cache):
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

    def paged_shortfall(self, lengths: list[int]) -> str | None:
        """Where caches of these lengths (one per counted cache, each capped by its runner's context) would not
        fit their paged pool even alone: what they need and what it holds; None where they fit."""
        for length, c, pool in zip(lengths, self.counted, self.paged_pools):
            if pool is not None:
                need = -(-min(length, c.runner.max_len) // pool.block_size)
                if need > pool.total_blocks:
                    return (f"{need} blocks of {pool.block_size} positions of {c.runner.name}'s paged KV pool, which "
                            f"holds {pool.total_blocks}")
        return None

    def usage(self) -> dict[str, int | float] | None:
        """The budget's figures (KVPool.usage and the paged pools' PagedKVPool.usage, summed: used, cached,
        free and total blocks, bytes), with what requests hold (request_blocks, request_bytes; usage: its
        fraction of the budget, vLLM's kv_cache_usage_perc; kept prefix blocks are evictable, so free, and
        free_blocks counts them); None when unbounded. used_blocks counts the byte pool's kept prefix blocks
        too, not a paged pool's cached ones."""
        if not self.bounded:
            return None
        out: dict[str, int | float] = {"used_blocks": 0, "cached_blocks": 0, "free_blocks": 0, "total_blocks": 0,
                                       "block_size": BLOCK_SIZE, "used_bytes": 0, "budget_bytes": 0,
                                       "prefix_cached_bytes": 0, "request_blocks": 0}
        parts = [] if self.pool is None else [self.pool.usage()]
        prefix = 0  # the byte pool's kept prefix blocks: in its used bytes (a paged pool's cached blocks are not)
        if self.pool is not None:
            prefix = self.prefix_bytes()
            cached = -(-prefix // self.pool.block_bytes)
            parts[0].update(cached_blocks=cached, prefix_cached_bytes=prefix, request_blocks=self.pool.used_blocks
                            - cached, free_blocks=self.pool.total_blocks - self.pool.used_blocks + cached)
        for pool in self.paged_pools:
            if pool is not None:
                figures = pool.usage()
                parts.append({**figures, "prefix_cached_bytes": figures["cached_blocks"] * pool.bytes_per_block,
                              "request_blocks": figures["used_blocks"]})
        for part in parts:
            for key in out:
                if key != "block_size":
                    out[key] += part[key]
        out["prefix_cached_blocks"] = out["cached_blocks"]
        out["request_bytes"] = held = out["used_bytes"] - prefix
        out["usage"] = held / out["budget_bytes"] if out["budget_bytes"] else 0.0
        return out

    def runner_metrics(self) -> dict[str, int]:
        """How the counted runners with paged pools ran (CudaRunner.kv_pool_metrics: graph replays, eager and
        unbucketed steps), summed; empty without one."""
        out: dict[str, int] = {}
        for c, pool in zip(self.counted, self.paged_pools):
            if pool is not None:
                for key, value in c.runner.kv_pool_metrics().items():
                    if key.endswith("_steps") or key.startswith("graph_"):
                        out[key] = out.get(key, 0) + value
        return out

    # --- prefix caching ---------------------------------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        return any(p is not None for p in self.prefix_caches) or any(self.shares_paged_prefixes)

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

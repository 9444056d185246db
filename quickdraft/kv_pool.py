"""The old home of the KV-cache memory, kept for users who import it: everything lives in quickdraft.kv now
(kv/pool.py: the budget and pool; kv/static_cache.py; kv/prefix_cache.py; kv/memory.py)."""

from quickdraft.kv import (BLOCK_SIZE, DEFAULT_PREFIX_CACHE_TOKENS, KVMemory, KVPool, KVPoolFull, PrefixCache,
                           StaticSequenceCache, available_memory, cache_runners, check_budget, estimate,
                           resolve_budget, round_up, runner_bytes_per_token)

__all__ = ["KVPool", "KVPoolFull", "KVMemory", "PrefixCache", "StaticSequenceCache", "BLOCK_SIZE",
           "DEFAULT_PREFIX_CACHE_TOKENS", "estimate", "check_budget", "resolve_budget", "round_up",
           "runner_bytes_per_token", "available_memory", "cache_runners"]

"""KV-cache memory: the budget and its pool (pool.py), the native runner's static per-sequence caches
(static_cache.py), prefix caching (prefix_cache.py), and one LLM's KV memory putting them together
(memory.py). Imports point down that list's reverse: memory -> prefix_cache -> static_cache -> pool. The paged
pool of a batch (paged.py: block tables, prefix blocks shared by reference) imports only pool.py; a sequence's
cache in it (paged_cache.py) imports paged.py."""

from quickdraft.kv.memory import DEFAULT_PREFIX_CACHE_TOKENS, CountedCaches, KVMemory, estimate
from quickdraft.kv.paged import NULL_BLOCK, PagedKVPool, PagedSequence
from quickdraft.kv.paged_cache import PagedSequenceCache
from quickdraft.kv.pool import (BLOCK_SIZE, KVPool, KVPoolFull, PoolGrantedCache, available_memory, check_budget,
                                resolve_budget, round_up, runner_bytes_per_token)
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.kv.static_cache import StaticSequenceCache

__all__ = ["KVPool", "KVPoolFull", "KVMemory", "PrefixCache", "StaticSequenceCache", "PoolGrantedCache", "BLOCK_SIZE",
           "DEFAULT_PREFIX_CACHE_TOKENS", "estimate", "check_budget", "resolve_budget", "round_up",
           "runner_bytes_per_token", "available_memory", "CountedCaches", "PagedKVPool", "PagedSequence", "NULL_BLOCK",
           "PagedSequenceCache"]

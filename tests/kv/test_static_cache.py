"""The native runner's static per-sequence cache (quickdraft/kv/static_cache.py): its bytes per token, and
growth in blocks of 16 positions bounded by the policy, the runner's max_len and the KV pool."""

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM
from quickdraft.kv import KVPool, KVPoolFull, StaticSequenceCache, runner_bytes_per_token

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run on one thread


def test_bytes_per_token_matches_the_allocated_tensors():
    config = {"method": "draft_model", "model": tiny_llama(seed=1), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(tiny_llama(seed=0), speculative_config=config, kv_cache_memory=1 << 20)
    estimate = llm.kv_cache_estimate()
    target, draft = llm.target, llm.proposer.runner
    assert estimate["bytes_per_token"] == runner_bytes_per_token(target) + runner_bytes_per_token(draft)
    assert runner_bytes_per_token(target) == 4 * 2 * 8 * 2 * 4  # layers x kv heads x head dim x (k, v) x fp32
    assert estimate["total_blocks"] == (1 << 20) // (16 * estimate["bytes_per_token"])
    assert estimate["max_tokens"] == 16 * estimate["total_blocks"]
    for runner in (target, draft):
        cache = runner.new_cache()
        cache.reserve(100)
        assert cache.capacity % 16 == 0 and cache.capacity >= 100
        assert cache.nbytes == cache.capacity * runner_bytes_per_token(runner) == cache.capacity * cache.bytes_per_token
    # Without a draft model only the target counts.
    plain = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram"})
    assert plain.kv_cache_estimate()["bytes_per_token"] == runner_bytes_per_token(plain.target)
    assert plain.kv_cache_estimate()["total_blocks"] is None


def test_growth_is_block_granular_and_bounded_by_the_pool():
    runner = LLM(tiny_llama(seed=0)).target
    cache = runner.new_cache()
    assert isinstance(cache, StaticSequenceCache)
    cache.reserve(1)
    assert cache.capacity == 64
    cache.reserve(65)
    assert cache.capacity == 128  # + max(64, 25%)
    cache.reserve(129)
    assert cache.capacity == 192
    cache.reserve(250)
    assert cache.capacity == 256  # capped at max_len
    pool = KVPool(runner_bytes_per_token(runner), 5 * 16 * runner_bytes_per_token(runner))
    small = runner.new_cache()
    assert pool.ensure(small, 20, small.bytes_per_token, runner.max_len)
    assert small.capacity == 64 and pool.used_blocks == 4  # the policy's 64 while the pool has room
    other = runner.new_cache()
    assert pool.ensure(other, 10, other.bytes_per_token, runner.max_len)
    assert other.capacity == 16 and pool.used_blocks == 5  # only what is left
    assert not pool.ensure(other, 17, other.bytes_per_token, runner.max_len)
    with pytest.raises(KVPoolFull):
        other.reserve(40)
    assert other.capacity == 16
    small.release()
    other.release()
    assert pool.used_blocks == 0 and pool.used_bytes == 0


def test_rollback_keeps_the_tensors_and_cuts_the_prefix_digests():
    runner = LLM(tiny_llama(seed=0)).target
    cache = runner.new_cache()
    runner.forward_batch([cache], [torch.arange(40) % 32], [1])
    assert len(cache) == 40 and cache.capacity == 64
    keys = cache.keys
    cache.block_digests = [b"first", b"second"]  # as PrefixCache.store leaves them for 2 full blocks
    cache.rollback(20)
    assert len(cache) == 20 and cache.keys is keys  # a length change: no copy
    assert cache.block_digests == [b"first"]  # the second block is no longer full
    cache.release()
    assert len(cache) == 0 and cache.capacity == 0 and cache.nbytes == 0


def test_a_length_hint_allocates_the_sequence_at_once_but_not_under_a_pool():
    runner = LLM(tiny_llama(seed=0)).target  # max_len 256
    cache = runner.new_cache()
    cache.length_hint = 150  # a prompt of ~40 and max_tokens ~100, plus a step's rows
    cache.reserve(40)
    assert cache.capacity == 160  # the hint, block-rounded: decoding to it copies nothing
    cache.reserve(150)
    assert cache.capacity == 160
    cache.reserve(170)
    assert cache.capacity == 224  # past the hint: the policy's growth (+ max(64, 25%))
    far = runner.new_cache()
    far.length_hint = 10_000
    far.reserve(10)
    assert far.capacity == 256  # capped at max_len
    StaticSequenceCache.HINT_AHEAD, ahead = 64, StaticSequenceCache.HINT_AHEAD
    try:
        near = runner.new_cache()
        near.length_hint = 250
        near.reserve(20)
        assert near.capacity == 96  # at most HINT_AHEAD positions past what is needed (20 + 64, block-rounded)
    finally:
        StaticSequenceCache.HINT_AHEAD = ahead
    pool = KVPool(runner_bytes_per_token(runner), 20 * 16 * runner_bytes_per_token(runner))
    budgeted = runner.new_cache()
    budgeted.length_hint = 200
    assert pool.ensure(budgeted, 20, budgeted.bytes_per_token, runner.max_len)
    assert budgeted.capacity == 64  # the policy's: room held ahead would keep another sequence out


def test_the_engine_hints_the_target_cache_with_prompt_max_tokens_and_a_step():
    from quickdraft import SamplingParams
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    seq = llm.engine.new_sequence(list(range(1, 30)), SamplingParams(max_tokens=50))
    assert seq.target_cache.length_hint == 29 + 50 + 4 + 1
    tokens = [t for step in llm.engine.run(seq) for t in step]
    assert len(tokens) == 50


def test_ids_recorded_from_the_host_follow_those_pending_on_the_device():
    runner = LLM(tiny_llama(seed=0)).target
    cache = runner.new_cache()
    cache.record(torch.tensor([5, 6]))
    cache.record_ids([7])
    cache.record(torch.tensor([8]))
    assert len(cache) == 4 and cache.token_ids == [5, 6, 7, 8]

"""Prefix caching (quickdraft/kv/prefix_cache.py): full blocks of KV kept by their token prefix and copied into
later sequences that start alike.

On the CPU kernels (bf16, rows computed alike whatever the call) a copied block is bitwise what a fresh prefill
computes, so outputs with prefix caching equal outputs without it, greedy and seeded. Kept blocks live in the
budget's free space and are evicted (tail first) before a running sequence is preempted."""

import random

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import cpu_linear
from quickdraft.kv import BLOCK_SIZE, KVPool, PrefixCache
from quickdraft.models.factory import native_runner
from conftest import tiny_gemma16, tiny_llama16

needs_kernels = pytest.mark.skipif(cpu_linear() is None, reason="quickdraft's CPU kernels need AVX512-BF16")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def _bf16_runner(build=tiny_llama16):
    return native_runner(build(seed=0).to(torch.bfloat16), "tiny")


def _tokens(n, seed, vocab=48):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _contents(cache, n):
    keys = cache.keys
    if keys.dim() == 6:  # packed: [layers, Hkv, cap/16, d/2, 16, 2] -> [layers, Hkv, cap, d]
        layers, heads, blocks, half, _, _ = keys.shape
        keys = keys.permute(0, 1, 2, 4, 3, 5).reshape(layers, heads, blocks * 16, half * 2)
    return keys[:, :, :n], cache.values[:, :, :n]


@needs_kernels
@pytest.mark.parametrize("build", [tiny_llama16, tiny_gemma16], ids=["llama", "gemma-sliding"])
def test_a_loaded_prefix_is_bitwise_a_fresh_prefill(build):
    runner = _bf16_runner(build)
    assert runner.rows_invariant
    prefix = PrefixCache(runner)
    shared = _tokens(40, seed=1)
    first = runner.new_cache()
    runner.forward(first, torch.tensor(shared + _tokens(9, seed=2)))  # a prefill of 49 rows
    for token in _tokens(3, seed=3):  # and decoding steps: blocks 0..2 kept (51 committed positions)
        runner.forward(first, torch.tensor([token]))
    prefix.store(first)
    assert len(prefix) == 3

    prompt = shared + _tokens(12, seed=4)  # shares 2 full blocks (positions 0..31) and 8 more tokens
    reused = runner.new_cache()
    assert prefix.load(reused, prompt) == 32
    assert reused.token_ids == prompt[:32] and prefix.hit_tokens == 32
    fresh = runner.new_cache()
    fresh_logits = runner.forward(fresh, torch.tensor(prompt), num_logits=len(prompt) - 32)
    reused_logits = runner.forward(reused, torch.tensor(prompt[32:]), num_logits=len(prompt) - 32)
    assert torch.equal(fresh_logits, reused_logits)
    for a, b in zip(_contents(fresh, len(prompt)), _contents(reused, len(prompt))):
        assert torch.equal(a, b)


def test_load_leaves_the_last_token_to_compute_and_needs_an_exact_prefix():
    runner = native_runner(tiny_llama(seed=0), "tiny")  # float32, torch path: the bookkeeping is the same
    prefix = PrefixCache(runner)
    ids = _tokens(48, seed=5, vocab=32)
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor(ids))
    prefix.store(cache)
    assert len(prefix) == 3
    # The whole 48 tokens again: only 32 load, the last block is recomputed for its last token's logits.
    assert prefix.load(runner.new_cache(), ids) == 32
    assert prefix.load(runner.new_cache(), ids + [1]) == 48
    changed = list(ids)
    changed[20] = (changed[20] + 1) % 32  # differs in block 1: block 0 only
    assert prefix.load(runner.new_cache(), changed) == 16
    assert prefix.load(runner.new_cache(), [(ids[0] + 1) % 32] + ids[1:]) == 0
    assert prefix.load(runner.new_cache(), ids[:16]) == 0  # one block and nothing after it


def _run(runner, ids):
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor(ids))
    return cache


def test_rolled_back_blocks_are_not_kept_and_adopted_caches_are_evicted_whole_least_recent_first():
    runner = native_runner(tiny_llama(seed=0), "tiny")
    block_bytes = 16 * runner.num_layers * runner.num_kv_heads * runner.head_dim * 2 * 4
    prefix = PrefixCache(runner, max_tokens=2 * 64)  # two finished caches of 64 positions (the growth policy's)
    a, b, c = (_tokens(40, seed=s, vocab=32) for s in (6, 7, 8))
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor(a))
    cache.rollback(20)  # rejected positions: only block 0 is committed
    prefix.store(cache)
    assert len(prefix) == 1 and prefix.nbytes == 0  # a running cache's blocks take no bytes of their own
    runner.forward(cache, torch.tensor(a[20:]))
    prefix.store(cache)
    assert len(prefix) == 2 and prefix.load(runner.new_cache(), a) == 32
    prefix.adopt(cache)
    assert prefix.nbytes == cache.nbytes == 4 * block_bytes
    other = _run(runner, b)
    prefix.store(other)
    prefix.adopt(other)
    assert len(prefix) == 4 and prefix.load(runner.new_cache(), a) == 32  # a is the most recently used now
    third = _run(runner, c)
    prefix.store(third)
    prefix.adopt(third)  # over the cap: b's cache, the least recently used, goes whole
    assert len(prefix) == 4 and prefix.nbytes == 8 * block_bytes
    assert prefix.load(runner.new_cache(), b) == 0
    assert prefix.load(runner.new_cache(), a) == 32 and prefix.load(runner.new_cache(), c) == 32


def test_keeping_a_block_copies_nothing():
    """A running cache's block is kept where it is, and a finished cache's tensors are adopted as they are: a load
    copies from them, and the cache that made them no longer holds them."""
    runner = native_runner(tiny_llama(seed=0), "tiny")
    prefix = PrefixCache(runner)
    a = _tokens(40, seed=6, vocab=32)
    cache = _run(runner, a)
    prefix.store(cache)
    keys, values = cache.keys, cache.values
    assert prefix._blocks[cache.block_digests[1]] == (cache, 1)
    prefix.adopt(cache)
    cache.release()  # what a finished sequence's cache does: its tensors are kept only by the prefix cache
    assert cache.keys is None and cache.block_digests == []  # the released cache forgot its tensors and digests
    (adopted,) = prefix._adopted.values()
    assert adopted.keys is keys and adopted.values is values
    loaded = runner.new_cache()
    assert prefix.load(loaded, a) == 32
    for x, y in zip(_contents(loaded, 32), (keys[:, :, :32], values[:, :, :32])):
        assert torch.equal(x, y)
    prefix.clear()
    assert len(prefix) == 0 and prefix.nbytes == 0 and prefix.load(runner.new_cache(), a) == 0


def test_a_cache_rolled_back_below_a_kept_block_no_longer_serves_it():
    """The engine never rolls back committed positions, but a cache is not bound to that: a block whose cache
    was cut below it is not loaded from positions since rewritten."""
    runner = native_runner(tiny_llama(seed=0), "tiny")
    prefix = PrefixCache(runner)
    a = _tokens(40, seed=6, vocab=32)
    cache = _run(runner, a)
    prefix.store(cache)
    cache.rollback(10)
    b = a[:10] + _tokens(30, seed=9, vocab=32)
    runner.forward(cache, torch.tensor(b[10:]))
    assert prefix.load(runner.new_cache(), a) == 0
    prefix.store(cache)  # its new blocks take the places of the stale ones
    assert prefix.load(runner.new_cache(), b) == 32


def test_a_finished_cache_rolled_back_below_its_kept_blocks_is_let_go():
    """The entries of blocks a rollback took from a running cache pointed at it until clear(), keeping its tensors
    alive after its sequence ended; adopting it drops them (and keeps those it still holds)."""
    runner = native_runner(tiny_llama(seed=0), "tiny")
    prefix = PrefixCache(runner)
    a = _tokens(40, seed=6, vocab=32)
    cache = _run(runner, a)
    prefix.store(cache)
    assert len(prefix) == 2 and cache.kept_digests == cache.block_digests
    cache.rollback(10)  # below both kept blocks
    prefix.adopt(cache)
    assert len(prefix) == 0 and prefix.nbytes == 0 and cache.kept_digests == []
    partly = _run(runner, a)
    prefix.store(partly)
    partly.rollback(20)  # below the second block only
    prefix.adopt(partly)
    assert len(prefix) == 1 and prefix.nbytes == partly.nbytes
    assert prefix.load(runner.new_cache(), a) == 16


def test_adopted_caches_keep_their_pool_bytes_and_are_reclaimed_before_a_grant_fails():
    runner = native_runner(tiny_llama(seed=0), "tiny")
    block_bytes = 16 * runner.num_layers * runner.num_kv_heads * runner.head_dim * 2 * 4
    pool = KVPool(block_bytes // 16, 6 * block_bytes)  # 6 blocks in all
    prefix = PrefixCache(runner, pool)
    pool.reclaim = prefix.evict
    cache = runner.new_cache()
    cache.attach_pool(pool)
    ids = _tokens(33, seed=8, vocab=32)
    runner.forward(cache, torch.tensor(ids))  # holds 4 blocks (the growth policy's 64 positions)
    prefix.store(cache)
    assert pool.used_blocks == 4 and len(prefix) == 2  # kept where they are: no pool bytes of their own
    prefix.adopt(cache)
    cache.release()  # gives back nothing: the prefix cache holds its bytes now
    assert pool.used_blocks == 4 and prefix.nbytes == 4 * block_bytes and pool.held_bytes(prefix) == prefix.nbytes
    assert prefix.load(runner.new_cache(), ids) == 32
    other = runner.new_cache()
    other.attach_pool(pool)
    other.reserve(48)  # 3 blocks needed, 2 free: the adopted cache is reclaimed whole (then the policy's 4 fit)
    assert len(prefix) == 0 and prefix.nbytes == 0 and pool.used_blocks == 4 and other.capacity == 64
    other.release()
    assert pool.used_bytes == 0 and pool.num_caches == 0


def _pair(build, **kwargs):
    target = build(seed=0).to(torch.bfloat16)
    config = kwargs.pop("speculative_config", {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    on = LLM(target, speculative_config=config, **kwargs)
    off = LLM(target, speculative_config=config, enable_prefix_caching=False, **kwargs)
    return on, off


@needs_kernels
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=20),
                                    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=11)],
                         ids=["greedy", "seeded"])
def test_multi_turn_outputs_equal_those_without_prefix_caching(params):
    on, off = _pair(tiny_llama16)
    assert on.enable_prefix_caching and not off.enable_prefix_caching
    system = _tokens(37, seed=9)  # a shared "system prompt"
    first_turns = [system + _tokens(n, seed=10 + n) for n in (5, 19, 30)]
    outs_on, outs_off = on.generate([{"prompt_token_ids": p} for p in first_turns], params), \
        off.generate([{"prompt_token_ids": p} for p in first_turns], params)
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    # The second turn re-sends the conversation: prompt + answer + a new message.
    second = [p + o.outputs[0].token_ids + _tokens(6, seed=20 + i)
              for i, (p, o) in enumerate(zip(first_turns, outs_on))]
    again_on = on.generate([{"prompt_token_ids": p} for p in second], params)
    again_off = off.generate([{"prompt_token_ids": p} for p in second], params)
    assert [o.outputs[0].token_ids for o in again_on] == [o.outputs[0].token_ids for o in again_off]
    cached = [o.metrics.num_cached_tokens for o in again_on]
    assert all(c >= 32 for c in cached)  # at least the system prompt's two blocks
    assert sum(cached) >= sum(len(p) + 20 for p in first_turns) // 16 * 16 - 3 * 16  # most of each first turn
    assert all(o.metrics.num_cached_tokens == 0 for o in again_off)


@needs_kernels
def test_prefix_caching_under_a_budget_with_a_draft_model_preemption_and_aborts_leaks_nothing():
    draft = tiny_llama16(seed=1).to(torch.bfloat16)
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    on, off = _pair(tiny_llama16, speculative_config=config, kv_cache_memory=1 << 19, max_num_seqs=6)
    assert on.kv_memory.prefix_caches[1] is not None  # the draft model's caches are kept too
    system = _tokens(34, seed=30)
    prompts = [system + _tokens(3 + 7 * i, seed=31 + i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in off.generate([{"prompt_token_ids": p} for p in prompts], params)]
    preemptions = 0
    for _ in range(2):  # the second round finds every prompt's blocks kept
        scheduler = on.new_scheduler()
        for i, p in enumerate(prompts):
            scheduler.add_request(str(i), p, params)
        scheduler.add_request("aborted", system + [1, 2, 3], params)
        outputs, steps = {}, 0
        while scheduler.has_unfinished():
            for update in scheduler.step():
                outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            steps += 1
            if steps == 3:
                scheduler.abort_request("aborted")
            usage = scheduler.kv_usage
            assert usage["used_blocks"] <= usage["total_blocks"]
        assert [outputs[str(i)] for i in range(len(prompts))] == expected
        pool = scheduler.pool
        assert pool.used_bytes == on.kv_memory.prefix_bytes() > 0  # only kept blocks remain
        preemptions += scheduler.num_preemptions
    assert preemptions > 0  # the budget was tight enough to preempt
    assert scheduler.kv_usage["prefix_cached_blocks"] > 0
    on.kv_memory.clear_prefix_caches()
    assert pool.used_bytes == 0 and pool.num_caches == 0


def test_prefix_caching_is_off_by_default_where_rows_are_not_computed_alike():
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram"})  # float32: torch's matmuls
    assert not llm.target.rows_invariant and not llm.enable_prefix_caching
    forced = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram"}, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": _tokens(40, seed=40, vocab=32)}
    params = SamplingParams(temperature=0, max_tokens=4)
    forced.generate(prompt, params)
    assert forced.generate(prompt, params)[0].metrics.num_cached_tokens == 32
    with pytest.raises(QuickdraftError, match="enable_prefix_caching"):
        LLM(tiny_llama(seed=0), enable_prefix_caching="yes")
    assert BLOCK_SIZE == 16


def test_a_block_whose_parent_was_evicted_is_not_kept():
    """A kept block's parent is always kept: a running cache whose first blocks were evicted since it stored
    them adds no more blocks (they could never be found)."""
    runner = native_runner(tiny_llama(seed=0), "tiny")
    prefix = PrefixCache(runner, max_tokens=64)
    a = _tokens(60, seed=8, vocab=32)
    first = _run(runner, a[:33])
    prefix.store(first)  # a's blocks 0 and 1
    prefix.adopt(first)
    second = _run(runner, a[:33])  # a's prefix again, computed: its blocks are kept already, in first's tensors
    prefix.store(second)
    assert len(prefix) == 2
    b = _tokens(40, seed=9, vocab=32)
    other = _run(runner, b)
    prefix.store(other)
    prefix.adopt(other)  # over the cap of 64 positions: first's tensors go, and a's blocks with them
    assert prefix.load(runner.new_cache(), a) == 0 and prefix.load(runner.new_cache(), b) == 32
    runner.forward(second, torch.tensor(a[33:]))  # second goes on to 60 positions: block 2 is full now
    prefix.store(second)
    assert len(prefix) == 2 and prefix.load(runner.new_cache(), a) == 0  # no orphan kept
    assert len(second.block_digests) == 3  # the cache still knows its chain for later blocks


def test_kept_prefix_blocks_count_as_free_in_the_usage_gauge():
    """vLLM's kv_cache_usage_perc counts blocks no request holds as free: an idle server whose pool holds only
    kept prefixes reports 0, and a running request's share counts without the kept blocks."""
    from prometheus_client import generate_latest

    from quickdraft.server.async_engine import EngineStats
    from quickdraft.server.metrics import ServerMetrics

    llm = LLM(tiny_llama(seed=0), dtype="float32", device="cpu", kv_cache_memory=1 << 20,
              enable_prefix_caching=True)
    scheduler = llm.new_scheduler()
    scheduler.add_request("a", _tokens(40, seed=10, vocab=32), SamplingParams(temperature=0, max_tokens=8))
    while scheduler.has_unfinished():
        scheduler.step()
    usage = scheduler.kv_usage
    assert usage["used_blocks"] > 0 and usage["prefix_cached_bytes"] == usage["used_bytes"]
    assert usage["request_bytes"] == 0 and usage["usage"] == 0
    metrics = ServerMetrics("tiny")
    metrics.on_iteration(EngineStats(0, 0, usage, 0))
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.0' in generate_latest(metrics.registry).decode()
    scheduler.add_request("b", _tokens(40, seed=10, vocab=32), SamplingParams(temperature=0, max_tokens=8))
    scheduler.step()
    usage = scheduler.kv_usage
    assert 0 < usage["usage"] == (usage["used_bytes"] - usage["prefix_cached_bytes"]) / usage["budget_bytes"]

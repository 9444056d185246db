"""The scheduler's KV budget over a paged runner's pool (the CUDA runner's, run on the CPU): a step's blocks
reserved ahead, blocks accounted (PagedKVPool.audit and the counts) after every step of accepted and rejected
drafts, aborts and preemptions, every block free at the end, a prompt prefix shared by reference (held once),
and the tokens those runs give equal to the reference runner's."""

from __future__ import annotations

import random

import pytest

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.models import factory
from quickdraft.models.cuda_runner import CudaRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run on one thread

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
BASE = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9, 4, 4, 8, 1, 5, 9, 3, 7, 5, 9, 3, 1, 2]


def _reference(prompts, params, config=NGRAM):
    llm = LLM(tiny_llama(seed=0), dtype="float32", device="cpu", speculative_config=config)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture
def paged(monkeypatch):
    """LLMs whose native runners are CUDA runners (paged caches), on the CPU."""
    monkeypatch.setattr(factory, "backend_for", lambda weights: CudaRunner)

    def build(config=NGRAM, **kwargs):
        llm = LLM(tiny_llama(seed=0), dtype="float32", device="cpu", speculative_config=config, **kwargs)
        assert isinstance(llm.target, CudaRunner)
        return llm

    return build


def _live(scheduler):
    return [request.sequences[index] for request, index in scheduler.running]


def _check(scheduler, pool):
    """The pool's accounting holds for exactly the running sequences' tables; waiting ones hold nothing."""
    running = _live(scheduler)
    pool.audit([seq.target_cache.seq for seq in running])
    for seq in running:  # a step's reservation past what it kept went back with its rollback
        table = seq.target_cache.seq
        assert len(table.blocks) == -(-table.length // pool.block_size) and table.length == len(seq.target_cache)
    assert pool.num_used_blocks == len({b for seq in running for b in seq.target_cache.seq.blocks})
    usage = scheduler.kv_usage
    assert usage["used_blocks"] == pool.num_used_blocks and usage["total_blocks"] == pool.total_blocks
    assert usage["free_blocks"] == pool.num_free_blocks


def _drive(scheduler, pool, prompts, params, abort=()):
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        scheduler.add_request(str(i), prompt, sp)
    out: dict[str, list[int]] = {}
    steps = 0
    while scheduler.has_unfinished():
        for update in scheduler.step():
            out.setdefault(update.request_id, []).extend(update.new_token_ids)
        steps += 1
        if steps == 3:
            for request_id in abort:
                assert scheduler.abort_request(request_id)
        _check(scheduler, pool)
    assert pool.num_used_blocks == 0 and scheduler.kv_usage["request_bytes"] == 0
    pool.audit([])
    return out


def test_accepted_and_rejected_drafts_keep_the_blocks_accounted_and_the_tokens_exact(paged):
    prompts = [BASE, BASE[:9], [1, 2, 3], BASE[5:20]]
    params = SamplingParams(temperature=0, max_tokens=40)
    llm = paged()
    scheduler = llm.new_scheduler()
    pool = llm.target.kv_pool
    out = _drive(scheduler, pool, prompts, [params] * len(prompts))
    assert [out[str(i)] for i in range(len(prompts))] == _reference(prompts, params)


def test_preemption_and_abort_return_every_block(paged):
    prompts = [BASE[:n] for n in (24, 11, 18, 7, 20, 3)]
    params = SamplingParams(temperature=0, max_tokens=30)
    probe = paged()
    per_block = probe.target.kv_pool.bytes_per_block
    llm = paged(kv_cache_memory=12 * per_block, max_num_seqs=6)  # 11 blocks of 16 for 6 sequences of ~50
    scheduler = llm.new_scheduler()
    pool = llm.target.kv_pool
    assert pool.total_blocks == 11
    out = _drive(scheduler, pool, prompts, [params] * len(prompts), abort=["1"])
    assert scheduler.num_preemptions > 0 and "1" not in scheduler.requests
    want = _reference(prompts, params)
    assert all(out[str(i)] == want[i] for i in range(len(prompts)) if i != 1)


def test_a_request_larger_than_the_pool_is_refused(paged):
    probe = paged()
    llm = paged(kv_cache_memory=4 * probe.target.kv_pool.bytes_per_block)  # 3 blocks: 48 positions
    scheduler = llm.new_scheduler()
    with pytest.raises(QuickdraftError, match="paged KV pool, which holds 3"):
        scheduler.add_request("big", [1] * 20, SamplingParams(max_tokens=40))
    scheduler.add_request("ok", [1] * 10, SamplingParams(temperature=0, max_tokens=30))  # 10 + 29 + 5 <= 48
    while scheduler.has_unfinished():
        scheduler.step()
    assert llm.target.kv_pool.num_used_blocks == 0


def test_two_requests_sharing_a_prompt_hold_its_blocks_once(paged):
    rng = random.Random(1)
    system = [rng.randrange(32) for _ in range(64)]  # 4 full blocks
    prompts = [system + [3, 4], system + [7]]
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = paged(enable_prefix_caching=True, max_num_seqs=2)
    scheduler = llm.new_scheduler()
    pool = llm.target.kv_pool
    out = {"first": [], "second": []}

    def step():
        for update in scheduler.step():
            out[update.request_id].extend(update.new_token_ids)

    scheduler.add_request("first", prompts[0], params)
    step()  # the first computes the prompt and keeps its full blocks
    alone = pool.num_used_blocks
    scheduler.add_request("second", prompts[1], params)
    step()
    first, second = (scheduler.requests[r].sequences[0] for r in ("first", "second"))
    assert first.target_cache.seq.blocks[:4] == second.target_cache.seq.blocks[:4]  # the same blocks
    assert second.metrics.num_cached_tokens == 64 and pool.hit_tokens >= 64
    assert pool.num_used_blocks <= alone + 2  # the second's own blocks only (its tail, its step's room)
    _check(scheduler, pool)
    while scheduler.has_unfinished():
        step()
        _check(scheduler, pool)
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks >= 4  # kept for a later request
    assert [out["first"], out["second"]] == _reference(prompts, params)

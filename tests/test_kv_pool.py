"""The KV memory budget: blocks of 16 positions, admission control and preemption (recompute), and no leaks."""

import random

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.kv_pool import KVPool, KVPoolFull, runner_bytes_per_token

BASE = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9, 4, 4, 8, 1, 5, 9, 3]
PROMPTS = [BASE[:n] for n in (3, 11, 7, 18, 1, 5)]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(build, method):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    return {"method": "draft_model", "model": build(seed=1), "num_speculative_tokens": 3, "adaptive": False}


def _run(scheduler, prompts, params, abort=None):
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        scheduler.add_request(str(i), ids, sp)
    outputs: dict[tuple[str, int], list[int]] = {}
    waited = 0
    while scheduler.has_unfinished():
        for update in scheduler.step():
            outputs.setdefault((update.request_id, update.index), []).extend(update.new_token_ids)
        waited = max(waited, scheduler.num_waiting)
        usage = scheduler.kv_usage
        assert usage["used_blocks"] <= usage["total_blocks"]
        assert scheduler.kv_measured_bytes() <= usage["budget_bytes"]
    return outputs, waited


def test_bytes_per_token_matches_the_allocated_tensors():
    llm = LLM(tiny_llama(seed=0), speculative_config=_config(tiny_llama, "draft_model"), kv_cache_memory=1 << 20)
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


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tight_budget_waits_preempts_and_keeps_every_output(build, method):
    config = _config(build, method)
    # Lengths past 64 positions make running caches grow while others hold blocks: preemptions.
    params = [SamplingParams(temperature=0, max_tokens=70), SamplingParams(temperature=0.9, max_tokens=60, seed=4),
              SamplingParams(temperature=0, max_tokens=40, num_speculative_tokens=1),
              SamplingParams(temperature=1.2, top_k=5, max_tokens=66, seed=9, n=2),
              SamplingParams(temperature=0, max_tokens=72),
              SamplingParams(temperature=0.7, max_tokens=28, seed=-3)]
    free = LLM(build(seed=0), speculative_config=config)
    alone = {(str(i), j): c.token_ids for i, (ids, sp) in enumerate(zip(PROMPTS, params))
             for j, c in enumerate(free.generate({"prompt_token_ids": ids}, sp)[0].outputs)}
    per_block = 16 * free.kv_cache_estimate()["bytes_per_token"]
    tight = LLM(build(seed=0), speculative_config=config, kv_cache_memory=6 * per_block)
    scheduler = tight.new_scheduler()
    outputs, waited = _run(scheduler, PROMPTS, params)
    assert outputs == alone
    assert 0 < scheduler.peak_kv_bytes <= scheduler.kv_usage["budget_bytes"]
    assert waited > 0 and scheduler.num_preemptions > 0
    assert scheduler.kv_usage["used_blocks"] == 0 and scheduler.pool.num_caches == 0
    # generate() under the budget too.
    outs = tight.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    assert {(str(i), j): c.token_ids for i, o in enumerate(outs) for j, c in enumerate(o.outputs)} == alone


def test_pool_is_empty_after_many_requests_with_random_aborts():
    llm = LLM(tiny_llama(seed=0), speculative_config=_config(tiny_llama, "draft_model"))
    per_block = 16 * llm.kv_cache_estimate()["bytes_per_token"]
    llm = LLM(tiny_llama(seed=0), speculative_config=_config(tiny_llama, "draft_model"),
              kv_cache_memory=10 * per_block, max_num_seqs=8)
    scheduler = llm.new_scheduler()
    rng = random.Random(0)
    added = aborted = 0
    while added < 200 or scheduler.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if added < 200:
                prompt = [rng.randrange(32) for _ in range(rng.randint(1, 12))]
                params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 12),
                                        seed=rng.randint(0, 9), n=rng.choice([1, 1, 2]))
                scheduler.add_request(str(added), prompt, params)
                added += 1
        scheduler.step()
        live = list(scheduler.requests)
        if live and rng.random() < 0.3:
            aborted += scheduler.abort_request(rng.choice(live))
        assert scheduler.kv_usage["used_blocks"] <= scheduler.kv_usage["total_blocks"]
    assert aborted > 0
    assert scheduler.kv_usage["used_blocks"] == 0 and scheduler.pool.used_bytes == 0
    assert scheduler.pool.num_caches == 0 and not scheduler.requests


def test_an_exception_in_a_step_frees_its_blocks():
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 2},
              kv_cache_memory=1 << 20)
    scheduler = llm.new_scheduler()
    scheduler.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10))
    scheduler.step()
    assert scheduler.kv_usage["used_blocks"] > 0

    def broken(seqs):
        raise RuntimeError("boom")

    scheduler.engine = type("E", (), {"step_batch": staticmethod(broken), "k": llm.engine.k,
                                      "target": llm.target, "proposer": llm.proposer})()
    with pytest.raises(RuntimeError, match="boom"):
        scheduler.step()
    assert scheduler.kv_usage["used_blocks"] == 0 and not scheduler.has_unfinished()
    assert scheduler.requests == {}


def test_a_request_that_can_never_fit_is_refused():
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    per_block = 16 * llm.kv_cache_estimate()["bytes_per_token"]
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              kv_cache_memory=3 * per_block)  # 48 positions
    scheduler = llm.new_scheduler()
    with pytest.raises(QuickdraftError, match="cannot fit in the KV cache budget"):
        scheduler.add_request("big", [1] * 20, SamplingParams(max_tokens=40))
    assert not scheduler.has_unfinished() and scheduler.kv_usage["used_blocks"] == 0
    scheduler.add_request("ok", [1] * 10, SamplingParams(temperature=0, max_tokens=30))  # 10 + 29 + 5 <= 48
    while scheduler.has_unfinished():
        scheduler.step()
    assert scheduler.kv_usage["used_blocks"] == 0


def test_a_request_blocked_by_another_scheduler_of_the_llm_raises_instead_of_hanging():
    """An unfinished request of another scheduler (a stream not read to its end, say) holds most of the LLM's
    shared budget; generate's own scheduler can run nothing and would wait forever in one thread (nothing else
    steps the other): its guard raises, naming why."""
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    per_block = 16 * llm.kv_cache_estimate()["bytes_per_token"]
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              kv_cache_memory=4 * per_block, enable_prefix_caching=False)
    other = llm.new_scheduler()
    other.add_request("holder", [1] * 30, SamplingParams(temperature=0, max_tokens=30))
    other.step()  # running: it holds 3 of the 4 blocks
    with pytest.raises(QuickdraftError, match="held by requests of another scheduler"):
        llm.generate({"prompt_token_ids": [2] * 20}, SamplingParams(temperature=0, max_tokens=20))
    while other.has_unfinished():  # the other request goes on unharmed
        other.step()
    assert llm.kv_memory.pool.used_bytes == 0


@pytest.mark.parametrize("value", [0, -5, 1.5, 0.0, -0.1, float("nan"), "1GB", True, [1]])
def test_bad_kv_cache_memory_values(value):
    with pytest.raises(QuickdraftError, match="kv_cache_memory"):
        LLM(tiny_llama(seed=0), kv_cache_memory=value)


def test_kv_cache_memory_values():
    assert LLM(tiny_llama(seed=0)).kv_cache_memory is None
    with pytest.raises(QuickdraftError, match="kv_cache_memory.*no block"):
        LLM(tiny_llama(seed=0), kv_cache_memory=100)
    fraction = LLM(tiny_llama(seed=0), kv_cache_memory=0.01)
    assert fraction.kv_cache_memory > 0 and fraction.kv_cache_estimate()["total_blocks"] > 0

"""The KV memory budget: blocks of 16 positions, admission control and preemption (recompute), and no leaks."""

import random

import pytest

from conftest import tiny_gemma3, tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError
from quickdraft.kv import KVPool, KVPoolFull, PoolGrantedCache

BASE = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9, 4, 4, 8, 1, 5, 9, 3]
PROMPTS = [BASE[:n] for n in (3, 11, 7, 18, 1, 5)]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run on one thread


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


def test_grants_are_whole_blocks_between_need_and_want_and_reclaim_comes_before_a_refusal():
    pool = KVPool(bytes_per_token=10, budget_bytes=4 * 16 * 10 + 7)  # 4 blocks; the odd 7 bytes are not a block
    assert (pool.total_blocks, pool.budget_bytes, pool.max_tokens) == (4, 640, 64)
    a, b = object(), object()
    assert pool.grant(a, 10, need=1, want=40) == 48  # rounded up to blocks
    assert pool.used_blocks == 3 and pool.held_bytes(a) == 480
    assert pool.grant(b, 10, need=5, want=64) == 16  # the most that fits, down to need
    with pytest.raises(KVPoolFull, match="cannot grant 32 positions"):
        pool.grant(b, 10, need=17, want=17)
    assert pool.held_bytes(b) == 160  # a refused grant changes nothing
    freed = []
    pool.reclaim = lambda nbytes: freed.append(nbytes) or 0
    with pytest.raises(KVPoolFull):
        pool.grant(b, 10, need=32, want=32)
    assert freed == [160]  # asked for exactly the shortfall first
    pool.release(a)
    assert pool.grant(b, 10, need=32, want=32) == 32 and pool.used_bytes == 320
    assert not pool.take(a, 321) and pool.take(a, 320) and pool.free_bytes == 0
    pool.give(a, 320)
    with pytest.raises(ValueError, match="returned"):
        pool.give(a, 1)
    pool.release(b)
    assert pool.used_bytes == 0 and pool.num_caches == 0


def test_ensure_accounts_other_caches_by_their_length_and_lets_granted_caches_reserve():
    pool = KVPool(bytes_per_token=10, budget_bytes=3 * 16 * 10)
    plain = SequenceCache()  # the transformers runner's: allocates as it goes, accounted in whole blocks
    assert pool.ensure(plain, 17, 10, limit=256) and pool.held_bytes(plain) == 320
    assert pool.ensure(plain, 30, 10, limit=256) and pool.held_bytes(plain) == 320  # still within its blocks
    assert not pool.ensure(plain, 49, 10, limit=256) and pool.held_bytes(plain) == 320
    assert pool.ensure(plain, 49, 10, limit=40) and pool.held_bytes(plain) == 480  # capped at its max_len

    class Granted(PoolGrantedCache):
        def __init__(self):
            self.pool, self.reserved = None, []

        def attach_pool(self, pool):
            self.pool = pool

        def reserve(self, length):
            self.reserved.append(length)
            self.pool.grant(self, 10, length, length)

    pool.release(plain)
    granted = Granted()
    assert pool.ensure(granted, 20, 10, limit=256) and granted.pool is pool and granted.reserved == [20]
    assert pool.held_bytes(granted) == 320
    assert not pool.ensure(granted, 100, 10, limit=256)  # its KVPoolFull is the pool's False
    assert pool.held_bytes(granted) == 320


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


def test_an_exception_in_a_step_frees_its_blocks(monkeypatch):
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 2},
              kv_cache_memory=1 << 20)
    scheduler = llm.new_scheduler()
    scheduler.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10))
    scheduler.step()
    assert scheduler.kv_usage["used_blocks"] > 0

    def broken(seqs):
        raise RuntimeError("boom")

    monkeypatch.setattr(scheduler.engine, "step_batch", broken)
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

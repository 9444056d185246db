"""Continuous batching: a sequence's output does not depend on what else is in the batch, requests join and
leave at step boundaries, limits hold, and aborted or finished requests free their caches."""

import pytest
import torch

from conftest import run_staggered, tiny_gemma3, tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import cpu_linear
from quickdraft.scheduler import Scheduler

BASE = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9, 4, 4, 8, 1, 5, 9, 3]
PROMPTS = [{"prompt_token_ids": BASE[:n]} for n in (3, 11, 7, 18, 1, 5)]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def _methods(build):
    draft = build(seed=1)
    return {
        "none": {"method": "none"},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        "layer_skip": {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3, "adaptive": False},
        "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False},
        "quantized": {"method": "quantized", "num_speculative_tokens": 2, "adaptive": False},
    }


def _alone(llm, prompts, params):
    return [[c.token_ids for c in llm.generate(p, sp)[0].outputs] for p, sp in zip(prompts, params)]


def _together(llm, prompts, params):
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("method", ["none", "ngram", "layer_skip", "draft_model", "quantized"])
def test_batched_output_equals_batch_1(build, method):
    """Greedy, seeded and per-request K mixed in one batch of prompts of different lengths."""
    llm = LLM(build(seed=0), speculative_config=_methods(build)[method])
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0.9, max_tokens=17, seed=4),
              SamplingParams(temperature=0, max_tokens=30, num_speculative_tokens=1),
              SamplingParams(temperature=1.2, top_k=5, max_tokens=12, seed=9, n=2),
              SamplingParams(temperature=0, max_tokens=9, num_speculative_tokens=0),
              SamplingParams(temperature=0.7, repetition_penalty=1.2, max_tokens=21, seed=-3)]
    assert _together(llm, PROMPTS, params) == _alone(llm, PROMPTS, params)


@pytest.mark.skipif(cpu_linear() is None, reason="quickdraft's CPU kernels need AVX512-BF16")
@pytest.mark.parametrize("method", ["ngram", "draft_model", "quantized"])
def test_batched_bf16_on_the_kernels_equals_batch_1(method):
    """bf16 on the kernels computes every row alike: batched greedy output is bitwise batch 1's."""
    from conftest import tiny_gemma16, tiny_llama16

    for build in (tiny_llama16, tiny_gemma16):
        target = build(seed=0).to(torch.bfloat16)
        config = dict(_methods(lambda seed, build=build: build(seed=seed).to(torch.bfloat16))[method])
        llm = LLM(target, speculative_config=config)
        params = [SamplingParams(temperature=0, max_tokens=20 + i) for i in range(len(PROMPTS))]
        params[1] = SamplingParams(temperature=0.8, max_tokens=20, seed=1)
        assert _together(llm, PROMPTS, params) == _alone(llm, PROMPTS, params), build.__name__


def test_requests_join_and_leave_mid_generation():
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "draft_model", "model": tiny_llama(seed=1),
                                                      "num_speculative_tokens": 3, "adaptive": False})
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i) for i in range(len(PROMPTS))]
    expected = _alone(llm, PROMPTS, params)
    scheduler = llm.new_scheduler(max_num_seqs=3)
    outputs = run_staggered(scheduler, PROMPTS, params, abort_step=3)
    assert "1" in outputs and outputs["1"] == expected[1][0][: len(outputs["1"])] and len(outputs["1"]) < 13
    for i in (0, 2, 3, 4, 5):
        assert outputs[str(i)] == expected[i][0]
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting


def test_limits_and_freed_caches():
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    scheduler = llm.new_scheduler(max_num_seqs=2, max_num_batched_tokens=12)
    sp = SamplingParams(temperature=0, max_tokens=6)
    requests = [scheduler.add_request(str(i), p["prompt_token_ids"], sp) for i, p in enumerate(PROMPTS)]
    seen_running = []
    while scheduler.has_unfinished():
        scheduler.step()
        seen_running.append(scheduler.num_running)
        # Only the prompt of BASE[:18] (18 rows > 12) ever runs over the token budget, and then alone.
    assert max(seen_running) <= 2
    for request in requests:
        for seq in request.sequences:
            assert seq.finished and len(seq.target_cache) == 0 and seq.draft_state is None


def test_a_request_can_turn_speculation_off():
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                      "adaptive": False})
    prompt = {"prompt_token_ids": BASE}
    on, off = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=30),
                                              SamplingParams(temperature=0, max_tokens=30, num_speculative_tokens=0)])
    assert on.outputs[0].token_ids == off.outputs[0].token_ids
    assert on.metrics.proposed_tokens > 0 and off.metrics.proposed_tokens == 0
    assert off.metrics.target_forwards == 30


def test_bad_scheduler_settings():
    with pytest.raises(QuickdraftError, match="max_num_seqs"):
        LLM(tiny_llama(seed=0), max_num_seqs=0)
    with pytest.raises(QuickdraftError, match="max_num_batched_tokens"):
        LLM(tiny_llama(seed=0), max_num_batched_tokens=-5)
    with pytest.raises(QuickdraftError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    llm = LLM(tiny_llama(seed=0))
    scheduler = Scheduler(llm.engine)
    scheduler.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QuickdraftError, match="already in use"):
        scheduler.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QuickdraftError, match="SamplingParams"):
        scheduler.add_request("b", [1, 2], {"max_tokens": 2})
    with pytest.raises(QuickdraftError, match="stop strings"):
        scheduler.add_request("c", [1, 2], SamplingParams(max_tokens=2, stop=["x"]))
    assert set(scheduler.requests) == {"a"}

"""The position-independent forward (NativeRunner.use_cuda_graphs): one sequence's rows at slots given as a device
tensor, attention over the cache's whole capacity under a mask built on the device, so no shape depends on the
position and a CUDA graph can replay it. On the CPU it runs eagerly: these tests check it there against the usual
forward and through the engine; tests/test_cuda.py checks the graphs themselves on a GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama, tiny_llama16
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.models import native
from quickdraft.models.native import NativeRunner

# (rows, logits wanted, positions rolled back first): prefill, decoding steps, verifications, rejections.
STEPS = [(11, 1, 0), (1, 1, 0), (5, 5, 0), (3, 3, 2), (1, 1, 0), (7, 2, 3), (1, 1, 0)] * 3


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_position_independent_forward_equals_the_usual_one(build):
    model = build(seed=0)
    usual, positional = NativeRunner(model), NativeRunner(model)
    positional.use_cuda_graphs(True)
    a, b = usual.new_cache(), positional.new_cache()
    generator = torch.Generator().manual_seed(0)
    for rows, wanted, dropped in STEPS:
        if dropped:
            a.rollback(len(a) - dropped)
            b.rollback(len(b) - dropped)
        ids = torch.randint(0, 32, (rows,), generator=generator)
        expected, got = usual.forward(a, ids, wanted), positional.forward(b, ids, wanted)
        assert got.shape == expected.shape == (wanted, 32)
        torch.testing.assert_close(got, expected, atol=1e-4 * max(1.0, expected.abs().max().item()), rtol=1e-4)
    assert a.token_ids == b.token_ids and positional.forwards == usual.forwards
    # Its caches start zeroed: attention over every slot must not meet uninitialised NaNs (0 x NaN is NaN).
    fresh = positional.new_cache()
    fresh.reserve(16)
    assert torch.equal(fresh.values, torch.zeros_like(fresh.values))


@torch.inference_mode()
def test_a_cache_made_before_the_path_was_on_gets_its_free_slots_zeroed():
    runner = NativeRunner(tiny_llama(seed=0))
    cache, reference = runner.new_cache(), runner.new_cache()
    for c in (cache, reference):
        runner.forward(c, torch.arange(10), 1)
    assert not cache.free_slots_finite  # made with the path off: torch.empty
    cache.keys[:, :, 10:] = float("nan")  # as uninitialised memory may read
    cache.values[:, :, 10:] = float("nan")
    expected = runner.forward(reference, torch.tensor([3, 4]), 2)
    runner.use_cuda_graphs(True)
    got = runner.forward(cache, torch.tensor([3, 4]), 2)
    assert cache.free_slots_finite and not cache.keys.isnan().any() and not cache.values.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-4 * max(1.0, expected.abs().max().item()), rtol=1e-4)


def test_forwards_of_many_rows_take_the_usual_path(monkeypatch):
    runner = NativeRunner(tiny_llama(seed=0))
    runner.use_cuda_graphs(True)
    calls = []
    original = runner._positional_forward
    monkeypatch.setattr(runner, "_positional_forward", lambda *a: calls.append(a[1].shape[0]) or original(*a))
    cache = runner.new_cache()
    runner.forward(cache, torch.arange(native.GRAPH_MAX_ROWS + 6) % 32, 1)  # a prefill: eager
    runner.forward(cache, torch.tensor([3, 4, 5]), 3)
    assert calls == [3]


@pytest.mark.parametrize("method", ["none", "draft_model", "ngram"])
def test_the_engine_on_position_independent_forwards_decodes_as_usual(method, monkeypatch):
    """Greedy and seeded, one sequence at a time (the path's case) and two (batched forwards keep the usual path)."""
    target = tiny_llama(seed=0)
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model":
        config["model"] = tiny_llama(seed=1)
    usual = LLM(target, dtype="float32", device="cpu", speculative_config=config)
    positional = LLM(target, dtype="float32", device="cpu", speculative_config=config)
    runners = [positional.target] + ([positional.proposer.runner] if method == "draft_model" else [])
    rows_seen = []
    for runner in runners:
        runner.use_cuda_graphs(True)
        original = runner._positional_forward
        monkeypatch.setattr(runner, "_positional_forward",
                            lambda cache, ids, k, original=original: rows_seen.append(len(ids)) or original(cache, ids, k))
    prompts = [{"prompt_token_ids": [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9]}, {"prompt_token_ids": [1, 2, 3]}]
    for params in (SamplingParams(temperature=0, max_tokens=32),
                   SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=3)):
        want = [o.outputs[0].token_ids for o in usual.generate(prompts, params)]
        for batch in (1, 2):
            positional.max_num_seqs = batch
            assert [o.outputs[0].token_ids for o in positional.generate(prompts, params)] == want, (params, batch)
    assert rows_seen and (method == "none" or max(rows_seen) > 1)  # verifications took the path too


def test_cuda_graphs_are_refused_where_the_cpu_kernels_run():
    runner = NativeRunner(tiny_llama16(seed=0).to(torch.bfloat16))
    if not runner.packed_keys:
        pytest.skip("no CPU kernels here (they need AVX512-BF16)")
    with pytest.raises(QuickdraftError, match="CUDA graphs"):
        runner.use_cuda_graphs(True)

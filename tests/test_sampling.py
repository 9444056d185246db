"""Logits processing against transformers' reference logits processors, and penalty histories."""

import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from quickdraft import SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import PenaltyHistory, apply_penalties, logits_to_probs, process, sample


def _reference_probs(logits, params):
    scores = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    for proc in [TemperatureLogitsWarper(params.temperature),
                 TopKLogitsWarper(params.top_k) if params.top_k else None,
                 TopPLogitsWarper(params.top_p) if params.top_p < 1 else None,
                 MinPLogitsWarper(params.min_p) if params.min_p else None]:
        if proc is not None:
            scores = proc(ids, scores)
    return torch.softmax(scores, -1)[0]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 5])
@pytest.mark.parametrize("top_p", [1.0, 0.8, 0.3])
@pytest.mark.parametrize("min_p", [0.0, 0.1])
def test_probs_match_transformers_warpers(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(50, generator=gen, dtype=torch.float64) * 3
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        ours = logits_to_probs(logits[None], params)[0]
        assert torch.allclose(ours, _reference_probs(logits, params), atol=1e-9)
        assert abs(ours.sum().item() - 1) < 1e-9


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    out = logits_to_probs(probs.log(), SamplingParams(top_p=0.75))
    assert torch.allclose(out, torch.tensor([[0.625, 0.375, 0, 0]], dtype=torch.float64))
    out = logits_to_probs(probs.log(), SamplingParams(top_p=0.85))
    assert (out[0, :3] > 0).all() and out[0, 3] == 0


def test_repetition_penalty_matches_transformers():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    hist = PenaltyHistory([0, 1], 5, torch.device("cpu"))
    hist.append([3])
    seen, counts = hist.rows(torch.empty(0, dtype=torch.long), 1)
    ours = apply_penalties(logits, SamplingParams(repetition_penalty=1.5), seen, counts)
    ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[0, 1, 3]]), logits.clone())
    assert torch.allclose(ours, ref)


def test_presence_and_frequency_use_output_counts_only():
    hist = PenaltyHistory([4, 4], 5, torch.device("cpu"))  # prompt tokens: no presence/frequency penalty
    hist.append([1, 1, 2])
    seen, counts = hist.rows(torch.empty(0, dtype=torch.long), 1)
    out = apply_penalties(torch.zeros(1, 5), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                          seen, counts)
    assert torch.allclose(out, torch.tensor([[0.0, -1.0, -0.75, 0.0, 0.0]]))


def test_history_rows_include_preceding_pending_tokens():
    hist = PenaltyHistory([0], 4, torch.device("cpu"))
    hist.append([1])
    seen, counts = hist.rows(torch.tensor([2, 2, 3]), 4)
    assert counts.tolist() == [[0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 2, 0], [0, 1, 2, 1]]
    assert seen.tolist() == [[True, True, False, False], [True, True, True, False],
                             [True, True, True, False], [True, True, True, True]]


def test_greedy_process_returns_penalised_logits_and_argmax():
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    hist = PenaltyHistory([0], 3, torch.device("cpu"))
    seen, counts = hist.rows(torch.empty(0, dtype=torch.long), 1)
    out = process(torch.tensor([[3.0, 2.0, 1.0]]), params, seen, counts)
    assert out.tolist() == [[1.5, 2.0, 1.0]]
    assert sample(out, params, None).tolist() == [1]


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(n=0), "n"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_are_refused_with_their_name(kwargs, word):
    with pytest.raises(QuickdraftError, match=word):
        SamplingParams(**kwargs)

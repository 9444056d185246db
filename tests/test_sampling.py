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


# --- position-keyed noise (seeded sampling) ---------------------------------------------------------------

from quickdraft import sampling as _sampling  # noqa: E402


@pytest.mark.parametrize("extreme", ["low", "high"])
def test_position_noise_at_the_generator_extremes_never_picks_a_zero_probability_token(monkeypatch, extreme):
    """Failed before: a uniform draw of exactly 0 (about once in 2^24) made the noise infinite, every score
    p / E zero, and argmax return token 0 even where it had probability zero. The generator's extreme cells
    must still give finite, positive noise."""
    real_cells = _sampling._grid_cells

    def cells(*args, **kwargs):
        out = real_cells(*args, **kwargs)
        return torch.full_like(out, 0 if extreme == "low" else _sampling._GRID - 1)

    monkeypatch.setattr(_sampling, "_grid_cells", cells)
    noise = _sampling.position_noise(key=3, first=0, count=2, vocab=16, device=torch.device("cpu"))
    assert torch.isfinite(noise).all() and (noise > 0).all()
    log_noise = _sampling.log_noise_rows([_sampling.noise_seed(3, p) for p in (0, 1)], vocab=16,
                                         device=torch.device("cpu"))
    assert torch.isfinite(log_noise).all()
    for only in (0, 5, 15):
        probs = torch.zeros(2, 16)
        probs[:, only] = 1.0  # top_k=1 / min_p=1 / a top_p that keeps one token
        assert _sampling.sample_with_noise(probs, noise).tolist() == [only, only]


def test_noisy_scores_are_minus_infinity_exactly_where_p_is_zero():
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0]])
    for e in (1.1e-16, 1.0, 36.7):
        scores = _sampling.noisy_scores(probs, torch.full((1, 4), e, dtype=torch.float64))
        assert torch.isneginf(scores[0, [0, 3]]).all() and torch.isfinite(scores[0, [1, 2]]).all()


def test_grid_cells_are_splitmix64_and_depend_on_key_and_position_only():
    def splitmix(seed, i):  # the reference, in Python integers
        mask = (1 << 64) - 1
        z = (seed + i * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return (z ^ (z >> 31)) >> 12

    cpu = torch.device("cpu")
    cells = _sampling._grid_cells([_sampling.noise_seed(7, p) for p in (3, 4)], vocab=6, device=cpu)
    for row, position in enumerate((3, 4)):
        seed = _sampling.derive_key(7, position)
        assert cells[row].tolist() == [splitmix(seed, j + 1) for j in range(6)]
    alone = _sampling._grid_cells([_sampling.noise_seed(7, 4)], vocab=6, device=cpu)
    assert torch.equal(alone[0], cells[1])  # position 4 alike whichever step reaches it
    rows = _sampling.log_noise_rows([_sampling.noise_seed(7, p) for p in (3, 4)], vocab=6, device=cpu)
    assert torch.equal(rows, _sampling.position_noise(7, 3, 2, 6, cpu).log())
    assert (cells >= 0).all() and (cells < _sampling._GRID).all()


def test_sample_with_noise_draws_from_p():
    """The exponential race is a draw from p: 20000 positions of one key, chi-square at p > 1e-4."""
    from scipy import stats

    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=torch.float64)
    noise = _sampling.position_noise(key=11, first=0, count=20000, vocab=5, device=torch.device("cpu"))
    draws = _sampling.sample_with_noise(p.expand(20000, 5), noise)
    counts = torch.bincount(draws, minlength=5).tolist()
    assert counts[4] == 0
    assert stats.chisquare(counts[:4], [20000 * x for x in (0.5, 0.3, 0.15, 0.05)]).pvalue > 1e-4


def test_derived_keys_differ_where_python_hash_collides():
    """Failed before: keys came from hash((seed, index)); hash(-1) == hash(-2), and ints hash mod 2^61 - 1."""
    assert hash((-1, 0)) == hash((-2, 0)) and hash((5, 0)) == hash((2 ** 61 + 4, 0))
    keys = {_sampling.derive_key(s, i) for s in (-1, -2, 5, 2 ** 61 + 4, 0, 2 ** 64 - 1, -(2 ** 63)) for i in (0, 1)}
    assert len(keys) == 14 and all(0 <= k < 2 ** 63 for k in keys)
    assert _sampling.derive_key(7, 1) == _sampling.derive_key(7, 1)


@pytest.mark.parametrize("kwargs, word", [
    (dict(seed=2 ** 70), "seed"), (dict(seed=-(2 ** 63) - 1), "seed"), (dict(seed=1.5), "seed"),
    (dict(seed=True), "seed"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(min_p=2), "min_p"), (dict(top_k=2.5), "top_k"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=None), "frequency_penalty"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"), (dict(n=0), "n must"), (dict(stop=5), "stop"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=3), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_sampling_params_refuse_bad_values_by_name(kwargs, word):
    with pytest.raises(QuickdraftError, match=word):
        SamplingParams(**kwargs)


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-30).greedy and not SamplingParams(temperature=0.01).greedy


def test_draw_is_exact_and_never_picks_a_zero_weight_token(monkeypatch):
    from scipy import stats

    from quickdraft.sampling import draw

    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.5, 0.0, 0.5])  # unnormalised, zeros at both ends and inside
    generator = torch.Generator().manual_seed(0)
    draws = draw(weights.expand(40000, 7), generator)
    counts = torch.bincount(draws, minlength=7).tolist()
    assert counts[0] == counts[2] == counts[5] == 0
    expected = [40000 * w / 4.0 for w in (2.0, 1.0, 0.5, 0.5)]
    assert stats.chisquare([counts[i] for i in (1, 3, 4, 6)], expected).pvalue > 1e-4
    # The uniform's extremes: u = 0 takes the first token of positive weight, u -> 1 the last.
    real_rand = torch.rand
    for u, token in ((0.0, 1), (1 - 2 ** -53, 6)):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full_like(real_rand(*a, **k), u))
        assert draw(weights[None]).tolist() == [token]


# --- argmax_rows and top_k_rows: the compiled row reductions against torch's ------------------------------------

needs_row_kernels = pytest.mark.skipif(_sampling._row_kernels(torch.zeros(1, 1)) is None,
                                       reason="the compiled CPU kernels do not run here (torch's reductions are used)")


def _rows_with_edges() -> list[torch.Tensor]:
    """Rows of every length class (below 16, a multiple of 16, a remainder), ties, -inf entries, all -inf."""
    gen = torch.Generator().manual_seed(7)
    cases = [torch.randn(rows, vocab, generator=gen) for rows, vocab in ((1, 1), (2, 5), (3, 16), (4, 17), (5, 151936),
                                                                         (2, 49152 + 3))]
    ties = torch.randint(0, 4, (6, 333), generator=gen).float()  # many equal maxima and equal top values
    masked = torch.randn(4, 100, generator=gen).masked_fill(torch.rand(4, 100, generator=gen) < 0.97, float("-inf"))
    masked[3] = float("-inf")  # a row with nothing above -inf
    late_max = torch.zeros(2, 1000)
    late_max[0, 999], late_max[1, 16] = 1.0, 1.0  # the maximum in the scalar tail / at a vector's first lane
    return cases + [ties, masked, late_max]


@needs_row_kernels
def test_argmax_rows_is_torchs_first_maximum():
    for x in _rows_with_edges():
        assert torch.equal(_sampling.argmax_rows(x), x.argmax(-1))
        assert torch.equal(_sampling.argmax_rows(x[0]), x[0].argmax(-1))  # one row, 1-D


@needs_row_kernels
@pytest.mark.parametrize("k", [1, 2, 4, 10])
def test_top_k_rows_are_torchs_values_with_equal_ones_in_index_order(k):
    for x in _rows_with_edges():
        kk = min(k, x.shape[-1])
        values, indices, lse = _sampling.top_k_rows(x, kk, with_logsumexp=True)
        expected, _ = torch.topk(x, kk)
        assert torch.equal(values, expected)
        assert torch.equal(x.gather(1, indices), values)  # the indices hold those values
        for row in range(x.shape[0]):  # distinct indices, equal values in index order
            ids = indices[row].tolist()
            assert len(set(ids)) == kk
            for a in range(kk - 1):
                if values[row, a] == values[row, a + 1]:
                    assert ids[a] < ids[a + 1]
            finite = int(torch.isfinite(x[row]).sum())
            if finite < kk:  # completed with the lowest-index -inf entries
                rest = [i for i in range(x.shape[-1]) if x[row, i] == float("-inf")][: kk - finite]
                assert ids[finite:] == rest
        torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=2e-6, atol=1e-6)
        assert torch.equal(_sampling.top_k_rows(x, kk)[0], values)  # without the logsumexp


@needs_row_kernels
def test_rows_with_nan_or_inf_fall_back_to_torch():
    x = torch.randn(3, 40)
    x[1, 7] = float("nan")
    assert torch.equal(_sampling.argmax_rows(x), x.argmax(-1))  # torch takes the NaN as the maximum
    values, indices = _sampling.top_k_rows(x, 3)
    expected = torch.topk(x, 3)
    assert torch.equal(indices, expected.indices) and values[1, 0].isnan()
    y = torch.randn(2, 40)
    y[0, 3] = float("inf")
    _, indices, lse = _sampling.top_k_rows(y, 2, with_logsumexp=True)
    assert indices[0, 0] == 3 and lse[0] == float("inf")


def test_row_reductions_of_other_rows_are_torchs():
    x = torch.randn(3, 50, dtype=torch.float64)  # not float32
    assert torch.equal(_sampling.argmax_rows(x), x.argmax(-1))
    assert torch.equal(_sampling.top_k_rows(x, 4)[0], torch.topk(x, 4).values)
    y = torch.randn(50, 3).t()  # not contiguous
    assert torch.equal(_sampling.argmax_rows(y), y.argmax(-1))
    assert torch.equal(_sampling.top_k_rows(y, 2)[0], torch.topk(y, 2).values)

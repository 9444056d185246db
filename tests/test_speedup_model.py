"""quickdraft/speedup_model.py: the analytic model's formulas on hand-computed numbers, by brute-force enumeration and
against its closed forms; and its callers `quickdraft tune` and the bench giving, to the last bit, the numbers they
gave before the model was one module (values computed on the code of commit e56b434, where each had its own copy).
Adaptive K's numbers are pinned the same way in tests/test_adaptive.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from quickdraft import adaptive, speedup_model
from quickdraft.bench import costs
from quickdraft.speedup_model import (acceptance_chain, expected_drafts_per_step, expected_tokens_per_step,
                                      filled_rates, fit_forward_costs, forward_seconds, monotone_fit,
                                      pooled_expected_tokens_per_step, pooled_step_seconds, speedup_over_plain,
                                      step_seconds)
from quickdraft.tools import tune

# --- acceptance -> tokens per step -------------------------------------------------------------------------------


def test_filled_rates():
    assert filled_rates([0.5, None, 0.8], 5) == [0.5, 0.5, 0.8, 0.8, 0.8]
    assert filled_rates([None, 0.3], 3) == [0.0, 0.3, 0.3]
    assert filled_rates([], 2) == [0.0, 0.0]


def test_acceptance_chain_is_the_running_product():
    assert acceptance_chain([0.5, 0.4, 0.25], 3) == [0.5, 0.2, 0.05]
    assert acceptance_chain([0.5, 0.4, 0.25], 1) == [0.5]
    assert acceptance_chain([0.5], 0) == []


def test_expected_tokens_hand_computed():
    rates, lengths = [0.5, 0.5], [0.5, 0.0, 0.5]  # half the steps propose nothing, half propose 2
    assert expected_tokens_per_step(rates, lengths, 0) == 1.0
    assert expected_tokens_per_step(rates, lengths, 1) == pytest.approx(1 + 0.5 * 0.5)
    assert expected_tokens_per_step(rates, lengths, 2) == pytest.approx(1 + 0.5 * 0.5 + 0.5 * 0.25)
    assert expected_drafts_per_step(lengths, 1) == pytest.approx(0.5)
    assert expected_drafts_per_step(lengths, 2) == pytest.approx(1.0)
    # A draft that is always right and always proposes K gives K + 1 tokens per step.
    assert expected_tokens_per_step([1.0] * 4, [0, 0, 0, 0, 1.0], 4) == pytest.approx(5)
    # No length distribution: every step proposes K, 1 + c_0 + c_1.
    assert expected_tokens_per_step([0.5, 0.5], None, 2) == 1 + 0.5 + 0.25
    assert expected_tokens_per_step([0.9, None], None, 2) == pytest.approx(1 + 0.9 + 0.81)  # filled


def _enumerated_tokens(rates, lengths, k) -> float:
    """E(K) by brute force: every proposal length and every accept/reject pattern of its drafts, weighted by its
    probability; a step yields the accepted prefix plus the target's token."""
    total = 0.0
    for length, p_length in enumerate(lengths):
        drafted = min(length, k)
        for pattern in itertools.product([True, False], repeat=drafted):
            probability, prefix = p_length, 0
            for i, accepted in enumerate(pattern):
                probability *= rates[i] if accepted else 1 - rates[i]
            for accepted in pattern:
                if not accepted:
                    break
                prefix += 1
            # Patterns that differ only after the first rejection are all counted: their probabilities sum to
            # the probability of that prefix, as every later position's two outcomes sum to one.
            total += probability * (prefix + 1)
    return total


def test_expected_tokens_by_enumeration():
    generator = torch.Generator().manual_seed(0)
    for k_max in range(1, 5):
        for _ in range(20):
            rates = torch.rand(k_max, generator=generator).tolist()
            weights = torch.rand(k_max + 1, generator=generator)
            lengths = (weights / weights.sum()).tolist()
            for k in range(k_max + 1):
                assert expected_tokens_per_step(rates, lengths, k) == pytest.approx(
                    _enumerated_tokens(rates, lengths, k)), (rates, lengths, k)
                # Every step proposing K is the distribution with all its mass at l = k_max.
                full = [0.0] * k_max + [1.0]
                assert expected_tokens_per_step(rates, None, k) == expected_tokens_per_step(rates, full, k)


def test_pooled_closed_form():
    # Leviathan et al.: E = (1 - alpha^(K+1)) / (1 - alpha); alpha = 1 gives K + 1; no draft at all gives 1.
    assert pooled_expected_tokens_per_step(0.5, 3) == pytest.approx((1 - 0.5 ** 4) / 0.5)
    assert pooled_expected_tokens_per_step(1.0, 4) == 5
    assert pooled_expected_tokens_per_step(0.9, 4, f=0.0) == 1
    # A mean draft length between two integers gives tokens between theirs.
    assert pooled_expected_tokens_per_step(0.6, 2) < pooled_expected_tokens_per_step(0.6, 2.5) < \
        pooled_expected_tokens_per_step(0.6, 3)


def test_per_position_model_agrees_with_the_pooled_closed_form():
    # One acceptance rate alpha for every position and proposals of exactly k on a fraction f of the steps: the
    # closed form (1 - f) + f (1 - alpha^(k+1)) / (1 - alpha).
    forward = {1: 10.0, 2: 11.0, 4: 15.0, 6: 16.0}
    for alpha, f, k in itertools.product([0.0, 0.3, 0.7, 1.0], [0.25, 1.0], [1, 3, 5]):
        lengths = [1 - f] + [0.0] * (k - 1) + [f]
        assert expected_tokens_per_step([alpha] * k, lengths, k) == pytest.approx(
            pooled_expected_tokens_per_step(alpha, k, f))
        assert step_seconds(lengths, k, forward, 0.5) == pytest.approx(pooled_step_seconds(f, k, forward, 0.5))


# --- forward costs -> seconds per step ---------------------------------------------------------------------------

def test_step_seconds_hand_computed():
    forward = {1: 10.0, 2: 12.0, 3: 14.0}
    lengths = [0.5, 0.0, 0.5]
    # K=2: half the steps verify 1 row (10), half 3 rows (14); + 1 s of lookup per step; + 2 s per draft token
    # x 1 draft token per step on average.
    assert step_seconds(lengths, 2, forward) == pytest.approx(12.0)
    assert step_seconds(lengths, 2, forward, draft_s_per_step=1.0) == pytest.approx(13.0)
    assert step_seconds(lengths, 2, forward, 1.0, 2.0) == pytest.approx(15.0)
    # K=1 cuts the 2-token proposals to 1: rows 1 or 2.
    assert step_seconds(lengths, 1, forward, 1.0, 2.0) == pytest.approx(0.5 * 10 + 0.5 * 12 + 1 + 0.5 * 2)
    # The pooled steps: a quarter verify 2.5 drafts (3.5 rows, t interpolated past the last size: flat).
    assert pooled_step_seconds(0.25, 2.5, forward, 1.0) == pytest.approx(0.75 * 10 + 0.25 * 14 + 1)


def test_forward_seconds_interpolates_and_is_flat_beyond():
    assert forward_seconds({1: 10.0, 3: 14.0}, 2) == pytest.approx(12.0)
    assert forward_seconds({1: 10.0, 3: 14.0}, 2.5) == pytest.approx(13.0)
    assert forward_seconds({1: 10.0, 3: 14.0}, 9) == 14.0


def test_fit_forward_costs():
    line = {n: 10.0 + 2.0 * n for n in range(1, 8)}
    assert fit_forward_costs(line) == pytest.approx(line)
    # A step where the kernels' tiles fill is kept (a line through it would misplace the best K).
    step = {1: 12.9, 2: 14.2, 3: 15.5, 4: 15.6, 5: 16.5, 6: 17.4, 7: 20.7}
    assert fit_forward_costs(step) == pytest.approx(step)
    # More rows never cost less: a falling run is pooled to its mean.
    assert fit_forward_costs({1: 5.0, 2: 4.0, 3: 3.0}) == pytest.approx({1: 4.0, 2: 4.0, 3: 4.0})
    assert fit_forward_costs({1: 10.0, 2: 14.0, 3: 12.0, 4: 15.0}) == \
        pytest.approx({1: 10.0, 2: 13.0, 3: 13.0, 4: 15.0})
    assert fit_forward_costs({1: 7.0}) == {1: 7.0}


def test_monotone_fit_weights_the_pooled_run():
    # 3 samples at 6.0 against 1 at 2.0: the pooled run is their weighted mean, 5.0.
    assert monotone_fit([6.0, 2.0, 7.0], [3.0, 1.0, 1.0]) == pytest.approx([5.0, 5.0, 7.0])
    assert monotone_fit([]) == []


def test_speedup_over_plain():
    # 2.5 tokens in a 15 ms step against one token per 10 ms plain step.
    assert speedup_over_plain(2.5, 15.0, 10.0) == pytest.approx(2.5 * 10 / 15)
    assert speedup_over_plain(1.0, 10.0, 10.0) == 1.0


# --- the callers: one model, the numbers they gave before ----------------------------------------------------------

def test_tune_bench_and_adaptive_share_the_model():
    for name in ("filled_rates", "expected_tokens_per_step", "expected_drafts_per_step", "fit_forward_costs",
                 "forward_seconds", "step_seconds"):
        assert getattr(tune, name) is getattr(speedup_model, name), name
    assert costs.expected_tokens_per_step is speedup_model.pooled_expected_tokens_per_step
    assert adaptive.monotone_fit is speedup_model.monotone_fit


FORWARD = {1: 0.0101, 2: 0.0107, 3: 0.0112, 4: 0.0131, 5: 0.0139, 6: 0.0174, 7: 0.0207}


def test_tune_predictions_are_the_same_to_the_last_bit():
    rates = [0.81, 0.7, None, 0.55, 0.62, None]
    lengths = [0.2, 0.1, 0.05, 0.15, 0.1, 0.1, 0.3]
    # float.hex of tune's E(K), C(K) (K = 0..6) and speedup (K = 1..6) on e56b434's tools/tune.py.
    tokens = ["0x1.0000000000000p+0", "0x1.a5e353f7ced92p+0", "0x1.05bf487fcb924p+1", "0x1.26c4ef88b9778p+1",
              "0x1.34bd7b2031cebp+1", "0x1.3bab728a0b313p+1", "0x1.3ee45781a9e05p+1"]
    seconds = ["0x1.5810624dd2f1ap-7", "0x1.9ed7c6fbd273cp-7", "0x1.da7b0b3919264p-7", "0x1.17d6b65a9a805p-6",
               "0x1.2f9873ffac1d2p-6", "0x1.544bb1af3a14cp-6", "0x1.6ed6777079e59p-6"]
    speedups = ["0x1.5093cadffc607p+0", "0x1.6d2502d70d230p+0", "0x1.5c9d5e6ff0545p+0", "0x1.5090aa247a44bp+0",
                "0x1.3301b44b960a3p+0", "0x1.1fb35deceb954p+0"]
    assert [tune.expected_tokens_per_step(rates, lengths, k).hex() for k in range(7)] == tokens
    assert [tune.step_seconds(lengths, k, FORWARD, 0.0004, 0.0021).hex() for k in range(7)] == seconds
    predictions = [tune.predict(rates, lengths, k, FORWARD, 0.0004, 0.0021) for k in range(1, 7)]
    assert [p.speedup.hex() for p in predictions] == speedups
    assert [p.tokens_per_step.hex() for p in predictions] == tokens[1:]
    assert {n: v.hex() for n, v in tune.fit_forward_costs({1: 5.0, 2: 4.0, 3: 3.3, 4: 6.1}).items()} == \
        {1: "0x1.0666666666667p+2", 2: "0x1.0666666666667p+2", 3: "0x1.0666666666667p+2", 4: "0x1.8666666666666p+2"}


def test_bench_predictions_are_the_same_to_the_last_bit():
    # float.hex of e56b434's bench/costs.py on the same numbers.
    stats = {"alpha": 0.63, "draft_fraction": 0.71, "mean_draft_length": 2.6, "draft_s_per_step": 0.0013}
    assert {key: value.hex() for key, value in costs.predict(stats, FORWARD).items()} == {
        "predicted_tokens_per_step": "0x1.d8639920a52dcp+0", "predicted_step_s": "0x1.a9ab5f94bb0d8p-7",
        "predicted_speedup": "0x1.6f47fb808900ap+0"}
    pooled = {(0.37, 2.5, 0.3): "0x1.295947d31f42ap+0", (0.37, 4, 1.0): "0x1.93880b26cfa29p+0",
              (0.9, 2.5, 1.0): "0x1.8ac3bf81edeaep+1", (1.0, 4, 0.3): "0x1.199999999999ap+1",
              (0.0, 2.5, 1.0): "0x1.0000000000000p+0"}
    for (alpha, k, f), value in pooled.items():
        assert costs.expected_tokens_per_step(alpha, k, f).hex() == value, (alpha, k, f)

"""The analytic speedup model of speculative decoding: tokens per step, seconds per step, speedup over plain.

One step proposes l draft tokens (l <= K), verifies them in one target forward over l + 1 rows and commits the
accepted prefix plus the target's own token. With alpha_i the chance that draft position i is accepted given
that every earlier draft of the step was, and c_i = alpha_0 x .. x alpha_i (the chance that position i is
accepted with every one before it):
    tokens per step   E(K) = 1 + sum_{i<K} P(l > i) c_i          (Leviathan et al. 2023 when l = K, alpha_i = alpha:
                                                                  (1 - alpha^(K+1)) / (1 - alpha))
    seconds per step  C(K) = sum_l P(l) t_target(min(l, K) + 1) + draft seconds per step
                             + E[min(l, K)] x draft seconds per draft token
    speedup(K)        = E(K) t_target(1) / C(K)   (plain decoding: one token per one-row forward)
t_target(n) is the target forward over n rows, interpolated between measured sizes (forward_seconds), the
measurements first made non-decreasing (fit_forward_costs: more rows never cost less).

Three callers share it: `quickdraft tune` (per-position rates and the measured distribution of proposal
lengths), the bench (`pooled_*`: one pooled alpha, the fraction f of steps that propose and their mean length,
which need not be an integer) and adaptive K (each request's decayed rates, every step proposing the K tried).
Pure functions, no I/O and no state: the measuring lives with the callers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


# --- acceptance -> tokens per step -------------------------------------------------------------------------------

def filled_rates(rates: Sequence[float | None], length: int) -> list[float]:
    """The rates with each unmeasured position (None, or beyond the list) given the last measured rate before
    it (0 where none was measured): a position no step reached carries no evidence of its own, and acceptance
    by position is roughly flat or rising once a draft has been right."""
    out, last = [], 0.0
    for i in range(length):
        rate = rates[i] if i < len(rates) else None
        last = last if rate is None else float(rate)
        out.append(last)
    return out


def acceptance_chain(rates: Sequence[float], k: int) -> list[float]:
    """c_i = alpha_0 x alpha_1 x .. x alpha_i for i < k: the chance that draft position i is accepted together
    with every position before it (a running product, left to right)."""
    chances, survive = [], 1.0
    for i in range(k):
        survive *= rates[i]
        chances.append(survive)
    return chances


def expected_tokens_per_step(rates: Sequence[float | None], length_distribution: Sequence[float] | None,
                             k: int) -> float:
    """E(K) = 1 + sum_{i<K} P(l > i) c_i with c_i = alpha_0 ... alpha_i: the target's token plus each draft
    position that is proposed (a step proposes min(l, K) tokens) and accepted with every one before it.

    rates: alpha_i by position (None: unmeasured, see filled_rates). length_distribution: P(a step proposes
    exactly l tokens), l = 0, 1, ...; None when every step proposes K (P(l > i) = 1 for i < K)."""
    tokens = 1.0
    for i, chance in enumerate(acceptance_chain(filled_rates(rates, k), k)):
        tokens += chance if length_distribution is None else sum(length_distribution[i + 1:]) * chance
    return tokens


def expected_drafts_per_step(length_distribution: Sequence[float], k: int) -> float:
    """E[min(l, K)]: draft tokens a step proposes at K."""
    return sum(p * min(l, k) for l, p in enumerate(length_distribution))


def pooled_expected_tokens_per_step(alpha: float, k: float, f: float = 1.0) -> float:
    """E = (1 - f) + f (1 - alpha^(k+1)) / (1 - alpha) (k + 1 at alpha = 1): one acceptance rate alpha for every
    position, a fraction f of the steps proposing k tokens (a mean length, so not necessarily an integer) and
    the rest none. For an integer k it is expected_tokens_per_step with alpha_i = alpha and P(0) = 1 - f,
    P(k) = f."""
    drafted = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return (1 - f) + f * drafted


# --- forward costs -> seconds per step ---------------------------------------------------------------------------

def monotone_fit(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool-adjacent-violators):
    a run that falls is replaced by its weighted mean. Costs measured by size: more rows never cost less."""
    weights = weights or [1.0] * len(values)
    blocks: list[list[float]] = []  # [value, weight, number of points] per pooled run
    for value, weight in zip(values, weights):
        blocks.append([value, float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            value, weight, count = blocks.pop()
            last = blocks[-1]
            last[0] = (last[0] * last[1] + value * weight) / (last[1] + weight)
            last[1] += weight
            last[2] += count
    return [value for value, _, count in blocks for _ in range(int(count))]


def fit_forward_costs(forward_s: dict[int, float]) -> dict[int, float]:
    """The measured forward seconds by rows (each the median of rounds spread over the run: ForwardTimes),
    made non-decreasing (monotone_fit: more rows never cost less). Not a straight line: on CPUs the
    cost by rows has steps where the kernels' tiles fill (measured on an AVX512 machine without AMX: 17.4 ms at
    6 rows, 20.7 at 7), and a line through them misplaces the best K."""
    sizes = sorted(forward_s)
    return {n: max(1e-9, v) for n, v in zip(sizes, monotone_fit([forward_s[n] for n in sizes]))}


def forward_seconds(forward_s: dict[int, float], rows: float) -> float:
    """t_target(rows): the target forward over `rows` new tokens, interpolated linearly between the measured
    sizes (and flat beyond them)."""
    sizes = sorted(forward_s)
    return float(np.interp(rows, sizes, [forward_s[s] for s in sizes]))


def step_seconds(length_distribution: Sequence[float], k: int, forward_s: dict[int, float],
                 draft_s_per_step: float = 0.0, draft_s_per_token: float = 0.0) -> float:
    """C(K) = sum_l P(l) t_target(min(l, K) + 1) + draft seconds per step + E[min(l, K)] x draft seconds per
    draft token."""
    verify = sum(p * forward_seconds(forward_s, min(l, k) + 1) for l, p in enumerate(length_distribution))
    return verify + draft_s_per_step + expected_drafts_per_step(length_distribution, k) * draft_s_per_token


def pooled_step_seconds(f: float, k: float, forward_s: dict[int, float], draft_s_per_step: float) -> float:
    """C = (1 - f) t_target(1) + f t_target(k + 1) + draft seconds per step: a fraction f of the steps verifies
    k drafts (a mean length: t_target interpolated), the rest none (pooled_expected_tokens_per_step's steps)."""
    return (1 - f) * forward_seconds(forward_s, 1) + f * forward_seconds(forward_s, k + 1) + draft_s_per_step


# --- the speedup -------------------------------------------------------------------------------------------------

def speedup_over_plain(tokens_per_step: float, step_s: float, plain_step_s: float) -> float:
    """E t_plain / C: tokens per second of speculative steps (E tokens in C seconds) over plain decoding's (one
    token per plain step of t_plain = t_target(1) seconds)."""
    return tokens_per_step * plain_step_s / step_s

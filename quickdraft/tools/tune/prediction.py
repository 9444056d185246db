"""What a draft did at a fixed K (its AcceptanceProfile) and the speedup the analytic model predicts from it at
each K (quickdraft/speedup_model.py's formulas; the module doc of quickdraft.tools.tune states them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from quickdraft.errors import QuickdraftError
from quickdraft.sequence import RequestMetrics
from quickdraft.speedup_model import expected_tokens_per_step, forward_seconds, speedup_over_plain, step_seconds


def acceptance_rates(accepted_per_position: Sequence[int], reached_per_position: Sequence[int]) -> list[float | None]:
    """alpha_i = accepted_i / reached_i: the chance that draft position i is accepted given that it was judged
    (every earlier draft of its step accepted); None where no step reached position i."""
    if len(accepted_per_position) != len(reached_per_position):
        raise QuickdraftError(f"accepted and reached counts differ in length ({len(accepted_per_position)} vs "
                              f"{len(reached_per_position)})")
    rates: list[float | None] = []
    for i, (accepted, reached) in enumerate(zip(accepted_per_position, reached_per_position)):
        if not 0 <= accepted <= reached:
            raise QuickdraftError(f"position {i}: {accepted} accepted of {reached} reached; need 0 <= accepted <= "
                                  "reached")
        rates.append(accepted / reached if reached else None)
    return rates


def proposal_length_distribution(proposed_per_position: Sequence[int], steps: int, k_max: int) -> list[float]:
    """P(a step proposes exactly l tokens) for l = 0 .. k_max, from proposed_i (steps whose draft had a token
    at position i): P(l >= i + 1) = proposed_i / steps."""
    if steps < 1:
        raise QuickdraftError(f"no decoding steps to take proposal lengths from (steps = {steps}); the prompts "
                              "must generate at least two tokens")
    counts = list(proposed_per_position[:k_max]) + [0] * max(0, k_max - len(proposed_per_position))
    if any(c > 0 for c in proposed_per_position[k_max:]):
        raise QuickdraftError(f"proposals longer than k_max = {k_max} were counted")
    at_least = [steps] + counts + [0]  # at_least[l]: steps proposing >= l tokens
    if any(at_least[i] < at_least[i + 1] for i in range(k_max + 1)):
        raise QuickdraftError(f"proposed counts per position must not increase, and not exceed the {steps} steps; "
                              f"got {list(proposed_per_position)}")
    return [(at_least[l] - at_least[l + 1]) / steps for l in range(k_max + 1)]


@dataclass
class Prediction:
    k: int
    tokens_per_step: float
    step_s: float
    speedup: float  # over plain decoding, whose step is one target row for one token


def predict(rates: Sequence[float | None], length_distribution: Sequence[float], k: int,
            forward_s: dict[int, float], draft_s_per_step: float = 0.0, draft_s_per_token: float = 0.0) -> Prediction:
    """The predicted speedup at K over plain decoding: E(K) t_target(1) / C(K)."""
    tokens = expected_tokens_per_step(rates, length_distribution, k)
    seconds = step_seconds(length_distribution, k, forward_s, draft_s_per_step, draft_s_per_token)
    return Prediction(k, tokens, seconds, speedup_over_plain(tokens, seconds, forward_seconds(forward_s, 1)))


# Predictions closer than this are a tie: the analytic model is not that precise.
PREDICTION_TIE = 0.01


def best_prediction(predictions: Sequence[Prediction]) -> Prediction:
    """The smallest K whose predicted speedup is within PREDICTION_TIE of the highest (fewer drafts waste
    less when the model's small differences are wrong)."""
    best = max(p.speedup for p in predictions)
    return min((p for p in predictions if p.speedup >= best * (1 - PREDICTION_TIE)), key=lambda p: p.k)


@dataclass
class AcceptanceProfile:
    """What a draft did at a fixed K, pooled over prompts: per draft position the steps that proposed a
    token there, reached it (every earlier draft accepted) and accepted it; steps counts decoding steps (the
    target forwards after the prompt's own)."""

    steps: int
    proposed: list[int]
    reached: list[int]
    accepted: list[int]

    @classmethod
    def from_metrics(cls, metrics: Sequence[RequestMetrics]) -> "AcceptanceProfile":
        pooled = RequestMetrics.combine(list(metrics))
        # A prompt of more than one token is read by a forward with no drafts (Engine._cap_k); that forward is
        # not a decoding step. A one-token prompt's first step may draft.
        steps = sum(m.target_forwards - (m.num_prompt_tokens > 1) for m in metrics)
        width = max(len(pooled.proposed_per_position), len(pooled.reached_per_position))

        def padded(counts: list[int]) -> list[int]:
            return list(counts) + [0] * (width - len(counts))

        return cls(steps, padded(pooled.proposed_per_position), padded(pooled.reached_per_position),
                   padded(pooled.accepted_per_position))

    @property
    def rates(self) -> list[float | None]:
        return acceptance_rates(self.accepted, self.reached)

    def length_distribution(self, k_max: int) -> list[float]:
        return proposal_length_distribution(self.proposed, self.steps, k_max)

    @property
    def draft_fraction(self) -> float | None:
        """f: the fraction of steps that proposed at least one token."""
        return (self.proposed[0] if self.proposed else 0) / self.steps if self.steps else None

    @property
    def mean_draft_length(self) -> float | None:
        """The mean length of the proposals that were made."""
        return sum(self.proposed) / self.proposed[0] if self.proposed and self.proposed[0] else None

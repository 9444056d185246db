"""`quickdraft tune`: which draft, which K, fixed or adaptive, on *my* prompts?

For each candidate draft (any `--draft` string of `quickdraft generate`, from the draft registry) it measures,
on the user's prompts and one loaded target:

1. acceptance by position: every prompt decoded at a fixed K = k_max; alpha_i = accepted_i / reached_i (the
   chance that draft position i is accepted given that every earlier draft of the step was), and the
   distribution of proposal lengths (lookups propose fewer than K tokens, or none, on many steps);
2. for drafts that run a model on the target's token ids (a proposer declaring runs_a_model, with a
   draft_runner): the mean KL(target || draft) and total variation between the two next-token distributions on
   the target's own greedy continuations;
3. step costs: the target forward over 1 .. k_max + 1 rows at a realistic context, and the draft's cost (a
   model draft's one-token forward per draft token, or its run's measured draft time per draft token where it
   has no token-id runner to time (eagle); a lookup's measured propose time per step), forwards timed in rounds
   spread over the acceptance runs (ForwardTimes);
4. the predicted speedup at each K (the analytic model below), and then, against plain decoding on the same
   prompts in one interleaved pass, the measured speedup of the predicted best K, fixed and adaptive.

The prediction at K, with P(l) the chance that a step proposes l tokens when allowed k_max (lookups: their
measured distribution; model drafts: l = k_max but for the last steps of a generation) and c_i = alpha_0 x ..
x alpha_i the chance that the draft at position i is accepted:
    tokens per step  E(K) = 1 + sum_{i<K} P(l > i) c_i
    seconds per step C(K) = sum_l P(l) t_target(min(l, K) + 1) + draft seconds per step
                            + E[min(l, K)] x draft seconds per draft token
    speedup(K) = E(K) t_target(1) / C(K)
(quickdraft/speedup_model.py holds the formulas, which the bench shares with one pooled alpha and a mean draft
length.) t_target is the line fitted through the measured forward times (fit_forward_costs: robust to a size timed
in someone else's burst).
Verification and bookkeeping are left out of the model, so the measured speedup is the one the recommendation
follows: the median over prompts of each prompt's speed over plain decoding's, robust to a run caught in another
process's burst of work.

Speeds are decode speeds: tokens after the first over the time after the first token. The prompt's prefill is
the same target work whatever the draft, so counting it would only dilute the differences drafts make (a draft
model's catch-up read of the prompt happens in decoding and is counted).

Fairness: one target is loaded and shared (LLM.with_speculative_config); every configuration that is timed
runs each prompt once, configurations in an order that rotates from prompt to prompt, so that the machine's
drift reaches them alike; with a temperature, every prompt has its own seed (position-keyed noise), so every
configuration decodes the same text. A lookup configuration gets its own proposer: the suffix draft caches
earlier requests' text, and must not find in its cache the very answer another configuration produced.

The package, imports pointing down: cli -> tuning (tune, sweep) -> report -> measure (timed runs, the session)
-> candidates (the drafts to tune); prediction (the acceptance profile and the predicted speedup by K, over
quickdraft/speedup_model.py) and divergence (KL and TV) below report and tuning; defaults (the defaults of the
command line and of tune and sweep) below them all.

The names below are imported when first used: the modules that measure import torch, and importing this package
must not (`quickdraft tune --help` imports cli, and with it this package).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DEFAULT_DRAFTS", "DEFAULT_K_MAX", "DEFAULT_MAX_TOKENS", "PREDICTION_TIE",
    "AcceptanceProfile", "Candidate", "DraftResult", "ForwardTimes", "Measurement", "Prediction", "Progress",
    "RunTotals", "SweepReport", "SweepRow", "TuneReport",
    "acceptance_rates", "add_parser", "best_prediction", "distribution_divergence", "expected_drafts_per_step",
    "expected_tokens_per_step", "filled_rates", "fit_forward_costs", "forward_seconds", "generate_once",
    "load_llm", "measure_divergence", "parse_candidates", "predict", "proposal_length_distribution", "run_rotation",
    "run_tune", "step_seconds", "sweep", "tune",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from quickdraft import speedup_model
    from quickdraft.tools.tune import candidates, cli, defaults, divergence, measure, prediction, report, tuning

    homes = (defaults, candidates, cli, divergence, measure, prediction, report, tuning, speedup_model)
    value = getattr(next(home for home in homes if hasattr(home, name)), name)
    globals()[name] = value  # later lookups skip this function
    return value

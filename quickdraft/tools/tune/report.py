"""What `quickdraft tune` reports: each configuration's measured speed against plain decoding's, each draft's
result (profile, predictions, measurements), the sweep's grid, and the rendered tables."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from quickdraft.errors import QuickdraftError
from quickdraft.tools.tune.candidates import Candidate
from quickdraft.tools.tune.measure import RunTotals
from quickdraft.tools.tune.prediction import AcceptanceProfile, Prediction

# Median and pooled measured speedups further apart than this factor: some runs were slowed by other work.
NOISE_RATIO = 1.5


@dataclass
class Measurement:
    """A configuration's decode speed in the measured pass, and its ratio to plain decoding in that pass.

    Decisions use the pooled ratio (total tokens over total seconds, each side: what a user's workload gets, and
    what --sweep compares), unless it and the median over prompts of each prompt's ratio disagree by more than
    NOISE_RATIO: a generation caught in a burst of another process's work can move the pooled ratio several
    times over on a shared machine (seen: 6.6x pooled against 1.3x by prompt), the median little. (On a quiet
    machine the median of 12 prompts' ratios flipped the ranking of two drafts 2% apart from run to run.)"""

    label: str
    tokens: int
    seconds: float
    tokens_per_s: float | None  # pooled
    speedup: float | None  # the median of the per-prompt ratios
    pooled_speedup: float | None  # pooled tokens/s over plain decoding's pooled tokens/s

    @property
    def noisy(self) -> bool:
        return bool(self.speedup and self.pooled_speedup
                    and not 1 / NOISE_RATIO < self.pooled_speedup / self.speedup < NOISE_RATIO)

    @property
    def decision_speedup(self) -> float | None:
        return self.speedup if self.noisy or self.pooled_speedup is None else self.pooled_speedup


@dataclass
class DraftResult:
    candidate: Candidate
    profile: AcceptanceProfile
    draft_s_per_step: float  # lookups: measured propose time per step; model drafts: 0
    draft_s_per_token: float  # model drafts: a one-token forward of the draft, or its measured time a token; lookups: 0
    predictions: list[Prediction]
    best_k: int
    kl: float | None = None  # mean KL(target || draft) on the target's greedy continuations; None for lookups
    tv: float | None = None
    divergence_positions: int = 0
    fixed: Measurement | None = None
    adaptive: Measurement | None = None

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def predicted_speedup(self) -> float:
        return self.predictions[self.best_k - 1].speedup

    @property
    def mode(self) -> str:
        """fixed or adaptive, whichever measured faster."""
        fixed = self.fixed.decision_speedup if self.fixed and self.fixed.decision_speedup is not None else -1.0
        adaptive = self.adaptive.decision_speedup if self.adaptive and self.adaptive.decision_speedup is not None \
            else -1.0
        return "adaptive" if adaptive > fixed else "fixed"

    @property
    def measured(self) -> Measurement | None:
        """The measurement of the chosen mode."""
        return self.adaptive if self.mode == "adaptive" else self.fixed

    @property
    def measured_speedup(self) -> float | None:
        return self.measured.decision_speedup if self.measured else None

    @property
    def config(self) -> dict[str, Any]:
        """This draft's speculative_config at its best K, fixed or adaptive as measured."""
        return {**self.candidate.config, "num_speculative_tokens": self.best_k, "adaptive": self.mode == "adaptive"}


@dataclass
class SweepRow:
    label: str
    draft: str  # the candidate's label, "none", or "pick"
    k: int
    adaptive: bool
    tokens: int
    seconds: float
    tokens_per_s: float | None
    speedup: float | None  # total tokens/s over plain decoding's in the same pass
    median_speedup: float | None  # the median over prompts of the prompt's speed over plain decoding's


@dataclass
class SweepReport:
    """Every candidate at every K in 1..k_max (fixed) and plain decoding, in one rotating pass; the tuned pick
    measured in the same pass."""

    k_max: int
    rows: list[SweepRow]
    pick_label: str | None
    pick_tokens_per_s: float | None
    best_label: str
    best_tokens_per_s: float | None

    @property
    def pick_fraction(self) -> float | None:
        """The pick's speed as a fraction of the fastest configuration's, by total tokens/s (the issue's target:
        >= 0.95)."""
        if self.pick_tokens_per_s is None or not self.best_tokens_per_s:
            return None
        return self.pick_tokens_per_s / self.best_tokens_per_s

    @property
    def pick_median_fraction(self) -> float | None:
        """The same by the median per-prompt speedups (robust to a run caught in someone else's burst of work,
        which can move a total several times over on a shared machine)."""
        pick = next((row for row in self.rows if row.label == self.pick_label), None)
        best = max((row.median_speedup for row in self.rows if row.median_speedup is not None), default=None)
        if pick is None or pick.median_speedup is None or not best:
            return None
        return pick.median_speedup / best

    def render(self) -> str:
        drafts = list(dict.fromkeys(row.draft for row in self.rows if row.draft not in ("none", "pick")))
        cells = {(row.draft, row.k): row for row in self.rows if not row.adaptive}
        headers = ["draft"] + [f"K={k}" for k in range(1, self.k_max + 1)]
        body = [[draft] + [_speed_cell(cells.get((draft, k))) for k in range(1, self.k_max + 1)] for draft in drafts]
        lines = ["sweep: every draft at every fixed K, one rotating pass; decode tok/s (total speedup over plain "
                 "decoding / median of the prompts' speedups)", _table(headers, body)]
        plain = next((row for row in self.rows if row.draft == "none"), None)
        if plain is not None:
            lines.append(f"plain decoding: {_num(plain.tokens_per_s, '.1f')} tok/s")
        lines.append(f"fastest: {self.best_label} at {_num(self.best_tokens_per_s, '.1f')} tok/s")
        if self.pick_label is not None:
            pick = next(row for row in self.rows if row.label == self.pick_label)
            lines.append(f"tuned pick: {self.pick_label} at {_speed_cell(pick)} tok/s = "
                         f"{_num(self.pick_fraction, '.1%')} of the fastest by totals, "
                         f"{_num(self.pick_median_fraction, '.1%')} by median speedups (target: >= 95%)")
        return "\n".join(lines)


def _plain_json(value: Any) -> bool:
    """Whether JSON holds `value` as it is: a scalar, or a dict / list of such (a tree's {"max_nodes", ...})."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain_json(v) for v in value)
    return isinstance(value, (str, int, float, bool, type(None)))


@dataclass
class TuneReport:
    model: str
    num_prompts: int
    k_max: int
    max_tokens: int
    temperature: float
    context_tokens: int  # cache length at which forwards were timed
    forward_s: dict[int, float]  # target forward seconds by rows, 1 .. k_max + 1: the measured medians
    forward_fit_s: dict[int, float]  # the line fitted through them (fit_forward_costs), what predictions use
    plain: Measurement
    drafts: list[DraftResult]  # ranked, best first
    recommended_config: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # what the reader should know about these numbers
    sweep: SweepReport | None = None
    elapsed_s: float = 0.0

    @property
    def recommended_json(self) -> str:
        """The recommended speculative_config as JSON (what --out holds)."""
        for key, value in self.recommended_config.items():
            if not _plain_json(value):  # e.g. a draft given as a model object
                raise QuickdraftError(f"the recommended speculative_config's {key!r} is a {type(value).__name__} "
                                      "object, which JSON cannot hold; give the draft model as an alias or path to "
                                      "write the config")
        return json.dumps(self.recommended_config, indent=2)

    def render(self) -> str:
        mode = "greedy" if self.temperature == 0 else f"temperature {self.temperature:g}"
        lines = [f"quickdraft tune: {self.model}, {self.num_prompts} prompt{'s' if self.num_prompts != 1 else ''}, "
                 f"{self.max_tokens} tokens each, {mode}, K <= {self.k_max}"]
        measured = "  ".join(f"{rows} row{'s' if rows > 1 else ''} {1e3 * seconds:.2f}"
                             for rows, seconds in sorted(self.forward_s.items()))
        lines.append(f"target forward at {self.context_tokens} tokens of context (ms; the median of rounds spread "
                     f"over the run): {measured}")
        if self.forward_fit_s != self.forward_s:
            fitted = "  ".join(f"{1e3 * seconds:.2f}" for _, seconds in sorted(self.forward_fit_s.items()))
            lines.append(f"  made non-decreasing (what predictions use): {fitted}")
        lines.append(f"plain decoding: {_num(self.plain.tokens_per_s, '.1f')} tok/s")
        lines.append("")
        headers = ["rank", "draft", "best K", "mode", "acceptance by position", "f", "mean len", "KL", "TV",
                   "predicted", "fixed K", "adaptive", "measured", "median"]
        body = []
        for rank, result in enumerate(self.drafts, 1):
            profile = result.profile
            rates = " ".join(_num(r, ".2f", "-") for r in (profile.rates + [None] * self.k_max)[:self.k_max])
            body.append([str(rank), result.label, str(result.best_k), result.mode, rates,
                         _num(profile.draft_fraction, ".2f"), _num(profile.mean_draft_length, ".2f"),
                         _num(result.kl, ".3g", "n/a"), _num(result.tv, ".3f", "n/a"),
                         _num(result.predicted_speedup, ".2f") + "x",
                         _num(result.fixed.decision_speedup if result.fixed else None, ".2f") + "x",
                         _num(result.adaptive.decision_speedup if result.adaptive else None, ".2f") + "x",
                         _num(result.measured_speedup, ".2f") + "x",
                         _num(result.measured.speedup if result.measured else None, ".2f") + "x"])
        lines.append(_table(headers, body, left=2))
        lines.append("acceptance: P(draft position i accepted | reached), at fixed K = k_max; f: steps with a "
                     "proposal; KL(target||draft), TV: mean over the target's greedy continuations; predicted: "
                     "the analytic model at the best K; fixed K / adaptive (K <= best K): measured decode speed over "
                     "plain decoding, interleaved on the same prompts, total tokens/s over plain decoding's (the "
                     "median of the prompts' ratios where the two disagree by more than 1.5x: a noisy machine); "
                     "measured: the faster mode's; median: the median of its prompts' ratios")
        lines.append("")
        lines.append("predicted speedup by K (* best):")
        headers = ["draft"] + [f"K={k}" for k in range(1, self.k_max + 1)]
        lines.append(_table(headers, [[r.label] + [f"{p.speedup:.2f}x" + ("*" if p.k == r.best_k else "")
                                                   for p in r.predictions] for r in self.drafts]))
        if self.sweep is not None:
            lines += ["", self.sweep.render()]
        lines.append("")
        lines += [f"note: {note}" for note in self.notes]
        lines.append("recommended speculative_config: " + json.dumps(
            {key: (value if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__)
             for key, value in self.recommended_config.items()}))
        return "\n".join(lines)


def _num(value: float | None, spec: str, missing: str = "?") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _speed_cell(row: SweepRow | None) -> str:
    if row is None:
        return "-"
    return f"{_num(row.tokens_per_s, '.1f')} ({_num(row.speedup, '.2f')}x / {_num(row.median_speedup, '.2f')}x)"


def _table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Plain aligned columns: the first `left` columns (names) left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _measurement(totals: RunTotals, plain: RunTotals) -> Measurement:
    speed, plain_speed = totals.tokens_per_s, plain.tokens_per_s
    ratios = [mine / base for mine, base in zip(totals.prompt_tokens_per_s, plain.prompt_tokens_per_s)
              if mine and base]
    return Measurement(totals.label, totals.tokens, totals.seconds, speed,
                       statistics.median(ratios) if ratios else None,
                       speed / plain_speed if speed and plain_speed else None)

"""What `quickdraft check` found: the greedy comparison's results, each sample set's tests, and the report that
renders them with its verdict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Divergence:
    """Where greedy speculative output first left plain output, and whether the target's logits there are a
    near-tie of the two tokens (the penalised logits of the common prefix, computed afresh)."""

    position: int  # output position (0: the first generated token)
    speculative_token: int | None  # None: that run had ended
    plain_token: int | None
    gap: float | None  # largest logit minus the smaller of the two tokens' logits
    tolerance: float
    near_tie: bool


@dataclass
class GreedyResult:
    prompt_index: int
    speculative_tokens: int
    plain_tokens: int
    divergence: Divergence | None = None

    @property
    def identical(self) -> bool:
        return self.divergence is None

    @property
    def passed(self) -> bool:
        return self.divergence is None or self.divergence.near_tie


@dataclass
class StatResult:
    """One sample set's tests: `path` is how the samples were verified ("rejection sampling" or "seeded")."""

    path: str
    samples: int
    sample_tokens: int
    pvalues: dict[str, float]  # per view: the p-value of the statistic summed over prompts
    degrees_of_freedom: dict[str, int]
    level: float  # each p-value must reach this (alpha / number of statistics)
    exact_prompts: list[int]  # prompts compared with the enumerated exact law
    fallback_prompts: list[int]  # prompts compared with plain-decoding samples (the tree exceeded the budget)
    tree_forwards: int
    tv_distance: float  # joint view, pooled cells; averaged over prompts (weighted by samples)
    tv_noise: float  # what sampling noise alone gives on average at this N (an exact engine's expected value)
    impossible: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (prompt, tokens) of probability 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def min_pvalue(self) -> float:
        return min(self.pvalues.values()) if self.pvalues else 1.0

    @property
    def passed(self) -> bool:
        return not self.impossible and self.min_pvalue >= self.level


@dataclass
class CheckReport:
    model: str
    dtype: str
    runner: str
    speculative_config: dict[str, Any]
    params: dict[str, Any]
    num_prompts: int
    max_tokens: int
    alpha: float
    near_tie_rule: str
    greedy: list[GreedyResult]
    stats: list[StatResult]
    notes: list[str] = field(default_factory=list)
    token_text: dict[int, str] = field(default_factory=dict)  # decoded divergence tokens, for the report

    @property
    def defects(self) -> list[str]:
        """What makes the check fail, one line each."""
        out = []
        for g in self.greedy:
            if not g.passed:
                d = g.divergence
                out.append(f"greedy output of prompt {g.prompt_index} differs from plain decoding at token "
                           f"{d.position}, not at a near-tie")
        for s in self.stats:
            if s.impossible:
                out.append(f"{s.path}: {len(s.impossible)} sampled sequence(s) of probability zero under plain "
                           "sampling")
            if s.min_pvalue < s.level:
                worst = min(s.pvalues, key=s.pvalues.get)
                out.append(f"{s.path}: the law of {worst} differs from plain sampling's (p = {s.min_pvalue:.3g} < "
                           f"{s.level:.3g}; TV distance {s.tv_distance:.3f}, noise alone {s.tv_noise:.3f})")
        return out

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.greedy) and all(s.passed for s in self.stats)

    def _token(self, token: int | None) -> str:
        if token is None:
            return "(ended)"
        text = self.token_text.get(token)
        return f"{token} {text!r}" if text is not None else str(token)

    def render(self) -> str:
        """The readable report (what `quickdraft check` prints)."""
        spec = self.speculative_config
        draft = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "method")
        lines = [f"quickdraft check: {self.model} ({self.dtype}, {self.runner} runner), draft {spec.get('method')}"
                 + (f" ({draft})" if draft else "") + f", {self.num_prompts} prompt(s)",
                 "sampling: " + ", ".join(f"{k} {v}" for k, v in self.params.items()), ""]
        identical = sum(g.identical for g in self.greedy)
        lines.append(f"1. greedy (temperature 0, up to {self.max_tokens} tokens): speculative vs plain decoding, "
                     f"{identical}/{len(self.greedy)} prompts identical")
        for g in self.greedy:
            if g.identical:
                continue
            d = g.divergence
            gap = "n/a" if d.gap is None else f"{d.gap:.3g}"
            kind = "near-tie (rounding), not a defect" if d.near_tie else "DEFECT"
            lines.append(f"   prompt {g.prompt_index}: differs at token {d.position}: speculative "
                         f"{self._token(d.speculative_token)}, plain {self._token(d.plain_token)}; logit gap {gap} "
                         f"vs tolerance {d.tolerance:.3g}: {kind}")
        lines.append(f"   near-tie rule: {self.near_tie_rule}")
        lines.append("")
        if not self.stats:
            lines.append("2. sampled law: not tested (temperature 0: greedy decoding has no law to test)")
        for number, s in enumerate(self.stats, 2):
            reference = f"exact law of plain sampling for prompts {s.exact_prompts or 'none'}" + (
                f" ({s.tree_forwards} target forwards)" if s.exact_prompts else "")
            if s.fallback_prompts:
                reference += f"; {s.samples // max(1, len(s.exact_prompts) + len(s.fallback_prompts))} plain " \
                             f"samples each for prompts {s.fallback_prompts} (exact law over the forward budget)"
            lines.append(f"{number}. sampled law of the first {s.sample_tokens} tokens ({s.path}): {s.samples} "
                         f"samples, against the {reference}")
            lines.append(f"   drafts verified per position: proposed {s.proposed_per_position or [0]}, accepted "
                         f"{s.accepted_per_position or [0]}")
            pv = ", ".join(f"{name} {p:.3g} (df {s.degrees_of_freedom[name]})" for name, p in s.pvalues.items())
            lines.append(f"   chi-square p-values: {pv}")
            lines.append(f"   level per statistic: {s.level:.3g} (alpha {self.alpha:g}, Bonferroni)")
            lines.append(f"   TV distance of the joint law (pooled cells): {s.tv_distance:.4f} (sampling noise alone "
                         f"gives about {s.tv_noise:.4f})")
            impossible = ", ".join(f"prompt {i}: {list(t)}" for i, t in s.impossible[:5])
            lines.append(f"   sequences of probability zero: {impossible or 'none'}"
                         + (f" and {len(s.impossible) - 5} more" if len(s.impossible) > 5 else ""))
            lines.append("")
        for note in self.notes:
            lines.append(f"note: {note}")
        defects = self.defects
        lines.append("verdict: PASS (output consistent with plain decoding)" if self.passed
                     else "verdict: FAIL: " + "; ".join(defects))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("token_text")
        out["passed"] = self.passed
        out["defects"] = self.defects
        return out

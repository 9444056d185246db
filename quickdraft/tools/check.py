"""`quickdraft check`: is the speculative output really the target's, for this model, draft and sampling?

Two checks on the user's own prompts:

1. Greedy: speculative decoding and plain decoding (method none, the same loaded target) must give the same
   tokens. At the first divergence of a prompt the target's logits on the common prefix are computed afresh
   (penalised, as greedy decoding sees them): if the two tokens' logits both lie within a rounding tolerance
   of the largest (NEAR_TIE_ULPS x the runner dtype's eps x the logit's magnitude), the runs split at a
   numerical near-tie, which rounding alone can flip; otherwise the divergence is a defect.

2. Sampled: N samples of the first m tokens (default m = 4: the prompt's own step commits one token with no
   drafts, then a step verifies up to 2 drafts) are drawn through the engine (rejection sampling, driven with
   one seeded generator so that the check is reproducible; with a request seed, also the seeded path through
   LLM.generate) and compared with the exact law of plain sampling: the target's processed distributions
   (penalties, temperature, top-k, top-p, min-p, as sampling.process computes them) over a pruned tree of
   output prefixes, each prefix expanded by one target forward when its expected count is at least
   EXPAND_MIN_COUNT. Chi-square goodness of fit on several views of the samples (the law of y1, of y1..y2,
   ..., of y1..ym, and of the windows y2y3, y3y4, ...), each view's cells those of expected count >= 5 with
   the rest (and the prefixes the tree did not reach) pooled; prompts are strata (statistics and degrees of
   freedom summed); Bonferroni over every statistic. A prompt whose tree would exceed its share of the
   forward budget is compared with as many samples of plain decoding instead (a two-sample chi-square test).

The verdict FAILs on a greedy divergence that is not a near-tie, a p-value below the level, or a sampled
sequence of probability zero under the exact law (a token that top-k, top-p or min-p removes, or any token
after a prefix whose distribution the tree computed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quickdraft.errors import QuickdraftError
from quickdraft.tools.prompts import PromptInput, prompt_token_ids, read_prompts

if TYPE_CHECKING:
    import torch

    from quickdraft.api import LLM
    from quickdraft.params import SamplingParams

# --- defaults and constants -----------------------------------------------------------------------------
DEFAULT_MAX_TOKENS = 64  # greedy comparison length
DEFAULT_SAMPLE_TOKENS = 4
DEFAULT_SAMPLES = 2000
DEFAULT_ALPHA = 1e-3
DEFAULT_CHECK_SEED = 0
DEFAULT_MAX_FORWARDS = 4000
DEFAULT_STAT_PROMPTS = 8
DEFAULT_TEMPERATURE = 0.7

MIN_EXPECTED = 5.0  # a chi-square cell's least expected count (the usual validity rule)
EXPAND_MIN_COUNT = 5.0  # expand a prefix (one target forward) when its expected count reaches this
MIN_MULTI_TOKEN_ACCEPTS = 20  # fewer accepted drafts past a step's first: a note that the test saw little of them
STORE_MIN_COUNT = 0.5  # keep a child's probability when its expected count reaches this (pooled otherwise)
# A greedy divergence is a near-tie when both tokens' logits lie within NEAR_TIE_ULPS x eps(dtype) x
# max(1, |largest logit|) of the largest: a few units in the last place of the logit for 16-bit runners,
# where the logits themselves are rounded to 8 or 11 bits; for float32, rounding accumulated over the layers
# (rows computed by different matmul shapes), about 1.5e-4 at a logit of 20.
NEAR_TIE_ULPS = {"bfloat16": 4, "float16": 4, "float32": 64, "float64": 64}

# --- results --------------------------------------------------------------------------------------------
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


# --- the check ------------------------------------------------------------------------------------------
def check(llm: "LLM", prompts: list[PromptInput], params: "SamplingParams", *,
          speculative_config: dict[str, Any] | None = None, chat: bool = False,
          max_tokens: int = DEFAULT_MAX_TOKENS, sample_tokens: int = DEFAULT_SAMPLE_TOKENS,
          samples: int = DEFAULT_SAMPLES, alpha: float = DEFAULT_ALPHA, check_seed: int = DEFAULT_CHECK_SEED,
          max_forwards: int = DEFAULT_MAX_FORWARDS, stat_prompts: int = DEFAULT_STAT_PROMPTS) -> CheckReport:
    """Check that `llm`'s speculative decoding (or `speculative_config`'s, on llm's loaded target) gives plain
    decoding's output: greedy token equality on every prompt, and, when params samples (temperature > 0), the
    law of the first `sample_tokens` tokens of `samples` samples spread over the first `stat_prompts` prompts.

    params: the sampling settings (temperature, top-k, top-p, min-p, penalties, stop_token_ids, ignore_eos;
        a seed adds a test of the seeded path); its max_tokens, n and stop strings are not used.
    prompts: strings, token-id lists, or dicts with 'prompt' / 'prompt_token_ids'.
    Deterministic for a fixed K: rejection sampling is driven by a generator seeded with check_seed."""
    import torch

    from quickdraft.params import SamplingParams

    if not isinstance(params, SamplingParams):
        raise QuickdraftError(f"params must be a SamplingParams, got {type(params).__name__}")
    _check_settings(max_tokens, sample_tokens, samples, alpha, max_forwards, stat_prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise QuickdraftError("give at least one prompt to check")
    spec_llm = llm if speculative_config is None else llm.with_speculative_config(speculative_config)
    if spec_llm.speculative_config.method == "none":
        raise QuickdraftError("the speculative config to check has method 'none' (plain decoding): give a draft "
                              "(--draft, or a speculative config with a method)")
    plain_llm = llm.with_speculative_config({"method": "none"})
    ids = [prompt_token_ids(llm, p, chat) for p in prompts]
    runner = llm.target
    dtype_name = str(runner.dtype).removeprefix("torch.")
    config = _describe_config(spec_llm.speculative_config)
    shown = {name: getattr(params, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                       "presence_penalty", "frequency_penalty", "seed")}
    report = CheckReport(model=str(llm.model_name), dtype=dtype_name, runner=runner.kind,
                         speculative_config=config, params=shown, num_prompts=len(ids),
                         max_tokens=max_tokens, alpha=alpha, near_tie_rule=_near_tie_rule(dtype_name),
                         greedy=[], stats=[])

    with torch.inference_mode():
        report.greedy = _greedy(spec_llm, plain_llm, ids, params, max_tokens, dtype_name)
    for g in report.greedy:
        if g.divergence is not None and runner.rows_invariant:
            report.notes.append(f"prompt {g.prompt_index}: the {report.runner} runner computes rows bitwise alike, "
                                "so even a near-tie should not split greedy outputs here; please report it")
            break
    if llm.tokenizer is not None:
        for g in report.greedy:
            for token in (g.divergence.speculative_token, g.divergence.plain_token) if g.divergence else ():
                if token is not None:
                    report.token_text[token] = llm.tokenizer.decode([token])

    if getattr(spec_llm.speculative_config, "acceptance", "exact") != "exact":
        report.notes.append(f"acceptance {spec_llm.speculative_config.acceptance!r} is lossy by design: its output is "
                            "not meant to be the target's, and the distances above say how far it strays")
    if params.greedy:
        return report
    if params.stop_list:
        report.notes.append("stop strings are not modelled by the exact law; the sampled law is tested without them")
    if spec_llm.speculative_config.adaptive:
        report.notes.append("adaptive K picks each step's K from timings, so the samples (not their law) differ "
                            "from run to run; fix K (adaptive false) for a reproducible check")
    stat_ids = ids[:min(stat_prompts, samples)]  # every prompt of the test gets at least one sample
    per_prompt = [samples // len(stat_ids) + (i < samples % len(stat_ids)) for i in range(len(stat_ids))]
    sample_params = dataclasses.replace(params, n=1, max_tokens=sample_tokens, seed=None, stop=None)
    views = _views(sample_tokens)
    sets = ["rejection sampling"] + (["seeded"] if params.seed is not None else [])
    level = alpha / (len(views) * len(sets))
    terminal = set(sample_params.stop_token_ids) | (set() if sample_params.ignore_eos
                                                    else set(spec_llm.engine.eos_token_ids))

    laws, forwards = [], 0
    budget = max_forwards // len(stat_ids)
    with torch.inference_mode():
        for prompt, n in zip(stat_ids, per_prompt):
            tree = _PrefixTree.build(runner, prompt, sample_params, n, sample_tokens, terminal, budget)
            laws.append(tree)
            forwards += tree.forwards if tree is not None else 0
    plain_samples: list[list[tuple[int, ...]]] | None = None
    if any(t is None for t in laws):  # as many plain samples for the prompts whose exact law is over budget
        fallback_counts = [n if tree is None else 0 for tree, n in zip(laws, per_prompt)]
        plain_samples, _ = _sample_rejection(plain_llm, stat_ids, fallback_counts, sample_params, check_seed + 1)

    sample_sets = []
    spec_samples, metrics = _sample_rejection(spec_llm, stat_ids, per_prompt, sample_params, check_seed)
    sample_sets.append(("rejection sampling", spec_samples, metrics))
    if params.seed is not None:
        seeded_params = dataclasses.replace(sample_params, seed=params.seed)
        seeded_samples, seeded_metrics = _sample_seeded(spec_llm, stat_ids, per_prompt, seeded_params)
        sample_sets.append(("seeded", seeded_samples, seeded_metrics))
    for path, drawn, drawn_metrics in sample_sets:
        report.stats.append(_test(path, drawn, drawn_metrics, laws, plain_samples, per_prompt, views, level,
                                  sample_tokens, forwards))
    accepted = report.stats[0].accepted_per_position
    if sum(accepted[1:]) < MIN_MULTI_TOKEN_ACCEPTS:
        report.notes.append(f"the draft had {sum(accepted[1:])} second (or later) drafts of a step accepted: the "
                            "sampled test saw little of multi-token verification (corrections and bonus tokens "
                            "after several accepted drafts); prompts the draft predicts well (text that repeats, for "
                            "n-gram drafts) exercise it more, as does a larger --sample-tokens (sample_tokens; the "
                            "exact law then takes more target forwards)")
    return report


def _describe_config(config: Any) -> dict[str, Any]:
    """The checked speculative config for the report: method, K, adaptive, and every other setting that differs
    from its default (an acceptance mode, a draft model, ...), objects named by their type."""
    out: dict[str, Any] = {"method": config.method, "num_speculative_tokens": config.num_speculative_tokens,
                           "adaptive": config.adaptive}
    for f in dataclasses.fields(type(config)):
        if f.name in out:
            continue
        value = getattr(config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if value is not default and value != default:
            out[f.name] = value if isinstance(value, (str, int, float, bool)) else type(value).__name__
    return out


def _check_settings(max_tokens, sample_tokens, samples, alpha, max_forwards, stat_prompts) -> None:
    for name, value, least in (("max_tokens", max_tokens, 1), ("sample_tokens", sample_tokens, 1),
                               ("samples", samples, 1), ("max_forwards", max_forwards, 1),
                               ("stat_prompts", stat_prompts, 1)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise QuickdraftError(f"{name} must be an integer >= {least}, got {value!r}")
    if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise QuickdraftError(f"alpha must be a number in (0, 1), got {alpha!r}")


def _near_tie_rule(dtype_name: str) -> str:
    ulps = NEAR_TIE_ULPS.get(dtype_name, 4)
    return (f"both tokens' penalised logits within {ulps} x eps({dtype_name}) x max(1, |largest logit|) of the "
            f"largest, on the common prefix")


def near_tie_tolerance(dtype_name: str, largest_logit: float) -> float:
    """The logit gap below which rounding alone can flip greedy decoding's choice (see NEAR_TIE_ULPS)."""
    import torch

    eps = torch.finfo(getattr(torch, dtype_name, torch.float32)).eps
    return NEAR_TIE_ULPS.get(dtype_name, 4) * eps * max(1.0, abs(largest_logit))


# --- greedy ---------------------------------------------------------------------------------------------
def _greedy(spec_llm: "LLM", plain_llm: "LLM", ids: list[list[int]], params: "SamplingParams", max_tokens: int,
            dtype_name: str) -> list[GreedyResult]:
    greedy_params = dataclasses.replace(params, temperature=0.0, n=1, seed=None, max_tokens=max_tokens)
    prompts = [{"prompt_token_ids": p} for p in ids]
    spec_out = spec_llm.generate(prompts, greedy_params)
    plain_out = plain_llm.generate(prompts, greedy_params)
    results = []
    for index, (prompt, s, p) in enumerate(zip(ids, spec_out, plain_out)):
        a, b = s.outputs[0].token_ids, p.outputs[0].token_ids
        result = GreedyResult(index, len(a), len(b))
        if a != b:
            position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            result.divergence = _divergence(spec_llm, prompt, b[:position], a, b, position, greedy_params, dtype_name)
        results.append(result)
    return results


def _divergence(llm: "LLM", prompt: list[int], common: list[int], spec: list[int], plain: list[int], position: int,
                params: "SamplingParams", dtype_name: str) -> Divergence:
    """The target's penalised logits after prompt + common, and whether the two runs' tokens there tie."""
    a = spec[position] if position < len(spec) else None
    b = plain[position] if position < len(plain) else None
    logits = _processed_row(llm.target, prompt, common, params)  # [V]: penalised logits (greedy)
    largest = float(logits.max())
    tolerance = near_tie_tolerance(dtype_name, largest)
    if a is None or b is None:  # one run ended where the other went on: not a question of rounding
        return Divergence(position, a, b, None, tolerance, False)
    gap = largest - min(float(logits[a]), float(logits[b]))
    return Divergence(position, a, b, gap, tolerance, gap <= tolerance)


def _processed_row(runner, prompt: list[int], output: list[int], params: "SamplingParams") -> "torch.Tensor":
    """sampling.process of the target's next-token logits after prompt + output, with output as the penalty
    history: penalised logits for greedy params, probabilities otherwise. One forward of the whole prefix."""
    import torch

    cache = runner.new_cache()
    tokens = torch.tensor(prompt + output, dtype=torch.long, device=runner.device)
    logits = runner.forward(cache, tokens, 1)  # [1, V]
    return _process(runner, logits, prompt, output, params)[0]


def _process(runner, logits: "torch.Tensor", prompt: list[int], output: list[int] | tuple[int, ...],
             params: "SamplingParams") -> "torch.Tensor":
    """sampling.process of logits [1, V] (float32, as the engine computes them) with the history prompt +
    output, as the engine's Sequence.process does. [1, V]."""
    import torch

    from quickdraft.sampling import PenaltyHistory, process

    seen = counts = None
    if params.uses_penalties:
        history = PenaltyHistory(prompt, runner.vocab_size, logits.device)
        history.append(list(output))
        seen, counts = history.rows(torch.empty(0, dtype=torch.long, device=logits.device), 1)
    return process(logits, params, seen, counts)


# --- the exact law --------------------------------------------------------------------------------------
class _OverBudget(Exception):
    pass


class _PrefixTree:
    """The exact law of plain sampling over output prefixes of up to `depth` tokens, pruned.

    probs: prefix -> its probability, for the prefixes kept (expected count >= STORE_MIN_COUNT under an
        expanded parent); the root () has probability 1.
    expanded: prefix -> the packed mask of tokens of probability zero after it (None: none), for every prefix
        whose next-token distribution was computed (one target forward each).
    terminal: kept prefixes that end the sequence (EOS or a stop token id) before `depth`."""

    def __init__(self, depth: int):
        self.depth = depth
        self.probs: dict[tuple[int, ...], float] = {(): 1.0}
        self.expanded: dict[tuple[int, ...], Any] = {}
        self.terminal: set[tuple[int, ...]] = set()
        self.forwards = 0

    @classmethod
    def build(cls, runner, prompt: list[int], params: "SamplingParams", n: int, depth: int, terminal_tokens: set[int],
              budget: int) -> "_PrefixTree | None":
        """Expand from the prompt, depth first, one forward per prefix on one cache rolled back between
        siblings; None when it would take more than `budget` forwards."""
        import torch

        tree = cls(depth)
        cache = runner.new_cache()
        device = runner.device

        def visit(prefix: tuple[int, ...], logits: torch.Tensor) -> None:
            probs = _process(runner, logits, prompt, prefix, params)[0]  # [V] float32, the engine's numbers
            zero = probs == 0
            tree.expanded[prefix] = _pack(zero) if bool(zero.any()) else None
            child_probs = probs.double() * tree.probs[prefix]  # [V]
            kept = torch.nonzero(child_probs * n >= STORE_MIN_COUNT).flatten().tolist()
            for token in kept:
                tree.probs[prefix + (token,)] = float(child_probs[token])
            for token in kept:
                child = prefix + (token,)
                if token in terminal_tokens:
                    tree.terminal.add(child)
                    continue
                if len(child) >= depth or tree.probs[child] * n < EXPAND_MIN_COUNT:
                    continue
                tree.forwards += 1
                if tree.forwards > budget:
                    raise _OverBudget
                row = runner.forward(cache, torch.tensor([token], dtype=torch.long, device=device), 1)
                visit(child, row)
                cache.rollback(len(prompt) + len(prefix))

        tree.forwards = 1
        try:
            visit((), runner.forward(cache, torch.tensor(prompt, dtype=torch.long, device=device), 1))
        except _OverBudget:
            return None
        return tree

    def impossible(self, tokens: tuple[int, ...]) -> bool:
        """Whether a sample takes a token of probability zero after a prefix whose distribution is known."""
        for i, token in enumerate(tokens):
            prefix = tokens[:i]
            if prefix not in self.expanded:
                return False
            mask = self.expanded[prefix]
            if mask is not None and _is_set(mask, token):
                return True
        return False

    def known(self, view: tuple[int, int]) -> dict[tuple[int, ...], float]:
        """The view's cells the tree knows (key -> probability): kept prefixes of the view's end length, and kept
        terminal ones shorter (a sequence that ended); the rest of the mass is the remainder."""
        start, end = view
        cells: dict[tuple[int, ...], float] = {}
        for prefix, p in self.probs.items():
            if len(prefix) == end or (len(prefix) < end and prefix in self.terminal):
                key = prefix[start:end]
                cells[key] = cells.get(key, 0.0) + p
        return cells

    def key(self, tokens: tuple[int, ...], view: tuple[int, int]) -> tuple[int, ...] | None:
        """A sample's key in the view, or None when its prefix is not one the tree knows (the remainder)."""
        start, end = view
        prefix = tokens[:end]
        if prefix in self.probs and (len(prefix) == end or prefix in self.terminal):
            return prefix[start:end]
        return None


def _pack(mask: "torch.Tensor") -> Any:
    import numpy as np

    return np.packbits(mask.cpu().numpy())


def _is_set(packed: Any, index: int) -> bool:
    return bool((int(packed[index >> 3]) >> (7 - (index & 7))) & 1)


def _views(m: int) -> dict[str, tuple[int, int]]:
    """The statistics: the law of every prefix y1..yd (d = 1..m) and of every window of two tokens that is not a
    prefix (y2y3, ..., y{m-1}y{m}): a deviation confined to two neighbours, spread over many pooled cells of the
    joint law, shows clearly in their window. Slices (start, end) of the output."""
    views = {("y1" if d == 1 else f"y1..y{d}"): (0, d) for d in range(1, m + 1)}
    views.update({f"y{j + 1}y{j + 2}": (j, j + 2) for j in range(1, m - 1)})
    return views


# --- sampling -------------------------------------------------------------------------------------------
def _sample_rejection(llm: "LLM", ids: list[list[int]], per_prompt: list[int], params: "SamplingParams",
                      generator_seed: int, chunk: int = 8):
    """per_prompt[i] completions of prompt i verified by rejection sampling, through a continuous-batching
    scheduler on llm's engine and KV memory (batches mix prompts, prefills and drafting steps as generate's do),
    every sequence drawing from ONE generator seeded with generator_seed: the public API draws a random
    generator seed for requests without one, which would make the check irreproducible. Requests of `chunk`
    completions each, prompts in turn. Returns (samples per prompt, the sequences' metrics)."""
    import torch

    from quickdraft.scheduler import Scheduler

    engine = llm.engine
    generator = torch.Generator(device=engine.device).manual_seed(generator_seed)

    def make_sequences(prompt_ids, request_params):
        return [engine.new_sequence(prompt_ids, request_params, generator, None) for _ in range(request_params.n)]

    scheduler = Scheduler(engine, llm.tokenizer, llm.max_num_seqs, llm.max_num_batched_tokens, make_sequences,
                          memory=llm.kv_memory)
    remaining = list(per_prompt)
    requests: list[tuple[int, Any]] = []
    while any(remaining):
        for index, prompt in enumerate(ids):
            size = min(chunk, remaining[index])
            if size:
                remaining[index] -= size
                requests.append((index, scheduler.add_request(str(len(requests)), prompt,
                                                              dataclasses.replace(params, n=size))))
    while scheduler.has_unfinished():
        scheduler.step()
    samples: list[list[tuple[int, ...]]] = [[] for _ in ids]
    metrics = []
    for index, request in requests:
        for seq in request.sequences:
            samples[index].append(tuple(seq.output_ids))
            metrics.append(seq.metrics)
    return samples, metrics


def _sample_seeded(llm: "LLM", ids: list[list[int]], per_prompt: list[int], params: "SamplingParams"):
    """per_prompt[i] completions of prompt i with the request seed (position-keyed noise), through LLM.generate
    with n completions per prompt."""
    prompts = [{"prompt_token_ids": p} for p in ids]
    outs = llm.generate(prompts, [dataclasses.replace(params, n=n) for n in per_prompt])
    return [[tuple(c.token_ids) for c in out.outputs] for out in outs], [out.metrics for out in outs]


# --- the tests ------------------------------------------------------------------------------------------
def _chi2_pvalue(statistic: float, df: int) -> float:
    """P(chi2_df >= statistic): the regularised upper incomplete gamma Q(df/2, statistic/2)."""
    import torch

    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _pool(expected: list[float], n: int) -> tuple[list[int], int]:
    """Cells by expected count: those >= MIN_EXPECTED keep their own (indices in order), the rest share one pool;
    a pool of less than MIN_EXPECTED (but some mass) takes the smallest cells until it reaches it. Returns
    (group of each input cell, number of groups); the pool, if any, is the last group."""
    order = sorted(range(len(expected)), key=lambda i: expected[i])
    own = [i for i in order if expected[i] * n >= MIN_EXPECTED]
    pooled = [i for i in order if expected[i] * n < MIN_EXPECTED]
    pool_mass = sum(expected[i] for i in pooled)
    while pooled and pool_mass * n < MIN_EXPECTED and own:
        moved = own.pop(0)
        pooled.append(moved)
        pool_mass += expected[moved]
    groups = {i: g for g, i in enumerate(sorted(own))}
    count = len(own)
    if pooled:
        for i in pooled:
            groups[i] = count
        count += 1
    return [groups[i] for i in range(len(expected))], count


def _exact_view(tree: _PrefixTree, drawn: list[tuple[int, ...]], view: tuple[int, int]):
    """(statistic, degrees of freedom, observed [groups], expected probabilities [groups]) of one prompt."""
    cells = tree.known(view)
    keys = list(cells)
    remainder = max(0.0, 1.0 - sum(cells.values()))
    expected = [cells[k] for k in keys] + [remainder]  # the remainder: the prefixes the tree did not reach
    n = len(drawn)
    group_of, count = _pool(expected, n)
    index = {k: i for i, k in enumerate(keys)}
    observed = [0] * count
    expected_groups = [0.0] * count
    for i, p in enumerate(expected):
        expected_groups[group_of[i]] += p
    for tokens in drawn:
        key = tree.key(tokens, view)
        observed[group_of[index[key] if key in index else len(keys)]] += 1
    statistic = sum((o - n * e) ** 2 / (n * e) for o, e in zip(observed, expected_groups) if e > 0)
    # A group of no mass that holds samples (only rounding can leave one): as strong as evidence gets.
    if any(o > 0 and e <= 0 for o, e in zip(observed, expected_groups)):
        statistic = math.inf
    return statistic, count - 1, observed, expected_groups


def _two_sample_view(drawn: list[tuple[int, ...]], reference: list[tuple[int, ...]], view: tuple[int, int]):
    """A two-sample chi-square (a 2 x C contingency table) of one prompt: cells are the keys seen, those with a
    pooled count >= 2 x MIN_EXPECTED on their own. Returns (statistic, df, observed, reference observed)."""
    start, end = view
    keys_a = [t[:end][start:] for t in drawn]
    keys_b = [t[:end][start:] for t in reference]
    counts: dict[tuple[int, ...], list[int]] = {}
    for key in keys_a:
        counts.setdefault(key, [0, 0])[0] += 1
    for key in keys_b:
        counts.setdefault(key, [0, 0])[1] += 1
    keys = list(counts)
    total = len(drawn) + len(reference)
    group_of, count = _pool([(counts[k][0] + counts[k][1]) / total for k in keys], total // 2)
    a, b = [0] * count, [0] * count
    for i, key in enumerate(keys):
        a[group_of[i]] += counts[key][0]
        b[group_of[i]] += counts[key][1]
    statistic = 0.0
    for oa, ob in zip(a, b):
        column = oa + ob
        for observed, row in ((oa, len(drawn)), (ob, len(reference))):
            e = row * column / total
            statistic += (observed - e) ** 2 / e
    return statistic, count - 1, a, b


def _tv(observed: list[int], probs: list[float]) -> tuple[float, float]:
    """(0.5 sum |observed/n - p|, its expected value when the samples follow p: 0.5 sum sqrt(2 p (1-p) / (pi n)),
    the normal approximation of E|binomial/n - p|)."""
    n = sum(observed)
    tv = 0.5 * sum(abs(o / n - p) for o, p in zip(observed, probs))
    noise = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in probs if 0 < p < 1)
    return tv, noise


def _test(path: str, drawn: list[list[tuple[int, ...]]], metrics: list, laws: list[_PrefixTree | None],
          plain_samples: list[list[tuple[int, ...]]] | None, per_prompt: list[int], views: dict[str, tuple[int, int]],
          level: float, sample_tokens: int, forwards: int) -> StatResult:
    pvalues, dfs = {}, {}
    joint = (0, sample_tokens)
    tv = noise = 0.0
    for name, view in views.items():
        statistic, df = 0.0, 0
        for index, (tree, prompt_samples) in enumerate(zip(laws, drawn)):
            if tree is not None:
                s, d, observed, expected = _exact_view(tree, prompt_samples, view)
                if view == joint:
                    t, e = _tv(observed, expected)
            else:
                s, d, observed, reference = _two_sample_view(prompt_samples, plain_samples[index], view)
                if view == joint:
                    na, nb = sum(observed), sum(reference)
                    t = 0.5 * sum(abs(x / na - y / nb) for x, y in zip(observed, reference))
                    pooled = [(x + y) / (na + nb) for x, y in zip(observed, reference)]
                    # Two noisy laws of equal sizes: the difference spreads sqrt(2) x as much as one sample.
                    e = math.sqrt(2) * 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * na)) for p in pooled if p < 1)
            if view == joint:
                weight = len(prompt_samples) / sum(per_prompt)
                tv += weight * t
                noise += weight * e
            statistic += s
            df += d
        pvalues[name] = _chi2_pvalue(statistic, df) if math.isfinite(statistic) else 0.0
        dfs[name] = df
    impossible = [(index, tokens) for index, (tree, prompt_samples) in enumerate(zip(laws, drawn)) if tree is not None
                  for tokens in sorted(set(prompt_samples)) if tree.impossible(tokens)]
    from quickdraft.sequence import RequestMetrics

    drafts = RequestMetrics.combine(metrics)  # per-position counts summed over the sampled sequences
    return StatResult(path=path, samples=sum(per_prompt), sample_tokens=sample_tokens, pvalues=pvalues,
                      degrees_of_freedom=dfs, level=level,
                      exact_prompts=[i for i, t in enumerate(laws) if t is not None],
                      fallback_prompts=[i for i, t in enumerate(laws) if t is None], tree_forwards=forwards,
                      tv_distance=tv, tv_noise=noise, impossible=impossible,
                      proposed_per_position=list(drafts.proposed_per_position),
                      accepted_per_position=list(drafts.accepted_per_position))


# --- the command line -----------------------------------------------------------------------------------
def add_parser(sub) -> None:
    from quickdraft.drafts import draft_help

    p = sub.add_parser("check", help="check that speculative output is plain decoding's (greedy equality and the "
                                     "sampled law) on your prompts, model, draft and sampling settings",
                       description="Exit status: 0 PASS, 1 FAIL, 2 bad input.")
    p.add_argument("--prompts", required=True,
                   help="a text file with one prompt per line, or JSONL: Spec-Bench records (the first of 'turns'), "
                        "'prompt' or 'prompt_token_ids' records")
    p.add_argument("--model", default=None, help="alias (smollm2-135m, gemma3-270m), .gguf, directory or hub id")
    p.add_argument("--draft", default="ngram", help=draft_help())
    p.add_argument("--k", type=int, default=5, help="speculative tokens per step (default 5)")
    p.add_argument("--adaptive", action="store_true",
                   help="adaptive K as `generate` runs it (default: a fixed K, so that the check is reproducible)")
    p.add_argument("--speculative-config", default=None, metavar="FILE_OR_JSON",
                   help="a speculative_config as JSON (or a file holding it), e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3}'; overrides --draft, --k and --adaptive")
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the model's chat template")
    p.add_argument("--max-prompts", type=int, default=None, help="check only the first N prompts of the file")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens per prompt in the greedy comparison (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"the sampled test's temperature (default {DEFAULT_TEMPERATURE}; 0: greedy check only)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="also test the seeded path (requests with this seed)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                   help=f"samples in all, split over the prompts of the sampled test (default {DEFAULT_SAMPLES})")
    p.add_argument("--sample-tokens", type=int, default=DEFAULT_SAMPLE_TOKENS,
                   help=f"tokens per sample (default {DEFAULT_SAMPLE_TOKENS}: the prompt's step, then one step "
                        "verifying up to 2 drafts)")
    p.add_argument("--stat-prompts", type=int, default=DEFAULT_STAT_PROMPTS,
                   help=f"the sampled test uses the first N prompts (default {DEFAULT_STAT_PROMPTS})")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                   help="the sampled test's false-alarm probability, all statistics together "
                        f"(default {DEFAULT_ALPHA:g})")
    p.add_argument("--check-seed", type=int, default=DEFAULT_CHECK_SEED,
                   help="the seed of the generator that drives rejection sampling (the check is reproducible)")
    p.add_argument("--max-forwards", type=int, default=DEFAULT_MAX_FORWARDS,
                   help="target forwards for enumerating exact laws; a prompt over its share is compared with "
                        f"plain-decoding samples instead (default {DEFAULT_MAX_FORWARDS})")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "hf"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    p.set_defaults(func=run)


def speculative_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """--speculative-config (JSON text or a file of it), else --draft / --k / --adaptive."""
    from quickdraft.drafts import SpeculativeConfig, parse_draft, read_config

    if args.speculative_config is not None:
        spec = read_config(args.speculative_config)
    else:
        if args.draft == "none":
            raise QuickdraftError("--draft none is plain decoding: there is nothing to check; give a draft")
        spec = parse_draft(args.draft, args.k)
        spec["adaptive"] = bool(args.adaptive)
    SpeculativeConfig.from_dict(spec)  # its errors before the model loads
    return spec


def sampling_params_from_args(args: argparse.Namespace) -> "SamplingParams":
    from quickdraft.params import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, seed=args.seed)
    except QuickdraftError as exc:
        raise QuickdraftError(f"--{str(exc).split(' ', 1)[0].replace('_', '-')}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """`quickdraft check`: prints the report; 0 on PASS, 1 on FAIL (bad input raises QuickdraftError: 2)."""
    import quickdraft
    from quickdraft.models.loader import DEFAULT_MODEL, quiet_transformers

    params = sampling_params_from_args(args)
    _check_settings(args.max_tokens, args.sample_tokens, args.samples, args.alpha, args.max_forwards,
                    args.stat_prompts)
    if args.max_prompts is not None and args.max_prompts < 1:
        raise QuickdraftError(f"--max-prompts must be >= 1, got {args.max_prompts}")
    prompts = read_prompts(args.prompts)[: args.max_prompts]
    spec = speculative_config_from_args(args)
    quiet_transformers()
    llm = quickdraft.LLM(args.model or DEFAULT_MODEL, speculative_config=spec, dtype=args.dtype, device=args.device,
                         trust_remote_code=args.trust_remote_code, runner=args.runner)
    report = check(llm, prompts, params, chat=args.chat, max_tokens=args.max_tokens,
                   sample_tokens=args.sample_tokens, samples=args.samples, alpha=args.alpha,
                   check_seed=args.check_seed, max_forwards=args.max_forwards, stat_prompts=args.stat_prompts)
    print(json.dumps(report.to_dict()) if args.json else report.render())
    return 0 if report.passed else 1

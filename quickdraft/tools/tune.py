"""`quickdraft tune`: which draft, which K, fixed or adaptive, on *my* prompts?

For each candidate draft (the `--draft` strings of `quickdraft generate`: ngram, suffix, layers:N, quantized,
a draft model) it measures, on the user's prompts and one loaded target:

1. acceptance by position: every prompt decoded at a fixed K = k_max; alpha_i = accepted_i / reached_i (the
   chance that draft position i is accepted given that every earlier draft of the step was), and the
   distribution of proposal lengths (lookups propose fewer than K tokens, or none, on many steps);
2. for drafts with probabilities (draft_model, layer_skip, quantized): the mean KL(target || draft) and total
   variation between the two next-token distributions on the target's own greedy continuations;
3. step costs: the target forward over 1 .. k_max + 1 rows at a realistic context, and the draft's cost (a
   model draft's one-token forward per draft token; a lookup's measured propose time per step), forwards timed
   in rounds spread over the acceptance runs (ForwardTimes);
4. the predicted speedup at each K (the analytic model below), and then, against plain decoding on the same
   prompts in one interleaved pass, the measured speedup of the predicted best K, fixed and adaptive.

The prediction at K, with P(l) the chance that a step proposes l tokens when allowed k_max (lookups: their
measured distribution; model drafts: l = k_max but for the last steps of a generation) and c_i = alpha_0 x ..
x alpha_i the chance that the draft at position i is accepted:
    tokens per step  E(K) = 1 + sum_{i<K} P(l > i) c_i
    seconds per step C(K) = sum_l P(l) t_target(min(l, K) + 1) + draft seconds per step
                            + E[min(l, K)] x draft seconds per draft token
    speedup(K) = E(K) t_target(1) / C(K)
(quickdraft/bench/costs.py has the same model with one pooled alpha and a mean draft length.) t_target is the line
fitted through the measured forward times (fit_forward_costs: robust to a size timed in someone else's burst).
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
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from quickdraft.adaptive import monotone_fit
from quickdraft.bench.costs import measure_target_forward
from quickdraft.drafts import SpeculativeConfig, draft_help, draft_label, parse_draft
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.sampling import derive_key
from quickdraft.sequence import RequestMetrics
from quickdraft.tools.prompts import prompt_token_ids, read_prompts

DEFAULT_DRAFTS = "ngram,suffix"
DEFAULT_K_MAX = 8
DEFAULT_MAX_TOKENS = 128
DIVERGENCE_POSITIONS = 256  # target/draft positions compared for KL and TV: a few hundred suffice
WARMUP_TOKENS = 8
# Median and pooled measured speedups further apart than this factor: some runs were slowed by other work.
NOISE_RATIO = 1.5
COST_REPEATS = 7
MODEL_DRAFT_METHODS = ("draft_model", "layer_skip", "quantized")

Progress = Callable[[str], None]


# --- candidate drafts --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One draft to tune: its label and its speculative_config (K = k_max, fixed)."""

    label: str
    config: dict[str, Any]

    @property
    def method(self) -> str:
        return self.config["method"]

    @property
    def is_model(self) -> bool:
        """Whether it drafts with a model (so it has probabilities, and pays per draft token)."""
        return self.method in MODEL_DRAFT_METHODS


def _config_label(config: dict[str, Any]) -> str:
    """A draft config as the command line's --draft names it (the draft registry's label)."""
    return draft_label(config)


def _check_draft_model(model: Any, label: str) -> None:
    """A draft model given by name must resolve (alias, file, directory or hub id) before anything loads."""
    if not isinstance(model, str):
        return
    from quickdraft.models import loader

    try:
        loader.resolve(model)
    except QuickdraftError as exc:
        raise QuickdraftError(f"unknown draft {label!r}: not ngram, suffix, layers:N or quantized, and not a draft "
                              f"model ({exc})") from None


def parse_candidates(drafts: str | Sequence[Any], k_max: int) -> list[Candidate]:
    """The drafts to tune, each as a Candidate at K = k_max (fixed): a comma list or a list of `--draft` strings
    (ngram | suffix | layers:N | quantized | a draft model alias/path), speculative_config dicts, or
    SpeculativeConfigs. Checked before any model loads."""
    if not (isinstance(k_max, int) and not isinstance(k_max, bool) and k_max >= 1):
        raise QuickdraftError(f"k_max must be an integer >= 1, got {k_max!r}")
    if isinstance(drafts, str):
        drafts = [part.strip() for part in drafts.split(",")]
    if isinstance(drafts, (dict, SpeculativeConfig)):
        drafts = [drafts]
    if not isinstance(drafts, (list, tuple)) or not drafts:
        raise QuickdraftError("no drafts given: pass at least one, e.g. --drafts ngram,suffix")
    candidates: list[Candidate] = []
    for draft in drafts:
        if isinstance(draft, str):
            if not draft:
                raise QuickdraftError("--drafts has an empty entry; give a comma list such as ngram,suffix,layers:12")
            config = parse_draft(draft, k_max)
            label = draft
        elif isinstance(draft, SpeculativeConfig):
            config = draft.settings()
            label = None
        elif isinstance(draft, dict):
            config = dict(draft)
            label = None
        else:
            raise QuickdraftError(f"a draft is a --draft string or a speculative_config dict, got "
                                  f"{type(draft).__name__}")
        config.update(num_speculative_tokens=k_max, adaptive=False)
        config["method"] = SpeculativeConfig.from_dict(config).method  # checks it; infers draft_model from model
        if config["method"] == "none":
            raise QuickdraftError("draft 'none' is plain decoding, the baseline tune always measures; drop it from "
                                  "the drafts")
        label = label or _config_label(config)
        if config["method"] == "draft_model":
            _check_draft_model(config["model"], label)
        taken = [c.label for c in candidates]
        if label in taken:
            label = f"{label}#{taken.count(label) + sum(t.startswith(label + '#') for t in taken) + 1}"
        candidates.append(Candidate(label, config))
    return candidates


# --- the analytic model (pure functions) -------------------------------------------------------------------------

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


def expected_tokens_per_step(rates: Sequence[float | None], length_distribution: Sequence[float], k: int) -> float:
    """E(K) = 1 + sum_{i<K} P(l > i) c_i with c_i = alpha_0 ... alpha_i: the target's token plus each draft
    position that is proposed (a step proposes min(l, K) tokens) and accepted with every one before it."""
    alphas = filled_rates(rates, k)
    tokens, survive = 1.0, 1.0
    for i in range(k):
        survive *= alphas[i]
        tokens += sum(length_distribution[i + 1:]) * survive
    return tokens


def expected_drafts_per_step(length_distribution: Sequence[float], k: int) -> float:
    """E[min(l, K)]: draft tokens a step proposes at K."""
    return sum(p * min(l, k) for l, p in enumerate(length_distribution))


def fit_forward_costs(forward_s: dict[int, float]) -> dict[int, float]:
    """The measured forward seconds by rows (each the median of rounds spread over the run: ForwardTimes),
    made non-decreasing (adaptive.monotone_fit: more rows never cost less). Not a straight line: on CPUs the
    cost by rows has steps where the kernels' tiles fill (measured on an AVX512 machine without AMX: 17.4 ms at
    6 rows, 20.7 at 7), and a line through them misplaces the best K."""
    sizes = sorted(forward_s)
    return {n: max(1e-9, v) for n, v in zip(sizes, monotone_fit([forward_s[n] for n in sizes]))}


def forward_seconds(forward_s: dict[int, float], rows: float) -> float:
    """The target forward over `rows` new tokens, interpolated between the measured sizes."""
    sizes = sorted(forward_s)
    return float(np.interp(rows, sizes, [forward_s[s] for s in sizes]))


def step_seconds(length_distribution: Sequence[float], k: int, forward_s: dict[int, float],
                 draft_s_per_step: float = 0.0, draft_s_per_token: float = 0.0) -> float:
    """C(K) = sum_l P(l) t_target(min(l, K) + 1) + draft seconds per step + E[min(l, K)] x draft seconds per
    draft token."""
    verify = sum(p * forward_seconds(forward_s, min(l, k) + 1) for l, p in enumerate(length_distribution))
    return verify + draft_s_per_step + expected_drafts_per_step(length_distribution, k) * draft_s_per_token


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
    return Prediction(k, tokens, seconds, tokens * forward_seconds(forward_s, 1) / seconds)


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


# --- KL and total variation between target and draft -------------------------------------------------------------

def distribution_divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, KL(p || q) and the total variation 1/2 sum |p - q| between p = softmax(target / T) and
    q = softmax(draft / T). target_logits, draft_logits: [n, V]; returns ([n], [n]). A token the draft cannot
    produce but the target can makes the KL infinite (as it is)."""
    if target_logits.shape != draft_logits.shape:
        raise QuickdraftError(f"target and draft logits differ in shape: {tuple(target_logits.shape)} vs "
                              f"{tuple(draft_logits.shape)}")
    log_p = torch.log_softmax(target_logits.double() / temperature, dim=-1)  # [n, V]
    log_q = torch.log_softmax(draft_logits.double() / temperature, dim=-1)  # [n, V]
    p, q = log_p.exp(), log_q.exp()
    kl = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)  # [n]
    tv = 0.5 * (p - q).abs().sum(-1)  # [n]
    return kl, tv


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [n, V_draft] on the target's vocabulary [n, vocab] (vocabularies that differ only by padding,
    as the draft_model proposer reconciles them: the draft's extra rows dropped, the target's extra ids given
    no draft probability)."""
    extra = vocab - logits.shape[-1]
    if extra < 0:
        return logits[..., :vocab]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits


@torch.inference_mode()
def measure_divergence(target, draft, sequences: Sequence[tuple[list[int], list[int]]],
                       temperature: float = 1.0) -> tuple[float, float, int]:
    """Mean KL(target || draft) and total variation over the positions of `sequences` (prompt ids, the
    target's continuation): each runner reads prompt + continuation in one forward, and row j compares their
    distributions of continuation token j. Returns (mean KL, mean TV, positions compared)."""
    kl_sum, tv_sum, positions = 0.0, 0.0, 0
    limit = min(target.max_len, draft.max_len)
    for prompt_ids, continuation in sequences:
        count = min(len(continuation), limit - len(prompt_ids) + 1)
        if count < 1:
            continue
        feed = torch.tensor(prompt_ids + continuation[:count - 1], dtype=torch.long)  # [prompt + count - 1]
        target_logits = target.forward(target.new_cache(), feed.to(target.device), num_logits=count)  # [count, V]
        draft_logits = draft.forward(draft.new_cache(), feed.to(draft.device), num_logits=count)  # [count, V_draft]
        draft_logits = _to_vocab(draft_logits.to(target_logits.device), target_logits.shape[-1])  # [count, V]
        kl, tv = distribution_divergence(target_logits, draft_logits, temperature)
        kl_sum += float(kl.sum())
        tv_sum += float(tv.sum())
        positions += count
    if not positions:
        return math.nan, math.nan, 0
    return kl_sum / positions, tv_sum / positions, positions


# --- timed runs --------------------------------------------------------------------------------------------------

@dataclass
class RunTotals:
    """One configuration's generations in a pass: decode tokens (after each generation's first) and decode
    seconds (after its first token), pooled; and each generation's metrics and output."""

    label: str
    tokens: int = 0
    seconds: float = 0.0
    prompt_tokens_per_s: list[float | None] = field(default_factory=list)  # per prompt, in prompt order
    metrics: list[RequestMetrics] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def add(self, metrics: RequestMetrics, output: list[int]) -> None:
        tokens = max(0, metrics.num_generated_tokens - 1)
        seconds = max(0.0, metrics.wall_time_s - (metrics.first_token_time_s or 0.0))
        self.tokens += tokens
        self.seconds += seconds
        self.prompt_tokens_per_s.append(tokens / seconds if tokens and seconds > 0 else None)
        self.metrics.append(metrics)
        self.outputs.append(output)


def _prompt_params(params: SamplingParams, index: int) -> SamplingParams:
    """Prompt `index`'s parameters: with a temperature, a seed of its own (derived from the given seed, or 0),
    so that every configuration draws the same position-keyed noise and decodes the same text."""
    if params.greedy:
        return params
    return replace(params, seed=derive_key(params.seed or 0, index))


def generate_once(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> tuple[RequestMetrics, list[int]]:
    """One generation driven on the engine directly (no scheduler, no detokenization): its metrics (with
    first-token and wall times) and output ids."""
    generator = None
    noise_key = None
    if not params.greedy:
        generator = torch.Generator(device=engine.device).manual_seed(derive_key(params.seed))
        noise_key = derive_key(params.seed, 0)
    seq = engine.new_sequence(prompt_ids, params, generator, noise_key)
    for _ in engine.run(seq):
        pass
    return seq.metrics, list(seq.output_ids)


def run_rotation(engines: dict[str, Engine], prompts: Sequence[list[int]], params: SamplingParams,
                 progress: Progress | None = None, what: str = "run",
                 after_prompt: Callable[[], None] | None = None) -> dict[str, RunTotals]:
    """Every configuration on every prompt, prompt by prompt; within prompt p the configurations start at the
    (p mod n)-th and wrap around, so none is always first or always after the same one. after_prompt runs
    after each prompt's configurations (e.g. a round of forward timings)."""
    labels = list(engines)
    totals = {label: RunTotals(label) for label in labels}
    for index, prompt_ids in enumerate(prompts):
        if progress:
            progress(f"{what}: prompt {index + 1}/{len(prompts)} ({len(labels)} configuration"
                     f"{'s' if len(labels) != 1 else ''})")
        shift = index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            totals[label].add(*generate_once(engines[label], prompt_ids, _prompt_params(params, index)))
        if after_prompt is not None:
            after_prompt()
    return totals


class ForwardTimes:
    """Forward seconds by rows for a few runners, sampled in rounds spread over a pass: one round before it and
    one after each prompt, each round every size of every runner back to back; per size the median of its
    rounds. Why spread: on a shared machine a burst of someone else's work can last many seconds (seen: every
    forward of a first round at 1.7 s against 15 ms a minute later), which one timing window cannot escape but
    a median over rounds minutes apart ignores."""

    def __init__(self, runners: dict[str, tuple[Any, list[int]]], context_ids: list[int]):
        self.runners = runners  # name -> (runner, sizes: rows per forward)
        self.context_ids = context_ids
        self.samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes}
                                                           for name, (_, sizes) in runners.items()}

    def sample(self, repeats: int = 1) -> None:
        """One round (of `repeats` timings per size: measure_target_forward's medians) of every runner."""
        for name, (runner, sizes) in self.runners.items():
            context = self.context_ids[:max(1, min(len(self.context_ids), runner.max_len - max(sizes) - 1))]
            context = [t % runner.vocab_size for t in context]  # a draft of another vocabulary: same cost
            for n, seconds in measure_target_forward(runner, context, sizes, repeats).items():
                self.samples[name][n].append(seconds)

    def medians(self, name: str) -> dict[int, float]:
        return {n: statistics.median(times) for n, times in self.samples[name].items()}


class _Session:
    """One target, the prompts, and each candidate's draft loaded once; engines for any configuration."""

    def __init__(self, llm, prompts: Sequence[Any], drafts, k_max: int, params: SamplingParams | None,
                 chat: bool, progress: Progress | None):
        self.progress = progress
        self.params = params if params is not None else SamplingParams(temperature=0.0, max_tokens=DEFAULT_MAX_TOKENS)
        if not isinstance(self.params, SamplingParams):
            raise QuickdraftError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        if self.params.n != 1:
            raise QuickdraftError(f"tune measures one completion per prompt; use n=1, got n={self.params.n}")
        if self.params.max_tokens < 2:
            raise QuickdraftError(f"max_tokens must be >= 2 (speeds are measured after the first token), "
                                  f"got {self.params.max_tokens}")
        self.k_max = k_max
        self.candidates = parse_candidates(drafts, k_max)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise QuickdraftError("no prompts given: pass at least one prompt")
        self.llm = llm
        self.prompt_ids = [prompt_token_ids(llm, p, chat) for p in prompts]
        self.plain_llm = llm.with_speculative_config({"method": "none"})
        max_len = self.plain_llm.engine.max_len
        for index, ids in enumerate(self.prompt_ids):
            if len(ids) >= max_len:
                raise QuickdraftError(f"prompt {index + 1} has {len(ids)} tokens but the context holds {max_len}; "
                                      "shorten it or drop it from the prompts")
        # Each candidate's LLM (its draft model loaded once, on the shared target): model drafts keep only
        # per-sequence state, so their engines at every K share it; lookups get a fresh proposer per engine.
        self.draft_llms = {}
        self.acceptance_runs: dict[str, RunTotals] = {}  # the runs at K = k_max, by candidate label
        for candidate in self.candidates:
            self._say(f"loading draft {candidate.label} ...")
            self.draft_llms[candidate.label] = llm.with_speculative_config(candidate.config)

    def _say(self, message: str) -> None:
        if self.progress:
            self.progress(message)

    def plain_engine(self) -> Engine:
        return self.plain_llm.engine.with_k(0, adaptive_k=False)

    def engine(self, candidate: Candidate, k: int, adaptive: bool) -> Engine:
        draft_llm = self.draft_llms[candidate.label]
        if draft_llm.proposer.runs_a_model:
            return draft_llm.engine.with_k(k, adaptive_k=adaptive)
        config = {**candidate.config, "num_speculative_tokens": k, "adaptive": adaptive}
        return self.llm.with_speculative_config(config).engine

    def candidate_of(self, config: dict[str, Any]) -> Candidate | None:
        """The candidate whose draft `config` uses (the same config but for K and adaptivity), if any."""
        spec = SpeculativeConfig.from_dict(config)

        def draft_part(c: dict[str, Any]) -> dict[str, Any]:
            return {key: value for key, value in c.items() if key not in ("num_speculative_tokens", "adaptive")}

        wanted = {**draft_part(config), "method": spec.method}
        return next((c for c in self.candidates if draft_part(c.config) == wanted), None)

    def config_engine(self, config: dict[str, Any]) -> Engine:
        """The engine of any speculative_config; on a candidate's loaded draft where it uses one."""
        spec = SpeculativeConfig.from_dict(config)
        if spec.method == "none":
            return self.plain_engine()
        candidate = self.candidate_of(config)
        if candidate is not None:
            return self.engine(candidate, spec.num_speculative_tokens, spec.adaptive)
        return self.llm.with_speculative_config(config).engine

    def warm_up(self) -> None:
        """One short generation on the target and on each model draft (first-call allocations, kernels), on
        throwaway engines: the engines that are timed start clean (a suffix cache empty)."""
        self._say("warming up ...")
        params = replace(self.params, max_tokens=min(WARMUP_TOKENS, self.params.max_tokens))
        generate_once(self.plain_engine(), self.prompt_ids[0], _prompt_params(params, 0))
        for candidate in self.candidates:
            generate_once(self.draft_llms[candidate.label].engine.with_k(self.k_max, adaptive_k=False),
                          self.prompt_ids[0], _prompt_params(params, 0))

    def cost_context(self) -> list[int]:
        """Token ids for timing forwards at a realistic context: the median prompt plus half the generation,
        cycling through the prompts' tokens."""
        every = [t for ids in self.prompt_ids for t in ids]
        length = int(statistics.median(len(ids) for ids in self.prompt_ids)) + self.params.max_tokens // 2
        length = max(1, min(length, self.llm.target.max_len - self.k_max - 2))
        return [every[i % len(every)] for i in range(length)]


# --- reports -----------------------------------------------------------------------------------------------------

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
    draft_s_per_token: float  # model drafts: measured one-token forward of the draft; lookups: 0
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
            if not isinstance(value, (str, int, float, bool, type(None))):
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


# --- tune and sweep ----------------------------------------------------------------------------------------------

def _draft_costs(session: _Session, candidate: Candidate, profile: AcceptanceProfile,
                 forward_times: ForwardTimes) -> tuple[float, float]:
    """(draft seconds per step, draft seconds per draft token): a lookup's measured propose time per step of
    its run; a model draft's one-token forward at the target's timing context."""
    if candidate.is_model:
        return 0.0, forward_times.medians(candidate.label)[1]
    pooled = RequestMetrics.combine(session.acceptance_runs[candidate.label].metrics)
    return pooled.draft_time_s / profile.steps, 0.0


def _continuations(session: _Session) -> list[tuple[list[int], list[int]]]:
    """The target's greedy continuation of each prompt, DIVERGENCE_POSITIONS tokens in all at most."""
    per_prompt = max(1, min(session.params.max_tokens, math.ceil(DIVERGENCE_POSITIONS / len(session.prompt_ids))))
    params = SamplingParams(temperature=0.0, max_tokens=per_prompt)
    engine = session.plain_engine()
    return [(ids, generate_once(engine, ids, params)[1]) for ids in session.prompt_ids]


def tune(llm, prompts: Sequence[Any], drafts: str | Sequence[Any] = DEFAULT_DRAFTS, k_max: int = DEFAULT_K_MAX,
         params: SamplingParams | None = None, *, chat: bool = False, sweep: bool = False,
         progress: Progress | None = None) -> TuneReport:
    """Measure each draft on these prompts and recommend a speculative_config (see the module doc).

    llm: a loaded LLM (its target is shared by every configuration; its own draft is not used).
    prompts: strings (tokenized; with chat as user messages through the chat template), token-id lists, or
        dicts with "prompt" / "prompt_token_ids".
    drafts: --draft strings (a comma list or a list), speculative_config dicts, or SpeculativeConfigs.
    params: the sampling (default greedy, 128 tokens); with a temperature each prompt gets its own seed.
    sweep: also run the exhaustive check (every draft at every K), with the pick measured in the same pass.
    progress: called with a line of text as each phase starts."""
    start = time.perf_counter()
    session = _Session(llm, prompts, drafts, k_max, params, chat, progress)
    params = session.params
    session.warm_up()

    context_ids = session.cost_context()
    session._say(f"timing target forwards of 1..{k_max + 1} rows at {len(context_ids)} tokens of context (and again "
                 "after each prompt) ...")
    timed = {"target": (llm.target, list(range(1, k_max + 2)))}
    timed.update({c.label: (session.draft_llms[c.label].proposer.draft_runner, [1])
                  for c in session.candidates if c.is_model})
    forward_times = ForwardTimes(timed, context_ids)
    forward_times.sample(COST_REPEATS)

    engines = {c.label: session.engine(c, k_max, adaptive=False) for c in session.candidates}
    session.acceptance_runs = run_rotation(engines, session.prompt_ids, params, progress,
                                           f"acceptance at K={k_max}", forward_times.sample)
    forward_s = forward_times.medians("target")
    forward_fit_s = fit_forward_costs(forward_s)

    continuations = _continuations(session) if any(c.is_model for c in session.candidates) else []
    temperature = params.temperature if params.temperature > 0 else 1.0

    results: list[DraftResult] = []
    for candidate in session.candidates:
        profile = AcceptanceProfile.from_metrics(session.acceptance_runs[candidate.label].metrics)
        if profile.steps < 1:
            raise QuickdraftError("the prompts generated no token after the first; raise --max-tokens or use prompts "
                                  "that do not end at once")
        per_step, per_token = _draft_costs(session, candidate, profile, forward_times)
        distribution = profile.length_distribution(k_max)
        predictions = [predict(profile.rates, distribution, k, forward_fit_s, per_step, per_token)
                       for k in range(1, k_max + 1)]
        result = DraftResult(candidate, profile, per_step, per_token, predictions, best_prediction(predictions).k)
        proposer = session.draft_llms[candidate.label].proposer
        # A draft with another tokenizer reads other token ids: its distributions are not over the target's
        # next token at the same positions, so KL and TV are left out (n/a) for it.
        if candidate.is_model and getattr(proposer, "draft_reads_target_tokens", True):
            session._say(f"KL and TV of {candidate.label} against the target ...")
            result.kl, result.tv, result.divergence_positions = measure_divergence(
                llm.target, proposer.draft_runner, continuations, temperature)
        results.append(result)

    engines = {"none": session.plain_engine()}
    for result in results:
        engines[f"{result.label} K={result.best_k}"] = session.engine(result.candidate, result.best_k, adaptive=False)
        engines[f"{result.label} adaptive K<={result.best_k}"] = session.engine(result.candidate, result.best_k,
                                                                                adaptive=True)
    measured = run_rotation(engines, session.prompt_ids, params, progress, "measured vs plain")
    plain = measured["none"]
    if not plain.tokens:
        raise QuickdraftError("the prompts generated no token after the first; raise --max-tokens or use prompts "
                              "that do not end at once")
    for result in results:
        result.fixed = _measurement(measured[f"{result.label} K={result.best_k}"], plain)
        result.adaptive = _measurement(measured[f"{result.label} adaptive K<={result.best_k}"], plain)

    results.sort(key=lambda r: (r.measured_speedup or 0.0, r.predicted_speedup), reverse=True)
    top = results[0]
    notes = []
    ended = sum(m.num_generated_tokens < 2 for m in plain.metrics)
    if ended:
        notes.append(f"{ended} of {len(plain.metrics)} prompts ended at their first token (EOS) and measure nothing"
                     + ("" if chat else "; a chat model may want its chat template: --chat (chat=True)"))
    disagreeing = [r for r in results if r.measured and r.measured.noisy]
    if disagreeing:
        worst = disagreeing[0]
        notes.append(f"the measured speedups are noisy ({worst.label}: {worst.measured.speedup:.2f}x by the median "
                     f"prompt, {worst.measured.pooled_speedup:.2f}x pooled): other work slowed some runs; rerun on a "
                     "quieter machine or with more prompts before trusting the ranking")
    if (top.measured_speedup or 0.0) < 1.0:
        recommended = {"method": "none"}
        notes.append(f"no draft beat plain decoding on these prompts (best: {top.label} at "
                     f"{_num(top.measured_speedup, '.2f')}x): plain decoding is recommended")
    else:
        recommended = top.config
    report = TuneReport(getattr(llm, "model_name", "model"), len(session.prompt_ids), k_max, params.max_tokens,
                        params.temperature, len(context_ids), forward_s, forward_fit_s, _measurement(plain, plain),
                        results, recommended, notes)
    if sweep:
        report.sweep = _sweep(session, pick=recommended)
    report.elapsed_s = time.perf_counter() - start
    return report


def _sweep(session: _Session, pick: dict[str, Any] | None) -> SweepReport:
    k_max = session.k_max
    engines: dict[str, Engine] = {"none": session.plain_engine()}
    kinds: dict[str, tuple[str, int, bool]] = {"none": ("none", 0, False)}
    for candidate in session.candidates:
        for k in range(1, k_max + 1):
            label = f"{candidate.label} K={k}"
            engines[label] = session.engine(candidate, k, adaptive=False)
            kinds[label] = (candidate.label, k, False)
    pick_label = None
    if pick is not None:
        spec = SpeculativeConfig.from_dict(pick)
        pick_label = _grid_label(session, pick)
        if pick_label is None:
            pick_label = "pick: " + (_config_label({**pick, "method": spec.method})
                                     + (f" adaptive K<={spec.num_speculative_tokens}" if spec.adaptive
                                        else f" K={spec.num_speculative_tokens}"))
            engines[pick_label] = session.config_engine(pick)
            kinds[pick_label] = ("pick", spec.effective_k, spec.adaptive)
    totals = run_rotation(engines, session.prompt_ids, session.params, session.progress, "sweep")
    plain = totals["none"]
    rows = []
    for label, run in totals.items():
        draft, k, adaptive = kinds[label]
        measured = _measurement(run, plain)
        rows.append(SweepRow(label, draft, k, adaptive, run.tokens, run.seconds, run.tokens_per_s,
                             measured.pooled_speedup, measured.speedup))
    best = max(rows, key=lambda row: row.tokens_per_s or 0.0)
    pick_speed = totals[pick_label].tokens_per_s if pick_label is not None else None
    return SweepReport(k_max, rows, pick_label, pick_speed, best.label, best.tokens_per_s)


def _grid_label(session: _Session, config: dict[str, Any]) -> str | None:
    """The sweep's label for `config` where it is one of the grid's configurations (plain decoding, or a
    candidate at a fixed K)."""
    spec = SpeculativeConfig.from_dict(config)
    if spec.method == "none":
        return "none"
    candidate = session.candidate_of(config)
    if spec.adaptive or candidate is None or not 1 <= spec.num_speculative_tokens <= session.k_max:
        return None
    return f"{candidate.label} K={spec.num_speculative_tokens}"


def sweep(llm, prompts: Sequence[Any], drafts: str | Sequence[Any] = DEFAULT_DRAFTS, k_max: int = DEFAULT_K_MAX,
          params: SamplingParams | None = None, *, pick: dict[str, Any] | None = None, chat: bool = False,
          progress: Progress | None = None) -> SweepReport:
    """The exhaustive check: every draft at every fixed K in 1..k_max, and plain decoding, on the same prompts in
    one rotating pass (decode tokens/s, pooled over prompts). `pick` (a speculative_config, e.g. a TuneReport's
    recommended_config) is measured in the same pass and reported as a fraction of the fastest configuration."""
    session = _Session(llm, prompts, drafts, k_max, params, chat, progress)
    session.warm_up()
    return _sweep(session, pick)


# --- command line ------------------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure drafts and K on your prompts and write the best speculative_config",
                       description="Measure each draft's acceptance by position, its KL/TV to the target (model "
                                   "drafts), the step costs and the predicted and measured speedups on your prompts; "
                                   "print a ranked table and write the recommended speculative_config as JSON.")
    p.add_argument("--model", default=None, help="alias (smollm2-135m, gemma3-270m), .gguf, directory or hub id")
    p.add_argument("--prompts", required=True,
                   help="a text file of one prompt per line, or JSONL: Spec-Bench records (first turn) or "
                        "{\"prompt\": ...} / {\"prompt_token_ids\": [...]} records")
    p.add_argument("--drafts", default=DEFAULT_DRAFTS,
                   help=f"comma list of drafts as --draft takes them: {draft_help(DEFAULT_DRAFTS)}")
    p.add_argument("--k-max", type=int, default=DEFAULT_K_MAX, help=f"largest K tried (default {DEFAULT_K_MAX})")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens generated per prompt (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None,
                   help="with a temperature: the seed each prompt's own seed derives from (default 0)")
    p.add_argument("--out", default=None, help="write the recommended speculative_config here as JSON")
    p.add_argument("--sweep", action="store_true",
                   help="also measure every draft at every K in 1..k-max and report the pick's speed as a fraction "
                        "of the fastest")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "hf"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    p.set_defaults(func=run_tune)


def _check_out_path(out: str | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.is_dir():
        raise QuickdraftError(f"--out {out} is a directory; give a file name such as {path / 'speculative.json'}")
    if not path.parent.is_dir():
        raise QuickdraftError(f"--out {out}: directory {path.parent} does not exist; create it or write elsewhere")
    return path


def load_llm(args: argparse.Namespace):
    """The target for `quickdraft tune` (plain: each draft is attached to it in turn)."""
    from quickdraft import LLM
    from quickdraft.models.loader import DEFAULT_MODEL

    return LLM(args.model or DEFAULT_MODEL, speculative_config={"method": "none"}, dtype=args.dtype,
               device=args.device, runner=args.runner, trust_remote_code=args.trust_remote_code)


def run_tune(args: argparse.Namespace) -> int:
    from quickdraft.models.loader import quiet_transformers

    # Everything that can be checked is checked before the model loads.
    prompts = read_prompts(args.prompts)
    parse_candidates(args.drafts, args.k_max)
    out = _check_out_path(args.out)
    if args.threads is not None and args.threads < 1:
        raise QuickdraftError(f"--threads must be >= 1, got {args.threads}")
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    except QuickdraftError as exc:
        raise QuickdraftError(f"--{str(exc).split(' ', 1)[0].replace('_', '-')}: {exc}") from None
    if args.max_tokens < 2:
        raise QuickdraftError(f"--max-tokens must be >= 2 (speeds are measured after the first token), "
                              f"got {args.max_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)

    def progress(message: str) -> None:
        print(f"[tune] {message}", file=sys.stderr, flush=True)

    quiet_transformers()
    progress(f"loading {args.model or 'the default model'} ...")
    llm = load_llm(args)
    report = tune(llm, prompts, args.drafts, args.k_max, params, chat=args.chat, sweep=args.sweep, progress=progress)
    print(report.render())
    if out is not None:
        out.write_text(report.recommended_json + "\n", encoding="utf-8")
        print(f"wrote the recommended speculative_config to {out}")
    print(f"[tune] done in {report.elapsed_s:.0f} s", file=sys.stderr)
    return 0

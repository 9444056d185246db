"""Timed runs: every configuration on every prompt in a rotating order (run_rotation), forward timings spread
over a pass (ForwardTimes), and the session that holds the target, the prompts and each candidate's draft."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from quickdraft.bench.costs import measure_target_forward
from quickdraft.drafts import SpeculativeConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.sampling import derive_key
from quickdraft.sequence import RequestMetrics
from quickdraft.tools.prompts import prompt_token_ids
from quickdraft.tools.tune.candidates import Candidate, parse_candidates
from quickdraft.tools.tune.defaults import DEFAULT_MAX_TOKENS

WARMUP_TOKENS = 8

Progress = Callable[[str], None]


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

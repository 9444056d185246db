"""check: the greedy comparison and the sampled law of `quickdraft check` on one loaded target (the package doc
says what each tests)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from quickdraft.errors import QuickdraftError
from quickdraft.tools.check.greedy import _greedy, _near_tie_rule
from quickdraft.tools.check.law import _PrefixTree
from quickdraft.tools.check.report import CheckReport
from quickdraft.tools.check.samples import _sample_rejection, _sample_seeded
from quickdraft.tools.check.stats import _test, _views
from quickdraft.tools.prompts import PromptInput, prompt_token_ids

if TYPE_CHECKING:
    from quickdraft.api import LLM
    from quickdraft.params import SamplingParams

DEFAULT_MAX_TOKENS = 64  # greedy comparison length
DEFAULT_SAMPLE_TOKENS = 4
DEFAULT_SAMPLES = 2000
DEFAULT_ALPHA = 1e-3
DEFAULT_CHECK_SEED = 0
DEFAULT_MAX_FORWARDS = 4000
DEFAULT_STAT_PROMPTS = 8
DEFAULT_TEMPERATURE = 0.7

MIN_MULTI_TOKEN_ACCEPTS = 20  # fewer accepted drafts past a step's first: a note that the test saw little of them


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

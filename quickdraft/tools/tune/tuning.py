"""tune and sweep: the measuring procedures of `quickdraft tune` (the package doc says what they measure)."""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from quickdraft.drafts import SpeculativeConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.sequence import RequestMetrics
from quickdraft.speedup_model import fit_forward_costs
from quickdraft.tools.tune.candidates import Candidate, _config_label
from quickdraft.tools.tune.defaults import DEFAULT_DRAFTS, DEFAULT_K_MAX
from quickdraft.tools.tune.divergence import measure_divergence
from quickdraft.tools.tune.measure import ForwardTimes, Progress, _Session, generate_once, run_rotation
from quickdraft.tools.tune.prediction import AcceptanceProfile, best_prediction, predict
from quickdraft.tools.tune.report import DraftResult, SweepReport, SweepRow, TuneReport, _measurement, _num

DIVERGENCE_POSITIONS = 256  # target/draft positions compared for KL and TV: a few hundred suffice
COST_REPEATS = 7


def _draft_runners(session: _Session) -> dict[str, Any]:
    """By candidate label, the model each model draft runs on token ids (its draft_runner), whose one-token forward
    tune times and whose distributions it compares with the target's; not for lookups, nor for a model draft that
    reads something else (an EAGLE head reads the target's features)."""
    runners = {c.label: session.draft_llms[c.label].proposer.draft_runner for c in session.candidates if c.is_model}
    return {label: runner for label, runner in runners.items() if runner is not None}


def _draft_costs(session: _Session, candidate: Candidate, profile: AcceptanceProfile,
                 forward_times: ForwardTimes) -> tuple[float, float]:
    """(draft seconds per step, draft seconds per draft token): a lookup's measured propose time per step of
    its run; a model draft's one-token forward at the target's timing context, or, for a model draft with no
    token-id runner to time (eagle), its run's measured draft time per draft token."""
    if candidate.label in forward_times.runners:
        return 0.0, forward_times.medians(candidate.label)[1]
    pooled = RequestMetrics.combine(session.acceptance_runs[candidate.label].metrics)
    if candidate.is_model:
        return 0.0, pooled.draft_time_s / max(1, pooled.proposed_tokens)
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
    draft_runners = _draft_runners(session)
    timed = {"target": (llm.target, list(range(1, k_max + 2)))}
    timed.update({label: (runner, [1]) for label, runner in draft_runners.items()})
    forward_times = ForwardTimes(timed, context_ids)
    forward_times.sample(COST_REPEATS)

    engines = {c.label: session.engine(c, k_max, adaptive=False) for c in session.candidates}
    session.acceptance_runs = run_rotation(engines, session.prompt_ids, params, progress,
                                           f"acceptance at K={k_max}", forward_times.sample)
    forward_s = forward_times.medians("target")
    forward_fit_s = fit_forward_costs(forward_s)

    continuations = _continuations(session) if draft_runners else []
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
        # next token at the same positions, so KL and TV are left out (n/a) for it, and for a draft without a
        # token-id runner (eagle).
        if candidate.label in draft_runners and proposer.draft_reads_target_tokens:
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

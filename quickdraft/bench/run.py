"""The orchestration of one benchmark run (`quickdraft bench`; the command line is in bench/cli.py).

One target model is loaded and shared by every method. Each method generates one short warm-up, then the
methods take turns prompt by prompt (A B C A B C ...) so that slow drift of the machine affects them alike.
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from quickdraft import kernels
from quickdraft.bench import dataset, greedy, methods
from quickdraft.bench.dataset import DEFAULT_DATASET
from quickdraft.bench.names import DEFAULT_METHODS
from quickdraft.bench.costs import measure_read_bandwidth, measure_target_forward, runner_costs
from quickdraft.bench.report import PromptResult, Turn, build_report, render, write_json, write_plots
from quickdraft.cli_args import tree_setting
from quickdraft.drafts.base import TreeSettings
from quickdraft.errors import QuickdraftError
from quickdraft.models import loader
from quickdraft.models.base import Runner

TIMING_NOTE = ("seconds per generation around the call, prefill included; quickdraft's engine is driven directly "
               "(no per-step detokenization), as transformers' generate and llama.cpp's generate are")


@dataclass
class BenchConfig:
    dataset: str = str(DEFAULT_DATASET)  # the package's own prompt set (bench/data/)
    model: str = loader.DEFAULT_MODEL
    methods: str = DEFAULT_METHODS
    k: str = "5"
    max_new_tokens: int = 256
    limit_per_category: int | None = None
    categories: str | None = None
    shuffle: int | None = None  # run the records in a random order of this seed across categories (dataset.select)
    temperature: float = 0.0
    out: str | None = None
    plots: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    seed: int = 0
    adaptive: bool = True
    runner: str = "auto"
    warmup_tokens: int = 8
    cost_context: int = 200  # cache length at which the target forward is timed
    cost_repeats: int = 7
    batch_sizes: str | None = None  # a comma list: run the batch sweep (bench/batch.py) instead
    tree: str | None = None  # --tree N,D | auto: token trees for the methods that propose them


def _split(text: str | None) -> list[str] | None:
    return [part.strip() for part in text.split(",") if part.strip()] if text else None


def _validate(cfg: BenchConfig):
    TreeSettings.from_config(tree_setting(cfg.tree))  # a malformed --tree before anything loads
    records = dataset.select(dataset.load_records(cfg.dataset), _split(cfg.categories), cfg.limit_per_category,
                             shuffle=cfg.shuffle)
    specs = methods.parse_methods(cfg.methods)
    ks = methods.parse_k_list(cfg.k)
    if not (isinstance(cfg.max_new_tokens, int) and cfg.max_new_tokens >= 1):
        raise QuickdraftError(f"--max-new-tokens must be an integer >= 1, got {cfg.max_new_tokens!r}")
    if cfg.temperature < 0:
        raise QuickdraftError(f"--temperature must be >= 0 (0 means greedy), got {cfg.temperature}")
    if cfg.threads is not None and cfg.threads < 1:
        raise QuickdraftError(f"--threads must be >= 1, got {cfg.threads}")
    if cfg.batch_sizes is not None:
        if len(ks) > 1:
            raise QuickdraftError("--batch-sizes takes one --k (a K sweep and a batch sweep are separate runs)")
        unsupported = [s.name for s in specs if not s.is_quickdraft and s.name != "hf"]
        if unsupported:
            raise QuickdraftError(f"--batch-sizes runs quickdraft methods and hf; drop {', '.join(unsupported)}")
    return records, specs, ks


def parse_batch_sizes(text: str) -> list[int]:
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise QuickdraftError(f"--batch-sizes {text!r}: expected a comma list of positive integers, e.g. 1,4,16,64")
    return sorted({int(p) for p in parts})


def _load_target(cfg: BenchConfig, model, tokenizer):
    """The shared target and the reference LLM (method none) built on it."""
    from quickdraft import LLM

    llm = LLM(model if model is not None else cfg.model, tokenizer=tokenizer, speculative_config={"method": "none"},
              dtype=cfg.dtype if model is None else next(model.parameters()).dtype,
              device=cfg.device if model is None else next(model.parameters()).device, runner=cfg.runner)
    target = methods.Target(llm.target, llm.tokenizer, llm.model_name, llm.source, set(llm.engine.eos_token_ids))
    return target, llm


def _conversation(runner, record, prompts: dataset.PromptFormat, cfg: BenchConfig, seed: int) -> PromptResult:
    """All turns of a record; each later turn follows this method's own earlier answers."""
    result = PromptResult(record)
    answers: list[str] = []
    for i in range(len(record.turns)):
        prompt_ids = prompts.prompt_ids(record.turns, answers)
        generation = runner.generate(prompt_ids, cfg.max_new_tokens, cfg.temperature, seed + i)
        result.turns.append(Turn(prompt_ids, generation))
        answers.append(prompts.decode(generation.token_ids))
    return result


def _progress(console, enabled: bool):
    """A bar whose count names what it counts (each task's `unit` field: "runs (13 prompts x 4 methods)")."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=console, disable=not enabled, transient=False)


def _runs_unit(count: int, runners, per: str) -> str:
    """What a bar of len(runners) x count steps counts: "runs (13 prompts x 4 methods)", or "method/K pairs"
    where a K sweep runs a method at several K."""
    pairs = len({r.spec for r in runners}) != len(runners)
    return f"runs ({count} {per} x {len(runners)} {'method/K pairs' if pairs else 'methods'})"


def run_bench(cfg: BenchConfig, *, model=None, tokenizer=None, console=None, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark and return the report (also written to cfg.out / cfg.plots when set).

    model / tokenizer: an already-built transformers model (and its tokenizer) to use instead of loading
    cfg.model; llama.cpp methods then cannot run, having no GGUF file."""
    from rich.console import Console


    # Piped output gets wide tables rather than rich's 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 180)
    status = Console(stderr=True, quiet=console.quiet)
    started, start = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
    records, specs, ks = _validate(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    loader.quiet_transformers()

    status.print(f"loading {cfg.model if model is None else type(model).__name__} ...")
    target, reference = _load_target(cfg, model, tokenizer)
    prompts = dataset.PromptFormat(reference)
    runners = methods.build_runners(specs, ks, target, reference, cfg.adaptive, tree_setting(cfg.tree))
    if not prompts.chat:
        status.print(f"[yellow]{target.name} has no chat template: the prompts are the raw turn text[/yellow]")

    first_prompt = prompts.prompt_ids(records[0].turns, [])
    for runner in runners:  # warm-up: one short generation each
        runner.generate(first_prompt, cfg.warmup_tokens, cfg.temperature, cfg.seed)

    sizes = list(range(1, max(ks) + 2))
    context = max(1, min(cfg.cost_context, reference.target.max_len - max(sizes) - 1))
    context_ids = [first_prompt[i % len(first_prompt)] for i in range(context)]
    forward_s = measure_target_forward(reference.target, context_ids, sizes, cfg.cost_repeats)
    bandwidth = measure_read_bandwidth(target.device)
    runner_table = runner_costs(_cost_runners(reference, runners), context_ids, max(ks), bandwidth, cfg.cost_repeats)
    if cfg.batch_sizes is not None:
        return _run_batch_sweep(cfg, records, prompts, runners, target, forward_s, bandwidth, runner_table, console,
                                status, progress, started, start)

    results: dict[str, list[PromptResult]] = {r.label: [] for r in runners}
    with _progress(status, progress) as bar:
        task = bar.add_task("benchmark", total=len(records) * len(runners),
                            unit=_runs_unit(len(records), runners, "prompts"))
        for index, record in enumerate(records):
            for runner in runners:
                bar.update(task, description=f"prompt {index + 1}/{len(records)} ({record.category} "
                                             f"#{record.question_id}): {runner.label}")
                results[runner.label].append(_conversation(runner, record, prompts, cfg, cfg.seed + 1000 * index))
                bar.advance(task)

    if cfg.temperature == 0:
        _greedy_check(runners, results, target)

    config = {
        "dataset": str(cfg.dataset), "model": target.name, "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device), "threads": torch.get_num_threads(), **_machine(target.runner),
        "methods": [s.name for s in specs], "k": ks, "k_sweep": len(ks) > 1,
        "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
        "categories": dataset.categories_of(records), "limit_per_category": cfg.limit_per_category,
        "shuffle": cfg.shuffle,
        "n_prompts": len(records), "n_turns": sum(len(r.turns) for r in records),
        "prompt_format": prompts.description,
        "order": "interleaved: for each prompt every method in turn, after one warm-up generation each",
        "adaptive_k": cfg.adaptive and len(ks) == 1, "runner": type(reference.target).__name__,
        "tree": cfg.tree, "timing": TIMING_NOTE, "greedy_reference": "none",
        "versions": _versions(), "started_at": started, "options": asdict(cfg),
    }
    report = build_report(config, runners, results, config["categories"], forward_s, context, cfg.cost_repeats)
    report["costs"]["memory_read_GBps"] = bandwidth / 1e9
    report["costs"]["runners"] = runner_table
    report["config"]["elapsed_s"] = time.perf_counter() - start
    if cfg.out:
        write_json(report, cfg.out)
    if cfg.plots:
        report["config"]["plots"] = write_plots(report, cfg.plots)
        if cfg.out:
            write_json(report, cfg.out)
    render(report, console)
    if cfg.out:
        console.print(f"results: {cfg.out}")
    if cfg.plots:
        console.print(f"plots: {', '.join(report['config']['plots'])}")
    return report


def _run_batch_sweep(cfg, records, prompts, runners, target, forward_s, bandwidth, runner_table, console, status,
                     progress, started, start) -> dict[str, Any]:
    import copy

    from quickdraft.bench.batch import plot_batch_sweep, render_batch_sweep, run_batch_sweep

    sizes = parse_batch_sizes(cfg.batch_sizes)
    llms = {}
    for runner in runners:
        if runner.spec.is_quickdraft:
            llm = copy.copy(runner.llm)
            llm.engine = runner.engine  # the runner's K and adaptivity
            llms[runner.label] = llm
    with_hf = any(r.spec.name == "hf" for r in runners)
    first_turns = [prompts.prompt_ids(record.turns[:1], []) for record in records]
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else None
    pad = pad if pad is not None else min(target.eos_token_ids, default=0)
    with _progress(status, progress) as bar:
        task = bar.add_task("batch sweep", total=len(sizes) * (len(llms) + with_hf),
                            unit=f"rounds ({len(sizes)} batch sizes x {len(llms) + with_hf} methods)")
        sweep = run_batch_sweep(llms, first_turns, sizes, cfg.max_new_tokens, cfg.temperature, cfg.seed,
                                hf_model=target.model if with_hf else None, pad_id=pad, eos=target.eos_token_ids,
                                on_round=lambda label, b: bar.update(task, advance=1, description=f"{label} B={b}"))
    report = {"config": {"dataset": str(cfg.dataset), "model": target.name,
                         "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
                         "threads": torch.get_num_threads(), **_machine(target.runner),
                         "methods": [r.label for r in runners],
                         "versions": _versions(), "started_at": started, "options": asdict(cfg)},
              "costs": {"forward_s": {str(n): s for n, s in forward_s.items()}, "memory_read_GBps": bandwidth / 1e9,
                        "runners": runner_table},
              "batch_sweep": sweep}
    report["config"]["elapsed_s"] = time.perf_counter() - start
    render_batch_sweep(sweep, console)
    if cfg.plots:
        from pathlib import Path

        Path(cfg.plots).mkdir(parents=True, exist_ok=True)
        path = str(Path(cfg.plots) / "batch_speedup_vs_none.png")
        plot_batch_sweep(sweep, path)
        report["config"]["plots"] = [path]
        console.print(f"plots: {path}")
    if cfg.out:
        write_json(report, cfg.out)
        console.print(f"results: {cfg.out}")
    return report


def _cost_runners(reference, runners) -> dict:
    """The runners whose forward the bench times against the bandwidth floor: the target's (and the
    transformers forward of the same model, for comparison) and each quickdraft draft model's."""
    from quickdraft.models.hf import HFRunner

    out = {f"target ({type(reference.target).__name__})": reference.target}
    # (The transformers forward of a target kept quantized would need a second, dequantized copy: not timed.)
    if reference.target.kind != "hf" and reference.target.quantized_weights is None:
        out["target (HFRunner)"] = HFRunner(reference.target.model)
    for runner in runners:
        proposer = runner.proposer
        # The draft runners that read token ids (an EAGLE head reads fused features, and is timed in its steps).
        draft = proposer.draft_runner if proposer is not None else None
        if draft is not None:
            out[f"{runner.spec.name} draft ({draft.name})"] = draft
    return out


def _greedy_check(runners, results, target) -> None:
    reference = results["none"]
    for runner in runners:
        if runner.label == "none":
            continue
        note = None
        if runner.spec.kind.startswith("llamacpp"):
            note = "llama.cpp runs the GGUF's quantized weights, not the dequantized float model: its tokens need not match"
        elif runner.spec.kind.startswith("hf") and target.dtype != torch.float32:
            note = (f"transformers' {str(target.dtype).removeprefix('torch.')} forward rounds differently from "
                    "quickdraft's runner: its tokens need not match")
        for mine, ref in zip(results[runner.label], reference):
            mine.divergence = greedy.check(target.runner, [(t.prompt_ids, t.generation.token_ids) for t in mine.turns],
                                           [(t.prompt_ids, t.generation.token_ids) for t in ref.turns], note)


def _machine(target: Runner) -> dict[str, Any]:
    """Which machine and kernels a report's figures came from: the CPU and its kernel flags, and the activation
    scheme the target's GGUF blocks ran (None without blocks)."""
    return {"cpu": kernels.cpu_description(), "quant_kernel": target.quant_kernel_in_use}


def _versions() -> dict[str, str]:
    import transformers

    import quickdraft

    out = {"quickdraft": quickdraft.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    if methods.llama_cpp_available():
        import llama_cpp

        out["llama_cpp"] = getattr(llama_cpp, "__version__", "?")
    return out

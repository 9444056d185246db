"""The host time of a step by batch size and method: what the engine does around its forwards, in Python.

    .venv/bin/python benchmarks/host_time.py [--model smollm2-135m] [--dataset PATH] [--batch-sizes 1,4,16,64]
        [--methods none,ngram] [--k 5] [--tokens 64] [--min-requests 8] [--trees DIR,DIR] [--rounds 1]
        [--profile FILE --profile-batch 16 --profile-method none]

Prompts: the Spec-Bench records of the chat categories (MT-bench's: writing, roleplay, reasoning, math, coding,
extraction, stem, humanities; `--categories` names others), each record's first turn through the model's chat
template, cycled to fill the batch. Each request asks for --tokens greedy tokens (EOS ignored, so every request
runs the same number of steps and the batch stays full until the end).

For each method and batch size B, max(B, --min-requests) requests go through one continuous-batching scheduler
(`LLM.new_scheduler(max_num_seqs=B)`), stepped until done. Every runner's forward calls (the target's, a draft
model's) are timed by wrapping them on the runner instances, so the script runs against any tree of the project
that has `LLM.new_scheduler` and `Runner.forward_batch`. A step's host time is its wall time (`Scheduler.step`:
scheduling, proposals, the step batch, logit processing, verification, commit, detokenization) minus its forwards'
time; the figures are medians over the decode steps (no prompt in the target's forward) that ran a full batch
of B. Also printed: the host CPU time a step (the same difference on this thread's CPU clock: on a shared machine
it leaves out the time the thread waited for a core, which the wall clock counts), the forwards' median time a
step and tokens/s (every generated token over the wall time of the method's run at B, prompts included).

--trees A,B runs this script once per tree per round, each in its own process with PYTHONPATH=tree (the same
script, so the same measurement), alternating the trees round by round so that a ratio compares runs close in
time, and prints each tree's figures and B's ratio against A. --profile writes a cProfile of one (method, batch)
run (default none at 16) and prints its top functions by their own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHAT_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
DEFAULT_DATASET = Path(__file__).resolve().parent.parent.parent / "shared" / "bench" / "spec_bench_dev.jsonl"


def _prompts(llm, dataset: Path, categories: list[str]) -> list[list[int]]:
    prompts = []
    with open(dataset, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if record["category"] in categories:
                    prompts.append(llm.chat_prompt([{"role": "user", "content": record["turns"][0]}])["prompt_token_ids"])
    if not prompts:
        raise SystemExit(f"{dataset} has no records of the categories {', '.join(categories)}")
    return prompts


class ForwardClock:
    """Wraps the forward calls of runner instances, adding up the seconds they take (an inner call made by an
    outer one is not counted twice) and noting whether the target's last batched forward read a prompt."""

    def __init__(self, target, others):
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # this thread's CPU time inside the forwards
        self.prompt_rows = False  # a feed longer than its logits: a prompt was read
        self.batch = 0
        self._depth = 0
        for runner in [target, *others]:
            for name in ("forward_batch", "forward"):
                if hasattr(runner, name):
                    setattr(runner, name, self._timed(getattr(runner, name), runner is target and name == "forward_batch"))

    def _timed(self, call, is_target_batch: bool):
        def timed(*args, **kwargs):
            if is_target_batch:
                feeds = args[1] if len(args) > 1 else kwargs["tokens"]
                num_logits = args[2] if len(args) > 2 else kwargs["num_logits"]
                self.prompt_rows |= any(int(f.numel()) > n for f, n in zip(feeds, num_logits))
                self.batch = max(self.batch, len(feeds))
            self._depth += 1
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start
                    self.cpu_seconds += time.thread_time() - cpu
        return timed

    def reset(self) -> None:
        self.seconds, self.cpu_seconds, self.prompt_rows, self.batch = 0.0, 0.0, False, 0


def _run(llm, clock: ForwardClock, prompts: list[list[int]], batch: int, requests: int, tokens: int) -> dict:
    from quickdraft import SamplingParams

    if hasattr(llm, "kv_memory"):
        llm.kv_memory.clear_prefix_caches()
    scheduler = llm.new_scheduler(max_num_seqs=batch)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(requests):
        scheduler.add_request(str(i), prompts[i % len(prompts)], params)
    host, host_cpu, forwards, generated = [], [], [], 0
    start = time.perf_counter()
    while scheduler.has_unfinished():
        clock.reset()
        t0, cpu = time.perf_counter(), time.thread_time()
        updates = scheduler.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu
        generated += sum(len(u.new_token_ids) for u in updates)
        if not clock.prompt_rows and clock.batch == batch:
            host.append(wall - clock.seconds)
            host_cpu.append(cpu - clock.cpu_seconds)
            forwards.append(clock.seconds)
    seconds = time.perf_counter() - start
    return {"host_ms": 1e3 * statistics.median(host) if host else None,
            "host_cpu_ms": 1e3 * statistics.median(host_cpu) if host_cpu else None,
            "forward_ms": 1e3 * statistics.median(forwards) if forwards else None,
            "decode_steps": len(host), "steps_s": sum(host) + sum(forwards), "seconds": seconds, "tokens": generated,
            "tokens_per_s": generated / seconds}


def _config(method: str, k: int) -> dict:
    try:
        from quickdraft.drafts import parse_draft
    except ImportError:  # an older tree: a method by its name
        return {"method": method, "num_speculative_tokens": k}
    return parse_draft(method, k)


def _child(args) -> list[dict]:
    from quickdraft.api import LLM
    from quickdraft.models.loader import quiet_transformers

    quiet_transformers()
    llm = LLM(args.model)
    gc.collect()
    gc.freeze()  # as a server does after loading (the same in every tree)
    prompts = _prompts(llm, Path(args.dataset), args.categories.split(","))
    llms = {method: llm if method == "none" else llm.with_speculative_config(_config(method, args.k))
            for method in args.methods.split(",")}
    draft_runners = [r for r in (getattr(m.proposer, "draft_runner", None) for m in llms.values()) if r is not None]
    clock = ForwardClock(llm.target, draft_runners)
    _run(llm, clock, prompts, 1, 1, 8)  # warm up: the first forwards allocate
    results = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for method, m in llms.items():
            row = _run(m, clock, prompts, batch, max(batch, args.min_requests), args.tokens)
            results.append({"method": method, "batch": batch, **row})
    if args.profile:
        m = llms[args.profile_method]
        profiler = cProfile.Profile()
        profiler.enable()
        _run(m, clock, prompts, args.profile_batch, max(args.profile_batch, args.min_requests), args.tokens)
        profiler.disable()
        profiler.dump_stats(args.profile)
        stats = pstats.Stats(args.profile, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
    return results


def _table(results: list[dict], title: str) -> str:
    lines = [title, f"{'method':>10} {'batch':>5} {'host ms/step':>12} {'host CPU ms':>11} {'forwards ms/step':>16} "
             f"{'tok/s':>8} {'steps':>6}"]

    def ms(value):
        return "-" if value is None else f"{value:.2f}"

    for r in results:
        lines.append(f"{r['method']:>10} {r['batch']:>5} {ms(r['host_ms']):>12} {ms(r.get('host_cpu_ms')):>11} "
                     f"{ms(r['forward_ms']):>16} {r['tokens_per_s']:>8.1f} {r['decode_steps']:>6}")
    return "\n".join(lines)


def _median_of(runs: list[list[dict]], key: str) -> list[dict]:
    """Per (method, batch), the median of each figure over the rounds."""
    out = []
    for rows in zip(*runs):
        row = dict(rows[0])
        for name in ("host_ms", "host_cpu_ms", "forward_ms", "tokens_per_s"):
            values = [r[name] for r in rows if r[name] is not None]
            row[name] = statistics.median(values) if values else None
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default=str(DEFAULT_DATASET))
    p.add_argument("--categories", default=",".join(CHAT_CATEGORIES))
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--methods", default="none,ngram", help="none and --draft spellings (ngram, suffix, eagle, ...)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=8, help="requests at least (batch 1 runs them one by one)")
    p.add_argument("--trees", default=None, help="comma-separated source trees to compare, one process each")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--profile", default=None, help="write a cProfile of one run here")
    p.add_argument("--profile-batch", type=int, default=16)
    p.add_argument("--profile-method", default="none")
    p.add_argument("--json", default=None, help="write every round's results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not Path(args.dataset).is_file():
        raise SystemExit(f"dataset {args.dataset} not found; pass --dataset PATH (a Spec-Bench JSONL file)")
    if args.child:
        print(json.dumps(_child(args)))
        return
    trees = args.trees.split(",") if args.trees else [None]
    forwarded = [a for a in sys.argv[1:] if a != "--child"]
    rounds: dict[str | None, list[list[dict]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            if tree is None and args.rounds == 1:
                rounds[tree].append(_child(args))
                continue
            env = dict(os.environ)
            if tree is not None:
                env["PYTHONPATH"] = tree
            out = subprocess.run([sys.executable, __file__, "--child", *forwarded], env=env, check=True,
                                 stdout=subprocess.PIPE, text=True).stdout
            rounds[tree].append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps({str(t): r for t, r in rounds.items()}, indent=1))
    medians = {tree: _median_of(runs, "host_ms") for tree, runs in rounds.items()}
    for tree, rows in medians.items():
        print(_table(rows, f"\n{tree or 'this tree'} ({args.model}, {args.tokens} greedy tokens, median of "
                           f"{args.rounds} round(s))"))
    if len(trees) > 1:
        base, other = medians[trees[0]], medians[trees[-1]]
        print(f"\n{trees[-1]} against {trees[0]}")
        print(f"{'method':>10} {'batch':>5} {'host time':>10} {'host CPU':>9} {'tok/s':>8}")
        for a, b in zip(base, other):
            ratios = [f"{b[name] / a[name]:.2f}x" if a.get(name) and b.get(name) else "-"
                      for name in ("host_ms", "host_cpu_ms")]
            print(f"{a['method']:>10} {a['batch']:>5} {ratios[0]:>10} {ratios[1]:>9} "
                  f"{b['tokens_per_s'] / a['tokens_per_s']:>7.2f}x")


if __name__ == "__main__":
    main()

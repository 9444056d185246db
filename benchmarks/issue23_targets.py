"""Issue 23's targets in one run: every figure taken round by round, interleaved, each round with its own memory-read
probes, so that a ratio compares what ran within seconds of each other on this noisy machine.

    .venv/bin/python benchmarks/issue23_targets.py [--rounds 5] [--threads 2] [--tokens 128] [--llamacpp DIR]
        [--no-llamacpp]

Each round measures, in this order:
- the memory read rate (`measure_read_bandwidth`, 512 MiB) before and after the 1.5B's forwards; the round's floor
  is the 1.5B's stored bytes at their mean;
- Qwen2.5-Coder-1.5B (its own quantized kernel): a one-row forward and an 8-row forward (verification of 7 drafts
  and a bonus), after 256 cached positions, the median of 3 calls each;
- plain decoding of the 1.5B (quickdraft's engine, greedy, --tokens new tokens after a chat prompt, its decode rate
  after the first token) and llama.cpp's `llama-bench -p 0 -n TOKENS` on the same GGUF file, same threads;
- SmolLM2-135M and Gemma 3 270M one-row forwards on their own kernel and on the bf16 kernels (the kernels of the
  issue's "today"), and a batched SmolLM2 forward of 16 sequences (one new token each at ~200-token contexts) on both.

The ratios are medians of per-round ratios; each target's line says whether it held this run and on which CPU.
Run it with nothing else running. The Qwen aliases need the extra models-large (pyproject.toml).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from vs_llamacpp_pair import LLAMACPP, code_prompts, llama_bench

from quickdraft import LLM, SamplingParams, kernels
from quickdraft.bench.costs import measure_read_bandwidth
from quickdraft.models.loader import quiet_transformers, resolve

CONTEXT = 256
BATCH = 16


def median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Forwards:
    """n-row forwards of one runner after CONTEXT cached positions, rolled back after each call."""

    def __init__(self, runner):
        self.runner = runner
        self.ids = torch.randint(0, 1000, (CONTEXT + 8,), generator=torch.Generator().manual_seed(0))
        self.cache = runner.new_cache()
        runner.forward(self.cache, self.ids[:CONTEXT])

    def __call__(self, rows: int) -> None:
        self.runner.forward(self.cache, self.ids[CONTEXT: CONTEXT + rows], rows)
        self.cache.rollback(CONTEXT)


class BatchedStep:
    """One forward_batch over BATCH sequences at ~200-token contexts, one new token each (benchmarks/batch_forward)."""

    def __init__(self, runner):
        self.runner = runner
        generator = torch.Generator().manual_seed(0)
        self.caches = []
        for i in range(BATCH):
            cache = runner.new_cache()
            runner.forward(cache, torch.randint(0, 10_000, (192 + i % 16,), generator=generator), 1)
            self.caches.append(cache)
        self.feeds = [torch.randint(0, 10_000, (1,), generator=generator) for _ in range(BATCH)]
        self.lengths = [len(cache) for cache in self.caches]

    def __call__(self) -> None:
        self.runner.forward_batch(self.caches, self.feeds, [1] * BATCH)
        for cache, length in zip(self.caches, self.lengths):
            cache.rollback(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens of plain decoding (llama-bench -n)")
    parser.add_argument("--llamacpp", type=Path, default=LLAMACPP, help="llama.cpp's build/bin")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip the llama-bench comparison")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    module = kernels.cpu_linear()
    if module is None:
        raise SystemExit("needs quickdraft's AVX-512 CPU kernels (AVX512-BF16); this CPU or build has none")
    use_llamacpp = not args.no_llamacpp
    if use_llamacpp and not (args.llamacpp / "llama-bench").exists():
        raise SystemExit(f"no llama-bench in {args.llamacpp}: build llama.cpp (README, 'Against llama.cpp') or pass "
                         "--no-llamacpp")

    qwen = LLM("qwen2.5-coder-1.5b", speculative_config={"method": "none"})
    qwen_file = resolve("qwen2.5-coder-1.5b").gguf_path
    small = {name: LLM(name, speculative_config={"method": "none"}).target for name in ("smollm2-135m", "gemma3-270m")}
    qwen_forwards = Forwards(qwen.target)
    small_forwards = {name: Forwards(runner) for name, runner in small.items()}
    batched = BatchedStep(small["smollm2-135m"])
    chat = qwen.tokenizer.apply_chat_template([{"role": "user", "content": code_prompts(1)[0]}],
                                              add_generation_prompt=True, tokenize=False)
    prompt_ids = qwen.tokenizer(chat, add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def plain_rate() -> float:
        metrics = qwen.generate([{"prompt_token_ids": prompt_ids}], greedy)[0].metrics
        return (args.tokens - 1) / (metrics.wall_time_s - metrics.first_token_time_s)

    def with_kernel(name: str, call):
        before = module.set_quant_kernel(name)
        try:
            return call()
        finally:
            module.set_quant_kernel(before)

    rounds: list[dict[str, float]] = []
    for round_ in range(args.rounds + 1):  # round 0 warms everything up and is not counted
        r: dict[str, float] = {}
        read_before = measure_read_bandwidth(torch.device("cpu"), 1 << 29, 3)
        r["one"] = median_seconds(lambda: qwen_forwards(1), 3)
        r["eight"] = median_seconds(lambda: qwen_forwards(8), 3)
        r["read"] = (read_before + measure_read_bandwidth(torch.device("cpu"), 1 << 29, 3)) / 2
        r["floor"] = qwen.target.weight_bytes / r["read"]
        r["plain"] = plain_rate()
        if use_llamacpp:
            r["llamacpp"] = llama_bench(args.llamacpp, qwen_file, args.threads, args.tokens)
        for name, forwards in small_forwards.items():
            r[f"{name} own"] = median_seconds(lambda f=forwards: f(1), 5)
            r[f"{name} bf16"] = with_kernel("bf16", lambda f=forwards: median_seconds(lambda: f(1), 5))
        r["batch own"] = median_seconds(batched, 3)
        r["batch bf16"] = with_kernel("bf16", lambda: median_seconds(batched, 3))
        if round_:
            rounds.append(r)
            print(f"  round {round_}: read {r['read'] / 1e9:.1f} GB/s, 1.5B 1 row {r['one'] * 1e3:.1f} ms "
                  f"({r['one'] / r['floor']:.2f}x floor), 8 rows {r['eight'] * 1e3:.1f} ({r['eight'] / r['one']:.2f}x), "
                  f"plain {r['plain']:.1f} tok/s" + (f", llama-bench {r['llamacpp']:.1f}" if use_llamacpp else ""),
                  flush=True)

    def ratio(a: str, b: str) -> float:
        return statistics.median(r[a] / r[b] for r in rounds)

    def ms(key: str) -> str:
        return f"{statistics.median(r[key] for r in rounds) * 1e3:.2f} ms"

    reads = [r["read"] / 1e9 for r in rounds]
    print(f"\n{kernels.cpu_description()}; {args.threads} threads; {args.rounds} rounds; memory read "
          f"{min(reads):.1f}-{max(reads):.1f} GB/s; 1.5B kernel {qwen.target.quant_kernel_in_use}, "
          f"{qwen.target.weight_bytes / 1e6:.0f} MB streamed a step")
    targets = [
        ("1.5B one token / floor", ratio("one", "floor"), "<=", 1.25,
         f"{ms('one')} against a {ms('floor')} floor"),
        ("1.5B 8 tokens / one", ratio("eight", "one"), "<=", 1.3, f"{ms('eight')} against {ms('one')}"),
    ]
    if use_llamacpp:
        targets.append(("1.5B plain / llama-bench tg", ratio("plain", "llamacpp"), ">=", 1.1,
                        f"{statistics.median(r['plain'] for r in rounds):.1f} against "
                        f"{statistics.median(r['llamacpp'] for r in rounds):.1f} tok/s"))
    for name in small:
        targets.append((f"{name} one token / bf16 kernels", ratio(f"{name} own", f"{name} bf16"), "<=", 1.0,
                        f"{ms(name + ' own')} against {ms(name + ' bf16')}"))
    targets.append((f"SmolLM2 {BATCH} sequences / bf16 kernels", ratio("batch own", "batch bf16"), "<", 1.0,
                    f"{ms('batch own')} against {ms('batch bf16')}"))
    print("| target | this run | goal | held | medians |")
    print("|---|---|---|---|---|")
    for label, value, sense, goal, detail in targets:
        held = value <= goal if sense == "<=" else value >= goal if sense == ">=" else value < goal
        print(f"| {label} | {value:.2f}x | {sense} {goal}x | {'yes' if held else 'NO'} | {detail} |")


if __name__ == "__main__":
    main()

"""Plain decoding against llama.cpp on the same GGUF file: prefill and decode timed apart, interleaved.

    .venv/bin/python benchmarks/vs_llamacpp.py [MODEL] [--prompts 12] [--max-new-tokens 128] [--threads 2]
        [--dtypes auto,bfloat16]

For each Spec-Bench dev prompt (one per category in turn; chat template where the model has one) and each
engine in turn: quickdraft's plain decoding (`LLM.generate`, method none, greedy, ignore_eos) at each dtype,
and llama-cpp-python's `Llama.generate` (greedy) with the same thread count. The time to the first token
(prefill) and the decode rate after it are taken per prompt; medians and the ratio of medians are printed.
Needs llama-cpp-python (`pip install llama-cpp-python`). Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DATASET = Path(__file__).resolve().parents[2] / "shared" / "bench" / "spec_bench_dev.jsonl"


def prompts(tokenizer, count: int) -> list[list[int]]:
    records = [json.loads(line) for line in DATASET.read_text().splitlines() if line.strip()]
    by_category: dict[str, list] = {}
    for record in records:
        by_category.setdefault(record["category"], []).append(record)
    picked = []
    while len(picked) < count and any(by_category.values()):
        for items in by_category.values():
            if items and len(picked) < count:
                picked.append(items.pop(0)["turns"][0])
    out = []
    for text in picked:
        if getattr(tokenizer, "chat_template", None):
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
            ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        out.append([int(i) for i in ids][:1500])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="auto,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llama_cpp import Llama

    from quickdraft import LLM, SamplingParams
    from quickdraft.bench.costs import measure_read_bandwidth
    from quickdraft.models.loader import resolve

    llms = {dtype: LLM(args.model, speculative_config={"method": "none"}, dtype=dtype)
            for dtype in args.dtypes.split(",")}
    tokenizer = next(iter(llms.values())).tokenizer
    gguf = resolve(args.model).gguf_path
    llama = Llama(model_path=str(gguf), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads,
                  verbose=False)
    ids_list = prompts(tokenizer, args.prompts)
    n = args.max_new_tokens
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def run_quickdraft(llm, ids):
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        m = out.metrics
        return m.first_token_time_s, (n - 1) / (m.wall_time_s - m.first_token_time_s), out.outputs[0].token_ids

    def run_llama(ids):
        llama.reset()
        tokens, start, first = [], time.perf_counter(), None
        for token in llama.generate(ids, temp=0.0, repeat_penalty=1.0):
            if first is None:
                first = time.perf_counter() - start
            tokens.append(int(token))
            if len(tokens) >= n:
                break
        total = time.perf_counter() - start
        return first, (n - 1) / (total - first), tokens

    engines = {f"quickdraft none ({dtype})": (lambda ids, llm=llm: run_quickdraft(llm, ids)) for dtype, llm in llms.items()}
    engines["llama.cpp"] = run_llama
    for run in engines.values():  # warm-up
        run(ids_list[0][:32])
    results = {name: {"prefill_s": [], "decode_tps": [], "total_s": [], "tokens": []} for name in engines}
    for ids in ids_list:
        for name, run in engines.items():
            first, rate, tokens = run(ids)
            results[name]["prefill_s"].append(first)
            results[name]["decode_tps"].append(rate)
            results[name]["total_s"].append(first + (n - 1) / rate)
            results[name]["tokens"].append(tokens)
    bandwidth = measure_read_bandwidth(torch.device("cpu"))
    lengths = [len(ids) for ids in ids_list]
    print(f"{args.model}, {len(ids_list)} prompts ({min(lengths)}-{max(lengths)} tokens, median "
          f"{statistics.median(lengths)}), {n} new tokens, {args.threads} threads, memory read "
          f"{bandwidth / 1e9:.1f} GB/s")
    reference = results["llama.cpp"]
    for name, r in results.items():
        prefill, decode = statistics.median(r["prefill_s"]), statistics.median(r["decode_tps"])
        total = statistics.median([n / t for t in r["total_s"]])
        line = (f"  {name:28s} prefill {prefill * 1e3:7.1f} ms  decode {decode:6.1f} tok/s  "
                f"with prefill {total:6.1f} tok/s")
        if name != "llama.cpp":
            ratio_decode = statistics.median([a / b for a, b in zip(r["decode_tps"], reference["decode_tps"])])
            ratio_total = statistics.median([b / a for a, b in zip(r["total_s"], reference["total_s"])])
            same = sum(a == b for a, b in zip(r["tokens"], reference["tokens"]))
            line += (f"  | vs llama.cpp: decode {ratio_decode:.2f}x, with prefill {ratio_total:.2f}x; "
                     f"{same}/{len(ids_list)} greedy outputs identical")
        print(line)


if __name__ == "__main__":
    main()

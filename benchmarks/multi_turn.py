"""Prefix caching on multi-turn chat: the second turn re-sends the first turn's prompt and answer.

    .venv/bin/python benchmarks/multi_turn.py [--model smollm2-135m] [--conversations 16] [--max-tokens 64]
        [--batch 8] [--draft none] [--rounds 3]

For each Spec-Bench multi-turn record (../shared/bench/spec_bench_dev.jsonl, category "multi-turn" or records
with two turns), turn 1 is generated once (greedy); turn 2's prompt is the chat template over [user 1,
assistant answer 1, user 2]. Turn 2 of all conversations then runs with prefix caching on (the turn-1
blocks kept) and off, alternating round by round so that drift hits both alike; printed: median wall time,
prompt tokens computed vs loaded from the cache, and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.kv import KVMemory

DATASET = Path(__file__).resolve().parents[2] / "shared" / "bench" / "spec_bench_dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default=str(DATASET))
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--draft", default="none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    records = [json.loads(line) for line in open(args.dataset)]
    records = [r for r in records if len(r["turns"]) >= 2][: args.conversations]
    config = {"method": args.draft}
    on = LLM(args.model, speculative_config=config, max_num_seqs=args.batch, enable_prefix_caching=True)
    off = on.with_speculative_config(config)  # the same weights; its own KV memory, with prefix caching off
    off.kv_memory = KVMemory(off.engine.kv_caches(), None, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    first = [[{"role": "user", "content": r["turns"][0]}] for r in records]
    answers = [o.outputs[0].text for o in off.chat(first, params)]
    second = [on.chat_prompt(m + [{"role": "assistant", "content": a}, {"role": "user", "content": r["turns"][1]}])
              for m, a, r in zip(first, answers, records)]
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in second)
    print(f"{on.model_name}: {len(records)} conversations, turn-2 prompts {prompt_tokens} tokens in all, "
          f"batch {args.batch}, draft {args.draft}, prefix caching on: {on.kv_memory.prefix_caching}")

    times: dict[str, list[float]] = {"on": [], "off": []}
    outputs: dict[str, list[list[int]]] = {}
    cached = 0
    for _ in range(args.rounds):
        for label, llm in (("on", on), ("off", off)):
            llm.kv_memory.clear_prefix_caches()
            llm.chat(first, params)  # turn 1, untimed: what a server would have run (and, on, kept)
            start = time.perf_counter()
            result = llm.generate(second, params)
            times[label].append(time.perf_counter() - start)
            outputs[label] = [o.outputs[0].token_ids for o in result]
            if label == "on":
                cached = sum(o.metrics.num_cached_tokens for o in result)
    t_on, t_off = statistics.median(times["on"]), statistics.median(times["off"])
    same = outputs["on"] == outputs["off"]
    print(f"turn 2, median of {args.rounds}: prefix caching on {t_on:.2f} s, off {t_off:.2f} s "
          f"({t_off / t_on:.2f}x); prompt tokens loaded from the cache {cached} of {prompt_tokens}; "
          f"outputs identical: {same}")


if __name__ == "__main__":
    main()

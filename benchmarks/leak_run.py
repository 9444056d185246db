"""A long continuous-batching run with random aborts, under a KV budget: does every block come back?

    .venv/bin/python benchmarks/leak_run.py [--model smollm2-135m] [--requests 1000] [--draft ngram]
        [--kv-cache-memory 64000000] [--max-num-seqs 32] [--seed 0]

Requests (Spec-Bench first turns, cut to 16-160 tokens; max_tokens 1-24; greedy or sampled, some with n = 2,
stop strings or num_speculative_tokens = 0) arrive a few per step; at random steps a random live request is
aborted. The budget is small enough to force preemption. After the run: no request left, every pool byte
held only by prefix-cache blocks, and none once those are cleared. Prints the figures; exits 1 on a leak.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams

DATASET = Path(__file__).resolve().parents[2] / "shared" / "bench" / "spec_bench_dev.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default=str(DATASET))
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--kv-cache-memory", type=int, default=64_000_000)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    llm = LLM(args.model, speculative_config={"method": args.draft}, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.max_num_seqs)
    texts = [json.loads(line)["turns"][0] for line in open(args.dataset)]
    tokenized = [llm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    scheduler = llm.new_scheduler()
    print(f"{llm.model_name}, draft {args.draft}: {scheduler.pool.total_blocks} blocks of 16 positions "
          f"({scheduler.pool.budget_bytes / 1e6:.1f} MB), max_num_seqs {args.max_num_seqs}, "
          f"prefix caching {llm.kv_memory.prefix_caching}")

    submitted = aborted = finished = steps = tokens = 0
    reasons: dict[str, int] = {}
    start = time.perf_counter()
    while submitted < args.requests or scheduler.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if submitted == args.requests:
                break
            ids = rng.choice(tokenized)[: rng.randint(16, 160)] or [1]
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.0, 0.8]), max_tokens=rng.randint(1, 24),
                n=2 if rng.random() < 0.1 else 1, stop=["\n\n"] if rng.random() < 0.2 else None,
                num_speculative_tokens=0 if rng.random() < 0.1 else None, seed=rng.randrange(1 << 30))
            scheduler.add_request(f"r{submitted}", ids, params)
            submitted += 1
        if rng.random() < 0.08 and scheduler.requests:
            if scheduler.abort_request(rng.choice(sorted(scheduler.requests))):
                aborted += 1
        for update in scheduler.step():
            tokens += len(update.new_token_ids)
            if update.finished:
                finished += 1
                reasons[update.finish_reason] = reasons.get(update.finish_reason, 0) + 1
        steps += 1
    seconds = time.perf_counter() - start

    pool, prefix_bytes = scheduler.pool, llm.kv_memory.prefix_bytes()
    held_by_requests = pool.used_bytes - prefix_bytes
    llm.kv_memory.clear_prefix_caches()
    leaked = pool.used_bytes
    print(f"{submitted} requests ({aborted} aborted, {finished} completions finished: {reasons}) in {steps} steps, "
          f"{seconds:.0f} s, {tokens} tokens; {scheduler.num_preemptions} preemptions; peak KV "
          f"{scheduler.peak_kv_bytes / 1e6:.1f} MB of {pool.budget_bytes / 1e6:.1f} MB")
    print(f"after the run: {len(scheduler.requests)} requests left, {held_by_requests} bytes held by requests, "
          f"{prefix_bytes} bytes by prefix-cache blocks; after clearing them: {leaked} bytes "
          f"({pool.used_blocks} blocks) in use, {pool.num_caches} holders")
    return 0 if (leaked == 0 and held_by_requests == 0 and not scheduler.requests) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Time one target forward over B sequences (a native runner's forward_batch): each sequence at a ~200-token context
appends 1 token (a decoding step) or 1+4 tokens (verifying 4 draft tokens, all 5 rows' logits).

    .venv/bin/python benchmarks/batch_forward.py [MODEL] [--context 200] [--rounds 7] [--threads 2]

Batch sizes and modes are interleaved round by round and medians printed, so that drift of a shared machine
hits all alike. The per-token column is the median divided by B: it falls while the weights dominate (they
are read once per step for the whole batch), until the rows' compute and attention take over.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quickdraft import LLM

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = LLM(args.model).target
    print(f"{runner.name}: {type(runner).__name__}, {runner.dtype}, {runner.num_layers} layers, "
          f"backend: {runner.backend}, {args.threads} threads")

    generator = torch.Generator().manual_seed(0)
    vocab = min(runner.vocab_size, 10_000)
    caches, feeds = [], []
    for i in range(max(BATCHES)):  # contexts of context-8 .. context+7 tokens: not all at one position
        cache = runner.new_cache()
        length = args.context - 8 + i % 16
        runner.forward(cache, torch.randint(0, vocab, (length,), generator=generator), 1)
        caches.append(cache)
        feeds.append(torch.randint(0, vocab, (5,), generator=generator))

    def step(batch: int, new: int) -> float:
        lengths = [len(cache) for cache in caches[:batch]]
        t0 = time.perf_counter()
        runner.forward_batch(caches[:batch], [ids[:new] for ids in feeds[:batch]], [new] * batch)
        elapsed = time.perf_counter() - t0
        for cache, length in zip(caches, lengths):
            cache.rollback(length)
        return elapsed

    modes = {"1 token": 1, "1+4 tokens": 5}
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for mode, new in modes.items():
            for batch in BATCHES:
                elapsed = step(batch, new)
                if round_:
                    times.setdefault((mode, batch), []).append(elapsed)

    print(f"median of {args.rounds} forward_batch calls, ~{args.context}-token contexts")
    print(f"{'B':>4} | " + " | ".join(f"{mode + ' (ms)':>16} {'per seq':>8}" for mode in modes))
    for batch in BATCHES:
        cells = []
        for mode in modes:
            ms = statistics.median(times[(mode, batch)]) * 1e3
            cells.append(f"{ms:16.1f} {ms / batch:8.2f}")
        print(f"{batch:>4} | " + " | ".join(cells))


if __name__ == "__main__":
    main()

"""One layer's attention for a batch on the CPU, at a small shape: today's per-sequence calls against the paged
pool's one call per layer (models/paged_attention.py): SDPA over gathered blocks (GQA folded into rows, or SDPA's
enable_gqa), FlexAttention eager (its dense reference) and compiled. Every method reads the same keys and values
and its outputs are checked against the per-sequence ones; medians of interleaved rounds (eager FlexAttention,
dense over the whole pool, timed once), and the step's own cost (PagedStep and its mask, once per step for every
layer).

    .venv/bin/python benchmarks/paged_attention_cpu.py [--batch 16] [--context 256] [--rows 1,5,16]
        [--heads 12] [--kv-heads 2] [--head-dim 128] [--rounds 7] [--no-compile]

The default shape is Qwen2.5-Coder-1.5B's attention (12 query heads, 2 kv heads, head_dim 128), float32, blocks
of 16. A row count r is plain decoding (1), a K = r - 1 chain, or (r > 5) a token tree of r nodes. Timings on a
shared machine are noisy; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch
import torch.nn.functional as F

from quickdraft.kv.paged import PagedKVPool
from quickdraft.models.base import TreeAttention
from quickdraft.models.paged_attention import (PagedStep, compiled_flex_attention, flex_paged_attention,
                                               paged_attention)
from quickdraft.models.tree_mask import tree_visibility


def sdpa_enable_gqa(q, key_cache, value_cache, block_tables, mask, scale):
    """The gathered-blocks call with SDPA's own GQA instead of folding groups into rows (mask [B, 1, R, L])."""
    batch, kv_heads, dim = q.shape[0], key_cache.shape[2], key_cache.shape[3]
    pages = block_tables.reshape(-1)
    keys = key_cache.flatten(1).index_select(0, pages).view(batch, -1, kv_heads, dim).transpose(1, 2)
    values = value_cache.flatten(1).index_select(0, pages).view(batch, -1, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def per_sequence(q, lines, starts, counts, trees, scale):
    """Today's batched forward on torch ops: one attention call per sequence over its own contiguous cache
    (keys/values [Hkv, end, d]), its mask built from its tree."""
    outs = []
    for i, (keys, values) in enumerate(lines):
        end = keys.shape[1]
        seen = tree_visibility(trees[i] or TreeAttention(end, ()), starts[i])
        rows = q[i, :counts[i]].transpose(0, 1)[None]  # [1, Hq, n, d]
        out = F.scaled_dot_product_attention(rows, keys[None], values[None], attn_mask=seen, scale=scale,
                                             enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return outs


def timed(fn, rounds_out: list[float]) -> object:
    start = time.perf_counter()
    result = fn()
    rounds_out.append((time.perf_counter() - start) * 1e3)
    return result


def measure(args, rows: int, gen: torch.Generator, rng: random.Random) -> None:
    """One row count: build the batch, time every method round by round, print a line."""
    bs, d, hq, hkv = 16, args.head_dim, args.heads, args.kv_heads
    scale = 1 / math.sqrt(d)
    max_len = args.context + rows + 16
    width = -(-max_len // bs)
    pool = PagedKVPool(1, hkv, d, args.batch * width + 1, bs)
    key_cache, value_cache = pool.layer(0)
    key_cache.normal_(generator=gen)
    value_cache.normal_(generator=gen)
    seqs, starts, trees = [], [], []
    for _ in range(args.batch):
        seq = pool.new_sequence()
        start = args.context + rng.randrange(-16, 17)
        pool.append_slots(seq, start + rows)
        seqs.append(seq)
        starts.append(start)
        parents = [rng.randrange(start - 1, start + i) for i in range(rows)]
        trees.append(TreeAttention(start, tuple(parents)) if rows > 5 else None)
    counts = [rows] * args.batch
    tree_size = rows if rows > 5 else 0
    q = torch.randn(args.batch, rows, hq, d, generator=gen)
    lines = []
    for seq, start in zip(seqs, starts):  # each sequence's cache in a line, as the per-sequence caches hold it
        slots = torch.tensor(pool.slots(seq, 0, start + rows))
        lines.append((key_cache.view(-1, hkv, d)[slots].transpose(0, 1).contiguous(),
                      value_cache.view(-1, hkv, d)[slots].transpose(0, 1).contiguous()))

    def build() -> PagedStep:
        return PagedStep.pack([s.blocks for s in seqs], starts, counts, trees, args.batch, rows, width, tree_size, bs)

    step = build()
    mask_folded, mask = step.mask(None, hq // hkv), step.mask(None, 1)
    block_mask = step.block_mask(pool.num_blocks)
    methods = {
        "per-seq": lambda: per_sequence(q, lines, starts, counts, trees, scale),
        "sdpa": lambda: paged_attention(q, key_cache, value_cache, step.block_tables, mask_folded, scale),
        "sdpa-gqa": lambda: sdpa_enable_gqa(q, key_cache, value_cache, step.block_tables, mask, scale),
        "flex": lambda: flex_paged_attention(q, key_cache, value_cache, block_mask, scale),
    }
    if not args.no_compile:
        kernel = compiled_flex_attention()
        start_compile = time.perf_counter()
        flex_paged_attention(q, key_cache, value_cache, block_mask, scale, kernel)
        print(f"     (flex compile for {rows} rows: {time.perf_counter() - start_compile:.1f} s)")
        methods["flex-c"] = lambda: flex_paged_attention(q, key_cache, value_cache, block_mask, scale, kernel)
    methods["step"] = lambda: build().mask(None, hq // hkv)
    times: dict[str, list[float]] = {name: [] for name in methods}
    results = {name: fn() for name, fn in methods.items()}  # warm-up
    for round_index in range(args.rounds):
        for name, fn in methods.items():
            if name != "flex" or round_index == 0:  # eager FlexAttention (dense over the pool) is timed once
                timed(fn, times[name])
    reference = results["per-seq"]
    diff = max(float((results[name][i, :rows] - reference[i]).abs().max())
               for name in methods if name not in ("per-seq", "step") for i in range(args.batch))
    cells = [f"{statistics.median(times[name]):8.3f}" if name in times else f"{'-':>8}"
             for name in ("per-seq", "sdpa", "sdpa-gqa", "flex", "flex-c")]
    print(f"{rows:>4} {' '.join(cells)} {statistics.median(times['step']):7.3f}  {diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rows", default="1,5,16")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip compiled FlexAttention (its compile is slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, context ~{args.context}, heads {args.heads}/{args.kv_heads}, head_dim "
          f"{args.head_dim}, float32, blocks of 16, {args.threads} threads; ms per layer call (step: PagedStep and "
          f"its mask, once a step), median of {args.rounds} interleaved rounds")
    print(f"{'rows':>4} {'per-seq':>8} {'sdpa':>8} {'sdpa-gqa':>8} {'flex':>8} {'flex-c':>8} {'step':>7}  max |diff|")
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        measure(args, rows, gen, rng)


if __name__ == "__main__":
    main()

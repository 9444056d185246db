"""`quickdraft bench`: the command line. Building the parser imports nothing heavy; the run is in bench/run.py."""

from __future__ import annotations

import argparse

from quickdraft.bench.names import DEFAULT_METHODS, method_help
from quickdraft.cli_args import add_progress_argument, add_tree_argument


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark draft methods and baselines on a Spec-Bench dataset",
                       description="Benchmark quickdraft's draft methods against plain decoding, transformers and "
                                   "llama.cpp on a Spec-Bench JSONL dataset (by default the prompt set that ships "
                                   "with quickdraft).")
    p.add_argument("--dataset", default=None,
                   help="Spec-Bench JSONL file (question_id, category, turns); default: the prompt set that ships with "
                        "quickdraft, two prompts in each of Spec-Bench's categories (quickdraft/bench/data/)")
    p.add_argument("--model", default=None, help="target: alias, .gguf, directory or hub id (default smollm2-135m)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of: {method_help()} "
                                                              f"(default {DEFAULT_METHODS}; none is always added)")
    p.add_argument("--k", default="5", help="speculative tokens per step; a comma list sweeps K (e.g. 1,2,4,6,8)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn (default 256)")
    p.add_argument("--limit-per-category", type=int, default=None, help="at most this many records per category")
    p.add_argument("--categories", default=None, help="comma list of categories (default: all)")
    p.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                   help="run the records in a random order of this seed across categories (a mixed workload; "
                        "default: file order, each category a block); the tables list categories as they first ran")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plots", default=None, help="write PNG plots into this directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch (and llama.cpp) threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--fixed-k", action="store_true",
                   help="propose exactly K every step (default: adaptive K up to K; a K sweep is always fixed)")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "hf"],
                   help="quickdraft's runner for the target (default auto: native where the architecture has one)")
    p.add_argument("--batch-sizes", default=None,
                   help="a comma list (e.g. 1,4,16,64): instead of prompt-by-prompt runs, generate for all the "
                        "prompts' first turns at once with at most B sequences running, for each B (quickdraft "
                        "methods, and hf as padded batches)")
    add_tree_argument(p)
    add_progress_argument(p)
    p.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    from quickdraft.bench.dataset import DEFAULT_DATASET
    from quickdraft.bench.run import BenchConfig, run_bench
    from quickdraft.models.loader import DEFAULT_MODEL

    cfg = BenchConfig(dataset=args.dataset or str(DEFAULT_DATASET), model=args.model or DEFAULT_MODEL,
                      methods=args.methods, k=args.k, max_new_tokens=args.max_new_tokens,
                      limit_per_category=args.limit_per_category, categories=args.categories, shuffle=args.shuffle,
                      temperature=args.temperature, out=args.out, plots=args.plots, dtype=args.dtype,
                      device=args.device, threads=args.threads, seed=args.seed, adaptive=not args.fixed_k,
                      runner=args.runner, batch_sizes=args.batch_sizes, tree=args.tree)
    run_bench(cfg)
    return 0

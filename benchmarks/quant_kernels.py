"""The quantized linear kernels alone, compute-bound: nanoseconds a weight and row for each GGUF block type, kernel
(bf16; int8 and int16 digits an activation on vpdpbusd; the same on AMX-INT8 tiles where the CPU has them, at
every row count, to show the crossover the kernel's kAmxRows picks) and number of rows, on a matrix that stays
in cache (so memory is not what is measured: the kernels' own cost).

    .venv/bin/python benchmarks/quant_kernels.py [--threads 1] [--repeats 20] [--rows 1,2,4,8,16,64] \
        [--types Q4_K,Q6_K] [--kernels int8x32,int16]

The fastest of `repeats` calls is reported (a shared machine's interference only ever adds time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from test_quant_kernels import random_blocks  # noqa: E402  (random but valid GGUF blocks)

from quickdraft import kernels  # noqa: E402
from quickdraft.kernels import quant  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--types", default="", help="block types to run, e.g. Q4_K,Q6_K (default: all)")
    parser.add_argument("--kernels", default="", help="kernels to run, e.g. int8x32,int16 (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = kernels.cpu_linear()
    if module is None:
        raise SystemExit("needs quickdraft's CPU kernels (an AVX512-BF16 CPU)")
    row_counts = [int(r) for r in args.rows.split(",")]
    variants = [("bf16", False)]
    if "avx512_vnni" in Path("/proc/cpuinfo").read_text():
        variants += [("int8", False), ("int8x32", False), ("int16", False)]
        if module.set_quant_amx(True) or module.quant_amx():
            variants += [("int8", True), ("int8x32", True), ("int16", True)]
    if args.kernels:
        available = sorted({name for name, _ in variants})
        unknown = [k for k in args.kernels.split(",") if k not in available]
        if unknown:
            raise SystemExit(f"kernel(s) {unknown} not available on this CPU: choose from {available}")
        variants = [(name, amx) for name, amx in variants if name in args.kernels.split(",")]
    types = sorted(quant.SUPPORTED)
    if args.types:
        by_name = {quant.NAMES[t]: t for t in types}
        unknown = [t for t in args.types.split(",") if t not in by_name]
        if unknown:
            raise SystemExit(f"unknown block type(s) {unknown}: choose from {sorted(by_name)}")
        types = [by_name[t] for t in args.types.split(",")]
    kernel_before, amx_before, amx_rows_before = module.set_quant_kernel(""), module.quant_amx(), module.set_quant_amx_rows(1)
    print(f"ns a weight and row (fastest of {args.repeats}), {args.threads} thread(s), K = {args.cols}, "
          f"rows {'/'.join(map(str, row_counts))}")
    try:
        for qtype in types:
            rows = 1024 if qtype != quant.Q8_0 else 512  # about 1 MB of blocks: in L2
            packed = quant.pack(quant.decode(random_blocks(qtype, rows, args.cols), qtype, args.cols))
            line = f"  {quant.NAMES[qtype]:5s}"
            for name, amx in variants:
                module.set_quant_kernel(name)
                module.set_quant_amx(amx)
                cost = []
                for m in row_counts:
                    x = torch.randn(m, args.cols).bfloat16()
                    best = float("inf")
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        module.linear_quant(x, [packed.packed], [qtype])
                        best = min(best, time.perf_counter() - start)
                    cost.append(best / (rows * args.cols * m) * 1e9)
                line += f"  {name}{'+amx' if amx else ''} " + "/".join(f"{c:.4f}" for c in cost)
            print(line, flush=True)
    finally:
        module.set_quant_kernel(kernel_before)
        module.set_quant_amx(amx_before)
        module.set_quant_amx_rows(amx_rows_before)


if __name__ == "__main__":
    main()

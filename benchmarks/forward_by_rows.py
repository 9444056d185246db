"""What a target forward costs by its number of new rows (a decoding step is 1, a chain of K drafts K + 1, a tree
its nodes + 1, a batch the sum): the native C++ layer loop on n new rows after `context` cached positions, with
the quantized calls of many rows on AMX-INT8 tiles and on vpdpbusd alone (where the CPU has AMX), interleaved
round by round; medians, and the ratio to one row. On CPUs without AVX-512 the native runner's Python layer loop
on the AVX2 quantized kernels (float32 activations), their one scheme.

    .venv/bin/python benchmarks/forward_by_rows.py [MODEL] [--rows 1,2,4,5,8,9,12,16,24,32] [--rounds 7]
        [--kernels int16,int8x32] [--residual float32,bf16]

--kernels interleaves quantized kernels (activation schemes) round by round too (default: the model's own);
--residual the residual stream's dtype (float32 is a GGUF model's default since session 21; bf16 as before).

Run it with nothing else running: the machine's bandwidth and other processes move every figure.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from quickdraft import kernels
from quickdraft.models.factory import load_runner
from quickdraft.models.loader import resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rows", default="1,2,4,5,8,9,12,16,24,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kernels", default="", help="comma-separated quantized kernels (default: the one in use)")
    parser.add_argument("--residual", default="", help="comma-separated residual dtypes, float32,bf16 (default: the "
                        "runner's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner, _ = load_runner(args.model, dtype=resolve_dtype("auto", torch.device("cpu")))
    avx512 = runner.backend == "cpu-kernels" and runner.decoder() is not None
    module = runner.kernels if avx512 else kernels.cpu_quant_avx2()
    if module is None:
        raise SystemExit("needs quickdraft's CPU kernels (an AVX512-BF16 CPU, or AVX2 for a GGUF file's blocks)")
    rows = [int(r) for r in args.rows.split(",")]
    # The model's kernel (its family's choice, or QUICKDRAFT_QUANT_KERNEL's override) unless --kernels names others;
    # each is run as an override, and the override before is restored at the end.
    schemes = args.kernels.split(",") if args.kernels else [runner.quant_kernel_in_use or module.quant_kernel()]
    kernel_before = module.set_quant_kernel(schemes[0])
    amx = avx512 and (module.set_quant_amx(True) or module.quant_amx())
    dtypes = {"float32": torch.float32, "bf16": torch.bfloat16}
    residuals = args.residual.split(",") if args.residual else [
        next(name for name, dtype in dtypes.items() if dtype == runner.weights.residual_dtype)]
    if not set(residuals) <= set(dtypes):
        raise SystemExit(f"--residual takes {', '.join(dtypes)}")
    tilings = [(k, t, r) for k in schemes for r in residuals
               for t in (["tiles", "vpdpbusd"] if amx else ["vpdpbusd" if avx512 else "avx2"])]
    ids = torch.randint(0, 1000, (args.context + max(rows),), generator=torch.Generator().manual_seed(0))
    cache = runner.new_cache()
    runner.forward(cache, ids[: args.context])
    times: dict[tuple[str, int], list[float]] = {}
    amx_before = avx512 and module.quant_amx()
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for tiling in tilings:
                module.set_quant_kernel(tiling[0])
                runner.weights.residual_dtype = dtypes[tiling[2]]
                if avx512:
                    module.set_quant_amx(tiling[1] == "tiles")
                for n in rows:
                    start = time.perf_counter()
                    runner.forward(cache, ids[args.context: args.context + n], n)
                    seconds = time.perf_counter() - start
                    cache.rollback(args.context)
                    if round_:
                        times.setdefault((tiling, n), []).append(seconds)
    finally:
        if avx512:
            module.set_quant_amx(amx_before)
        module.set_quant_kernel(kernel_before)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = "AMX" if "amx_int8" in flags else "no AMX" if avx512 else "AVX2, no AVX-512"
    print(f"{args.model} ({cpu}, {args.threads} threads): a forward of n new rows after {args.context} cached, "
          f"median of {args.rounds} interleaved rounds, ms (x {rows[0]} rows of the same kernel and tiling)")
    print("| kernel, tiling, residual | " + " | ".join(str(n) for n in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for tiling in tilings:
        one = statistics.median(times[(tiling, rows[0])])
        cells = [f"{statistics.median(times[(tiling, n)]) * 1e3:.1f} ({statistics.median(times[(tiling, n)]) / one:.2f}x)"
                 for n in rows]
        print(f"| {', '.join(tiling)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

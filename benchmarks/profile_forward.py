"""Where a native forward's time goes, on the CPU kernels: the whole forward (the C++ layer loop and the same
kernels called from Python), the linear layers alone, and the weight-bytes floor at the measured bandwidth.

    .venv/bin/python benchmarks/profile_forward.py [MODEL] [--context 200] [--rounds 12] [--dtype auto|bfloat16]
        [--kernels int8,int16,bf16]

dtype auto keeps a GGUF model's quantized blocks (the floor is then that of the bytes those stream),
bfloat16 widens them (the floor of the bf16 weights). --dtype both interleaves the two in every round.
--kernels: the quantized kernels to compare (kernels/cpu_quant*.cpp: int8 or int16 digits an activation on
integer dot products, or bf16), each case of dtype auto run once per kernel in every round.

Sizes and modes are interleaved round by round, and medians (and the fastest round) are printed, so that
drift of a shared machine hits all alike. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quickdraft.bench.costs import measure_read_bandwidth
from quickdraft.models.factory import load_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "both"])
    parser.add_argument("--kernels", default="", help="comma-separated quantized kernels (default: the one in use)")
    parser.add_argument("--tokens", type=int, default=8, help="rows of the multi-token forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runners = {}
    for dtype in (["auto", "bfloat16"] if args.dtype == "both" else [args.dtype]):
        runners[dtype], _ = load_runner(args.model, keep_quantized=dtype == "auto")
        if runners[dtype].backend != "cpu-kernels" or runners[dtype].decoder() is None:
            raise SystemExit("this profile needs quickdraft's CPU kernels (an AVX512-BF16 CPU)")
    first = runners[next(iter(runners))]
    module = first.kernels
    quant_kernels = args.kernels.split(",") if args.kernels else [first.quant_kernel_in_use or module.quant_kernel()]
    ids = torch.randint(0, 1000, (args.context + args.tokens,), generator=torch.Generator().manual_seed(0))
    caches = {}
    for dtype, runner in runners.items():
        caches[dtype] = runner.new_cache()
        runner.forward(caches[dtype], ids[: args.context])

    def forward(runner, cache, n: int, in_cpp: bool) -> None:
        runner.forward(cache, ids[args.context: args.context + n], n, use_decoder=in_cpp)
        cache.rollback(args.context)

    def linears(runner, n: int) -> None:  # every linear layer of a forward on inputs of its shapes, nothing else
        x = torch.randn(n, runner.text_config.hidden_size, dtype=torch.bfloat16)
        for layer in runner.weights.layers:
            layer.qkv(x)
            layer.o(torch.randn(n, layer.o.in_features, dtype=torch.bfloat16))
            layer.gate_up(x)
            layer.down(torch.randn(n, layer.down.in_features, dtype=torch.bfloat16))
        runner.weights.lm_head(x[:n])

    cases = {}  # (dtype, quantized kernel, what) -> case
    for dtype, runner in runners.items():
        for kernel in (quant_kernels if dtype == "auto" else ["-"]):
            cases[(dtype, kernel, "forward (C++ layer loop)")] = lambda n, r=runner, c=caches[dtype]: forward(r, c, n, True)
            cases[(dtype, kernel, "forward (kernels called from Python)")] = \
                lambda n, r=runner, c=caches[dtype]: forward(r, c, n, False)
            cases[(dtype, kernel, "linear layers alone")] = lambda n, r=runner: linears(r, n)
    sizes = (1, args.tokens)
    times: dict[tuple, list[float]] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, case in cases.items():
            if name[1] != "-":
                module.set_quant_kernel(name[1])
            for n in sizes:
                start = time.perf_counter()
                case(n)
                if round_:
                    times.setdefault((name, n), []).append(time.perf_counter() - start)
    bandwidth = measure_read_bandwidth(torch.device("cpu"))
    print(f"{args.model}: memory read {bandwidth / 1e9:.1f} GB/s; context {args.context}, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds")
    for dtype, runner in runners.items():
        floor = runner.weight_bytes / bandwidth
        kinds = runner.quantized_weights.types() if runner.quantized_weights is not None else {"bf16": "all"}
        print(f" dtype {dtype}: {runner.weight_bytes / 1e6:.1f} MB of weights streamed a step "
              f"({', '.join(f'{k} {v}' for k, v in kinds.items())}), floor {floor * 1e3:.2f} ms")
        for (d, kernel, name) in cases:
            if d != dtype:
                continue
            one, many = (statistics.median(times[((d, kernel, name), n)]) for n in sizes)
            best_one, best_many = (min(times[((d, kernel, name), n)]) for n in sizes)
            label = f"{name} [{kernel}]" if kernel != "-" else name
            print(f"  {label:46s} 1 token {one * 1e3:6.2f} ms ({one / floor:.2f}x floor)   "
                  f"{args.tokens} tokens {many * 1e3:6.2f} ms ({many / one:.2f}x one)   "
                  f"fastest: {best_one * 1e3:6.2f} ms ({best_one / floor:.2f}x floor), {best_many * 1e3:6.2f} ms "
                  f"({best_many / best_one:.2f}x)")

if __name__ == "__main__":
    main()

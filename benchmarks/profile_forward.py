"""Where a native forward's time goes, on the CPU kernels: the whole forward (the C++ layer loop and the same
kernels called from Python), the linear layers alone, and the weight-bytes floor at the measured bandwidth.

    .venv/bin/python benchmarks/profile_forward.py [MODEL] [--context 200] [--rounds 12]

Sizes and modes are interleaved round by round, and medians are printed, so that drift of a shared machine
hits all alike. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quickdraft.bench.costs import measure_read_bandwidth
from quickdraft.models.loader import load, resolve
from quickdraft.models.native import NativeRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load(resolve(args.model), torch.bfloat16, torch.device("cpu"))
    runner = NativeRunner(model)
    kernels = runner._cpu_kernels
    if kernels is None or runner._native_decoder() is None:
        raise SystemExit("this profile needs quickdraft's CPU kernels (an AVX512-BF16 CPU)")
    ids = torch.randint(0, 1000, (args.context + 8,), generator=torch.Generator().manual_seed(0))
    cache = runner.new_cache()
    runner.forward(cache, ids[: args.context])
    hidden = runner.config.hidden_size

    def forward(n: int, in_cpp: bool) -> None:
        runner.forward(cache, ids[args.context: args.context + n], n, use_decoder=in_cpp)
        cache.rollback(args.context)

    def linears(n: int) -> None:  # every linear layer of a forward on inputs of its shapes, nothing else
        x = torch.randn(n, hidden, dtype=torch.bfloat16)
        for layer in runner.layers:
            layer.qkv(x)
            layer.o(torch.randn(n, layer.o.in_features, dtype=torch.bfloat16))
            layer.gate_up(x)
            layer.down(torch.randn(n, layer.down.in_features, dtype=torch.bfloat16))
        runner.lm_head(x[:n])

    cases = {"forward (C++ layer loop)": lambda n: forward(n, True),
             "forward (kernels called from Python)": lambda n: forward(n, False),
             "linear layers alone": linears}
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, case in cases.items():
            for n in (1, 8):
                start = time.perf_counter()
                case(n)
                if round_:
                    times.setdefault((name, n), []).append(time.perf_counter() - start)
    bandwidth = measure_read_bandwidth(torch.device("cpu"))
    floor = runner.weight_bytes / bandwidth
    print(f"{args.model}: {runner.weight_bytes / 1e6:.0f} MB of weights, memory read {bandwidth / 1e9:.1f} GB/s, "
          f"floor {floor * 1e3:.1f} ms; context {args.context}, {args.threads} threads, median of {args.rounds}")
    for name in cases:
        one, eight = (statistics.median(times[(name, n)]) for n in (1, 8))
        print(f"  {name:38s} 1 token {one * 1e3:6.2f} ms ({one / floor:.2f}x floor)   "
              f"8 tokens {eight * 1e3:6.2f} ms ({eight / one:.2f}x one)")


if __name__ == "__main__":
    main()

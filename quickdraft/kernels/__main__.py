"""`python -m quickdraft.kernels`: build quickdraft's CPU kernels now, where a wait is expected (scripts/setup.sh
runs it), instead of at the first model load; says what this CPU gets. Exit status 0 either way: without the
kernels quickdraft runs on torch's matmuls."""

from __future__ import annotations

import sys
import time

import torch

from quickdraft import kernels


def main() -> int:
    start = time.perf_counter()
    module = kernels.quant_kernels(torch.bfloat16)  # what a model load builds: cpu_linear, else maybe AVX2's
    seconds = time.perf_counter() - start
    cpu = kernels.cpu_description()
    if module is None:
        reason = kernels._state.get("cpu_linear_reason") or "no kernels for this CPU"
        print(f"quickdraft: no CPU kernels on {cpu}: {reason}; torch's matmuls run instead", file=sys.stderr)
        return 0
    print(f"quickdraft: CPU kernels ready for {cpu} ({kernels._variant()[0]}, {seconds:.0f} s; kept in "
          f"{kernels._cache_dir()})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The GPU check (issue 49): quickdraft's CUDA tests and every target of the GPU runner, in one run of under 8 minutes
# on one GPU. Run it where a GPU is lent to you; never from CI. The machine may be offline: it uses a Python that
# already has a CUDA build of torch (PYTHON, default python3) and installs quickdraft itself without dependencies.
# Prints the test summary and the targets table (logs and JSON under $OUT); record them in benchmarks/RESULTS.md.
#   benchmarks/gpu_check.sh            # on a GPU
#   benchmarks/gpu_check.sh --cpu      # its CPU-runnable parts at a toy size (checks the script, not the GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/quickdraft-gpu}
mkdir -p "$OUT"
if [[ "${1:-}" == "--cpu" ]]; then
  # The static-shape path's tests on the CPU, then the targets' script at a toy size.
  QUICKDRAFT_TEST_DEVICE=cpu timeout 1200 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    tests/models/test_cuda_graphs.py 2>&1 | tail -5
  timeout 300 "$PYTHON" benchmarks/cuda_costs.py --device cpu --dtype float32 --target tiny --draft tiny --rounds 3 \
    --tokens 16 --repeats 1 --out "$OUT/cuda-costs-cpu.json" 2>&1 | tee "$OUT/cuda-costs-cpu.log" | tail -40
  exit 0
fi
"$PYTHON" - <<'PY' || { echo "gpu_check: no CUDA torch in $PYTHON"; exit 2; }
import torch
assert torch.cuda.is_available(), "CUDA not available"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
"$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true

# Tests (3 minutes at most): tests/test_cuda.py puts every tiny model on the GPU on the CUDA runner, graphs on by
# default (greedy and seeded equality with plain decoding for each draft method, chains and trees, alone and
# batched; the sampled law by chi-square; a GGUF file's blocks; graphs against the same runner's eager forwards);
# test_cuda_graphs.py checks the static path against the reference runner. QUICKDRAFT_NO_KERNELS skips building
# the CPU kernels (minutes of compiling for tests that do not need them on this machine).
QUICKDRAFT_NO_KERNELS=1 timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=5 tests/test_cuda.py \
  tests/models/test_cuda_graphs.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25

# Issue 49's targets (4 minutes at most): the Qwen pair's shapes with random bf16 weights; plain decoding against
# the memory floor and transformers' static-cache generate, forwards by rows and trees, whole speculative steps.
QUICKDRAFT_NO_KERNELS=1 timeout 270 "$PYTHON" benchmarks/cuda_costs.py --out "$OUT/cuda-costs.json" 2>&1 \
  | tee "$OUT/cuda-costs.log" | tail -45

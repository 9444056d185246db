#!/usr/bin/env bash
# The GPU check: quickdraft's tests on CUDA and what a speculative step costs there, in under 8 minutes on one GPU.
# Run it where the device tool lends a GPU; never from CI. The machine is offline: it uses a Python that already
# has a CUDA build of torch (PYTHON, default python3) and installs quickdraft itself without dependencies.
# Prints the test summary and the cost tables (logs and JSON under $OUT); record them in benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/quickdraft-gpu}
mkdir -p "$OUT"
"$PYTHON" - <<'PY' || { echo "gpu_check: no CUDA torch in $PYTHON"; exit 2; }
import torch
assert torch.cuda.is_available(), "CUDA not available"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
"$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true

# Tests (4 minutes at most): tests/test_cuda.py puts every tiny model on the GPU (greedy and seeded equality with
# plain decoding for each draft method, chains and trees, alone and batched; the sampled law by chi-square; a GGUF
# file's blocks; CUDA graphs against the eager loop); the engine tests whose LLM takes device "auto" run there too. QUICKDRAFT_NO_KERNELS skips building
# the CPU kernels (minutes of compiling for tests that do not need them on this machine).
QUICKDRAFT_NO_KERNELS=1 timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=5 tests/test_cuda.py \
  tests/models/test_cuda_graphs.py tests/test_engine.py tests/models/test_batch_forward.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -40

# What a speculative step costs on the GPU, eager and with CUDA graphs: the Qwen pair's shapes with random weights
# (3 minutes at most).
timeout 180 "$PYTHON" benchmarks/cuda_costs.py --out "$OUT/cuda-costs.json" 2>&1 | tee "$OUT/cuda-costs.log" | tail -30

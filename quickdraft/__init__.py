"""quickdraft: lossless speculative decoding for causal language models.

The API's names are imported on first use (PEP 562): `import quickdraft` alone, and so the command line's
parser and `quickdraft --help`, do not import torch (2-5 s)."""

from typing import TYPE_CHECKING

from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from quickdraft.api import LLM, CompletionOutput, RequestOutput, TextStream
    from quickdraft.drafts import SpeculativeConfig
    from quickdraft.engine import RequestMetrics
    from quickdraft.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "TextStream", "QuickdraftError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "CompletionOutput", "RequestOutput", "TextStream"):
        from quickdraft import api as home
    elif name == "SpeculativeConfig":
        from quickdraft import drafts as home
    elif name == "RequestMetrics":
        from quickdraft import engine as home
    elif name == "SamplingParams":
        from quickdraft import params as home
    else:
        raise AttributeError(f"module 'quickdraft' has no attribute {name!r}")
    value = getattr(home, name)
    globals()[name] = value  # later lookups skip this function
    return value

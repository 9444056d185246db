"""`quantized`: the target itself with weight-only quantized linear layers as the draft (a quantized self-draft):
int8 (per-output scales) or q4 (GGML's Q4_1 blocks: 4-bit codes, a float16 scale and min per 32 inputs, on
the quantized CPU kernels).

It reads about half (int8) or 0.31x (q4) the bytes of a bf16 target per token and agrees with it on most
tokens, since it is the same model up to rounding of its weights. (Of a target already kept at 4-5 bits, a
GGUF model with dtype auto, it is about as dear as the target: adaptive K then stops drafting.) Verification
by the unquantized target keeps the output exactly the target's: quantization here changes only the speed,
never the text."""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft.drafts.base import spelling_argument
from quickdraft.drafts.draft_model import DraftModelProposer, QuantizationOptions
from quickdraft.errors import QuickdraftError
from quickdraft.models.base import QUANTIZATION_SCHEMES
from quickdraft.models.base import Runner


@dataclass
class QuantizedOptions(QuantizationOptions):
    """quantization: the scheme of the self-draft (default int8)."""

    def __post_init__(self) -> None:
        if self.quantization is None:
            self.quantization = "int8"
        super().__post_init__()


class QuantizedSelfProposer(DraftModelProposer):
    name = "quantized"
    options = QuantizedOptions
    spelling = f"quantized[:{'|'.join(QUANTIZATION_SCHEMES)}]"
    spelling_catches_all = False
    loads_draft_model = False

    def __init__(self, target: Runner, scheme: str = "int8"):
        super().__init__(target.quantized(scheme), target.vocab_size)
        self.scheme = scheme

    @classmethod
    def parse_spelling(cls, draft: str) -> dict | None:
        scheme = spelling_argument(draft, "quantized")
        if scheme is None or draft == "quantized":
            return None if scheme is None else {}
        if scheme not in QUANTIZATION_SCHEMES:
            raise QuickdraftError(f"--draft {draft}: expected quantized:SCHEME with SCHEME one of "
                                  f"{', '.join(QUANTIZATION_SCHEMES)}")
        return {"quantization": scheme}

    @classmethod
    def label(cls, config) -> str:
        return cls.name

    @classmethod
    def from_config(cls, config, context) -> "QuantizedSelfProposer":
        return cls(context.target, config.options.quantization)

"""`quantized`: the target itself with weight-only quantized linear layers as the draft (a quantized self-draft):
int8 (per-output scales) or q4 (GGML's Q4_1 blocks: 4-bit codes, a float16 scale and min per 32 inputs, on
the quantized CPU kernels).

It reads about half (int8) or 0.31x (q4) the bytes of a bf16 target per token and agrees with it on most
tokens, since it is the same model up to rounding of its weights. (Of a target already kept at 4-5 bits, a
GGUF model with dtype auto, it is about as dear as the target: adaptive K then stops drafting.) Verification
by the unquantized target keeps the output exactly the target's: quantization here changes only the speed,
never the text."""

from __future__ import annotations

from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.models.base import QUANTIZATION_SCHEMES, Runner


class QuantizedSelfProposer(DraftModelProposer):
    name = "quantized"
    spelling = f"quantized[:{'|'.join(QUANTIZATION_SCHEMES)}]"

    def __init__(self, target: Runner, scheme: str = "int8"):
        super().__init__(target.quantized(scheme), target.vocab_size)
        self.scheme = scheme

    @classmethod
    def from_config(cls, config, context) -> "QuantizedSelfProposer":
        return cls(context.target, config.quantization)

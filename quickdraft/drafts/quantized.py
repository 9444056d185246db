"""`quantized`: the target itself with weight-only int8 linear layers as the draft (a quantized self-draft).

It reads about half the bytes of a bf16 target per token and agrees with it on most tokens, since it is the
same model up to rounding of its weights. Verification by the unquantized target keeps the output exactly
the target's: quantization here changes only the speed, never the text."""

from __future__ import annotations

from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.models.runner import Runner


class QuantizedSelfProposer(DraftModelProposer):
    name = "quantized"

    def __init__(self, target: Runner, scheme: str = "int8"):
        super().__init__(target.quantized(scheme), target.vocab_size)
        self.scheme = scheme

    @classmethod
    def from_config(cls, config, context) -> "QuantizedSelfProposer":
        return cls(context.target, config.quantization)

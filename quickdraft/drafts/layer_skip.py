"""`layer_skip`: the target's own first N layers, final norm and output head as the draft (a self-draft,
as in LayerSkip / Draft & Verify). The view shares the target's weights; only its KV cache is separate."""

from __future__ import annotations

from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.models.base import Runner


class LayerSkipProposer(DraftModelProposer):
    name = "layer_skip"
    spelling = "layers:N"

    def __init__(self, target: Runner, num_layers: int, quantization: str | None = None):
        runner = target.truncated(num_layers)
        if quantization:
            runner = runner.quantized(quantization)
        super().__init__(runner, target.vocab_size)
        self.num_layers = num_layers

    @classmethod
    def from_config(cls, config, context) -> "LayerSkipProposer":
        return cls(context.target, config.num_layers, config.quantization)

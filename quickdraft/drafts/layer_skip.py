"""`layer_skip`: the target's own first N layers, final norm and output head as the draft (a self-draft,
as in LayerSkip / Draft & Verify). The view shares the target's weights; only its KV cache is separate."""

from __future__ import annotations

from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.models.runner import HFRunner, quantized, truncated_view


class LayerSkipProposer(DraftModelProposer):
    name = "layer_skip"

    def __init__(self, target, num_layers: int, quantization: str | None = None):
        if hasattr(target, "truncated"):  # the native runner shares its layer list
            runner = target.truncated(num_layers)
        else:
            runner = HFRunner(truncated_view(target.model, num_layers), name=f"{target.name}[:{num_layers} layers]")
        if quantization:
            runner = quantized(runner, quantization)
        super().__init__(runner, target.vocab_size)
        self.num_layers = num_layers

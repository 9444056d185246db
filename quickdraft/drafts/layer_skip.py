"""`layer_skip`: the target's own first N layers, final norm and output head as the draft (a self-draft,
as in LayerSkip / Draft & Verify). The view shares the target's weights; only its KV cache is separate."""

from __future__ import annotations

from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.models.runner import HFRunner, truncated_view


class LayerSkipProposer(DraftModelProposer):
    name = "layer_skip"

    def __init__(self, target: HFRunner, num_layers: int):
        view = truncated_view(target.model, num_layers)
        super().__init__(HFRunner(view, name=f"{target.name}[:{num_layers} layers]"), target.vocab_size)
        self.num_layers = num_layers

"""`layer_skip`: the target's own first N layers, final norm and output head as the draft (a self-draft,
as in LayerSkip / Draft & Verify). The view shares the target's weights; only its KV cache is separate."""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft.drafts.base import spelling_argument
from quickdraft.drafts.draft_model import DraftModelProposer, QuantizationOptions
from quickdraft.errors import QuickdraftError
from quickdraft.models.base import Runner


@dataclass
class LayerSkipOptions(QuantizationOptions):
    """num_layers: how many of the target's layers the draft keeps (quantization: of that view, optional)."""

    num_layers: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.num_layers, int) and self.num_layers >= 1):
            raise QuickdraftError("method 'layer_skip' needs num_layers, an integer >= 1 "
                                  "(how many of the target's layers the draft keeps)")


class LayerSkipProposer(DraftModelProposer):
    name = "layer_skip"
    options = LayerSkipOptions
    spelling = "layers:N"
    spelling_catches_all = False
    loads_draft_model = False

    def __init__(self, target: Runner, num_layers: int, quantization: str | None = None):
        runner = target.truncated(num_layers)
        if quantization:
            runner = runner.quantized(quantization)
        super().__init__(runner, target.vocab_size)
        self.num_layers = num_layers

    @classmethod
    def parse_spelling(cls, draft: str) -> dict | None:
        value = spelling_argument(draft, "layers")
        if value is None or draft == "layers":  # plain "layers" may name a draft model
            return None
        if not value.isdigit():
            raise QuickdraftError(f"--draft {draft}: expected layers:N with N a positive integer, e.g. layers:12")
        return {"num_layers": int(value)}

    @classmethod
    def label(cls, config) -> str:
        return f"layers:{config.options.num_layers}"

    @classmethod
    def from_config(cls, config, context) -> "LayerSkipProposer":
        return cls(context.target, config.options.num_layers, config.options.quantization)

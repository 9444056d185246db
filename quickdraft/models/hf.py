"""The transformers runner: any transformers causal LM behind the Runner protocol (models/base.py), with an
incremental DynamicCache per sequence, one model call per sequence (batch 1 behind the batched interface).
Models the native runner (models/native.py) has no decoder for run here, and so do the transformers baselines.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError
from quickdraft.models.base import check_batch
from quickdraft.models.config import get_text_config


class HFRunner:
    """Any transformers causal LM, with an incremental DynamicCache per sequence (a Runner)."""

    kind = "hf"
    quantized_weights = None  # transformers has no kernels for a GGUF file's blocks: it runs dequantized weights

    def __init__(self, model: nn.Module, name: str = "model"):
        self.model = model
        self.name = name
        self.text_config = get_text_config(model.config)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_len = int(getattr(self.text_config, "max_position_embeddings", 0) or 1 << 30)
        self.forwards = 0  # model calls, for metrics
        # transformers renamed `past_key_values` to `cache` (5.x); pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def rows_invariant(self) -> bool:
        return False  # torch's matmuls round a row differently with the number of rows

    @property
    def kv_bytes_per_token(self) -> int:
        config = self.text_config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        size = torch.empty((), dtype=self.dtype).element_size()
        return int(self.num_layers) * int(kv_heads) * int(head_dim) * 2 * size

    @property
    def weight_bytes(self) -> int:
        """Every parameter but the input embedding (of which a step reads a row), counted once when the output
        head shares it."""
        model = self.model
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        if embedding.data_ptr() != head.data_ptr():
            total -= embedding.numel() * embedding.element_size()
        return total

    def new_cache(self) -> SequenceCache:
        return SequenceCache()

    def truncated(self, num_layers: int) -> "HFRunner":
        return HFRunner(truncated_view(self.model, num_layers), name=f"{self.name}[:{num_layers} layers]")

    def quantized(self, scheme: str) -> "HFRunner":
        raise QuickdraftError(f"{self.name}: quantization {scheme!r} needs the native runner, which this "
                              "architecture lacks; drop the quantization or pick another draft")

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():  # Gemma's embedding module applies its scale itself
            return self.model.get_input_embeddings()(ids.to(self.device))

    @torch.inference_mode()
    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden.to(self.device)).float()
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach()[ids.to(self.device)].float().cpu()

    def final_norm_weight(self) -> torch.Tensor:
        return self._final_norm().weight.detach().float().cpu()

    def _final_norm(self) -> nn.Module:
        inner = getattr(self.model, getattr(self.model, "base_model_prefix", "model"), None)
        norm = getattr(inner, "norm", None)
        if not isinstance(norm, nn.Module):
            raise QuickdraftError(f"{self.name}: {type(self.model).__name__} has no final norm module "
                                  "(`.model.norm`) to read hidden states from; EAGLE drafts cannot run on it")
        return norm

    @torch.inference_mode()
    def forward(self, cache: SequenceCache, tokens: torch.Tensor, num_logits: int = 1,
                return_hidden: bool = False):
        """Append `tokens` [n] at positions len(cache)... and return the logits of the last `num_logits`
        inputs, [num_logits, V] in float32. Row j is the next-token distribution after input n-num_logits+j.
        return_hidden: (logits, hidden [n, hidden]), the final norm's output for every input row."""
        tokens = tokens.reshape(1, -1).to(self.device)
        if len(cache) + tokens.shape[1] > self.max_len:
            raise QuickdraftError(f"{self.name}: sequence of {len(cache) + tokens.shape[1]} tokens exceeds the "
                                  f"context of {self.max_len}; shorten the prompt or max_tokens")
        captured = []
        hook = self._final_norm().register_forward_hook(lambda m, i, o: captured.append(o)) if return_hidden else None
        try:
            out = self.model(input_ids=tokens, use_cache=True, logits_to_keep=num_logits,
                             **{self._cache_kwarg: cache.kv})
        finally:
            if hook is not None:
                hook.remove()
        cache.record(tokens)
        self.forwards += 1
        logits = out.logits[0, -num_logits:].float()
        return (logits, captured[-1][0]) if return_hidden else logits

    def forward_batch(self, caches: list[SequenceCache], tokens: list[torch.Tensor],
                      num_logits: list[int], return_hidden: bool = False):
        """forward over several sequences, as NativeRunner.forward_batch: sequence i appends tokens[i] [n_i]
        and gives the logits of its last num_logits[i] inputs; returns them concatenated in order,
        [sum(num_logits), V] float32 (with return_hidden, and every row's final hidden state [sum(n_i), hidden]).
        Here one model call per sequence (batch 1 behind the batched interface)."""
        flat = check_batch(self, caches, tokens, num_logits)
        parts, hiddens = [], []
        for cache, ids, k in zip(caches, flat, num_logits):
            out = self.forward(cache, ids, max(int(k), 1), return_hidden)  # transformers reads 0 as "all"
            logits = out[0] if return_hidden else out  # [max(k, 1), vocab]
            parts.append(logits[logits.shape[0] - int(k):])  # [k, vocab]
            if return_hidden:
                hiddens.append(out[1])
        logits = torch.cat(parts)  # [sum(num_logits), vocab]
        return (logits, torch.cat(hiddens)) if return_hidden else logits


def truncated_view(model: nn.Module, num_layers: int) -> nn.Module:
    """The model's first `num_layers` decoder layers, then its final norm and output head, as a model object
    that shares every parameter with `model` (no copy of any weight)."""
    inner_name = getattr(model, "base_model_prefix", "model")
    inner = getattr(model, inner_name, None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise QuickdraftError(f"layer_skip needs a decoder with a `.{inner_name}.layers` list; "
                              f"{type(model).__name__} has none, use another draft method")
    total = len(layers)
    if not 1 <= num_layers <= total:
        raise QuickdraftError(f"layer_skip: num_layers must be in [1, {total}] for this model, got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:num_layers])
    # Shallow copies share the parameters; only the module dicts are new, so the target is untouched.
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner._modules["layers"] = nn.ModuleList(list(layers)[:num_layers])
    view_inner.config = config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._modules[inner_name] = view_inner
    view.config = config
    return view

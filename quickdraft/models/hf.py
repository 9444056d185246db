"""The transformers runner: any transformers causal LM behind the Runner protocol (models/base.py), with an
incremental DynamicCache per sequence, one model call per sequence (batch 1 behind the batched interface).
Models quickdraft's own decoder (models/decoder.py) has no runner for run here, and so do the transformers baselines.
A token tree's rows (models.base.TreeAttention) go through the model's own attention as a 4-D additive mask and
position ids (models/tree_mask.py), one mask per layer type where the layers' windows differ.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError
from quickdraft.models.base import TreeAttention, check_batch, check_tree, check_trees
from quickdraft.models.config import get_text_config
from quickdraft.models.families import FAMILIES, sliding_window
from quickdraft.models.tree_mask import tree_positions, tree_visibility
from quickdraft.sampling import argmax_rows


class HFRunner:
    """Any transformers causal LM, with an incremental DynamicCache per sequence (a Runner)."""

    kind = "hf"
    backend = "transformers"
    quantized_weights = None  # transformers has no kernels for a GGUF file's blocks: it runs dequantized weights
    quant_kernel_in_use = None

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

    def with_vocabulary(self, size: int) -> "HFRunner":
        if size == self.vocab_size:
            return self
        raise QuickdraftError(f"{self.name}: a draft vocabulary of {size} tokens needs the native runner, which this "
                              "architecture lacks (the transformers forward computes its whole output head); "
                              "drop draft_vocab_size")

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():  # Gemma's embedding module applies its scale itself
            return self.model.get_input_embeddings()(ids.to(self.device))

    @torch.inference_mode()
    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden.to(self.device)).float()
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def output_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return argmax_rows(self.output_logits(hidden))

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
                return_hidden: bool = False, tree: TreeAttention | None = None):
        """Append `tokens` [n] at positions len(cache)... and return the logits of the last `num_logits`
        inputs, [num_logits, V] in float32. Row j is the next-token distribution after input n-num_logits+j.
        return_hidden: (logits, hidden [n, hidden]), the final norm's output for every input row.
        tree: the new rows form a token tree (models.base.TreeAttention, end len(cache) + n): they are written at
        slots len(cache).. and attend and sit at the positions it says."""
        tokens = tokens.reshape(1, -1).to(self.device)
        if len(cache) + tokens.shape[1] > self.max_len:
            raise QuickdraftError(f"{self.name}: sequence of {len(cache) + tokens.shape[1]} tokens exceeds the "
                                  f"context of {self.max_len}; shorten the prompt or max_tokens")
        inputs = {}
        if tree is not None:
            check_tree(self.name, tree, len(cache), tokens.shape[1])
            inputs = self._tree_inputs(tree, len(cache))
        captured = []
        hook = self._final_norm().register_forward_hook(lambda m, i, o: captured.append(o)) if return_hidden else None
        try:
            out = self.model(input_ids=tokens, use_cache=True, logits_to_keep=num_logits,
                             **{self._cache_kwarg: cache.kv}, **inputs)
        finally:
            if hook is not None:
                hook.remove()
        cache.record(tokens)
        self.forwards += 1
        logits = out.logits[0, -num_logits:].float()
        return (logits, captured[-1][0]) if return_hidden else logits

    def forward_batch(self, caches: list[SequenceCache], tokens: list[torch.Tensor],
                      num_logits: list[int], return_hidden: bool = False,
                      trees: list[TreeAttention | None] | None = None, argmax_only: bool = False):
        """forward over several sequences, as the native runners' forward_batch: sequence i appends tokens[i] [n_i]
        and gives the logits of its last num_logits[i] inputs; returns them concatenated in order,
        [sum(num_logits), V] float32 (with return_hidden, and every row's final hidden state [sum(n_i), hidden]).
        trees: per sequence None or the TreeAttention its rows form (Runner.forward_batch).
        Here one model call per sequence (batch 1 behind the batched interface)."""
        flat = check_batch(self, caches, tokens, num_logits)
        trees = self._check_trees(caches, flat, trees)  # before any cache changes
        parts, hiddens = [], []
        for cache, ids, k, tree in zip(caches, flat, num_logits, trees):
            out = self.forward(cache, ids, max(int(k), 1), return_hidden, tree)  # transformers reads 0 as "all"
            logits = out[0] if return_hidden else out  # [max(k, 1), vocab]
            parts.append(logits[logits.shape[0] - int(k):])  # [k, vocab]
            if return_hidden:
                hiddens.append(out[1])
        logits = torch.cat(parts)  # [sum(num_logits), vocab]
        if argmax_only:  # [sum(num_logits)]
            logits = argmax_rows(logits)
        return (logits, torch.cat(hiddens)) if return_hidden else logits

    # --- token trees: a 4-D mask and positions, through the model's own attention ---
    def _check_trees(self, caches: list[SequenceCache], flat: list[torch.Tensor],
                     trees: list[TreeAttention | None] | None) -> list[TreeAttention | None]:
        """forward_batch's trees, one per sequence (None: all causal), each checked against its cache."""
        checked = check_trees(self, caches, flat, trees)
        if checked is None:
            return [None] * len(caches)
        self._tree_layer_windows()
        return list(checked)

    def _tree_layer_windows(self) -> dict[str | None, int | None]:
        """The attention window of each kind of layer as this model's masks apply it, for tree masks: {None: w}
        when every layer has window w (one 4-D mask, which transformers' mask builders pass through as is), else
        {layer type: w} (the models whose layers differ take a dict of masks keyed by config.layer_types).
        Which layers slide is known for the native families (models/families.py, checked against transformers
        by tests/models/test_families.py); another model type is taken only when nothing in it slides."""
        config = self.text_config
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in ("eager", "sdpa"):
            raise QuickdraftError(f"{self.name}: token trees on the transformers runner pass a 4-D attention mask, "
                                  f"which attn_implementation={implementation!r} does not take; load the model "
                                  "with 'sdpa' or 'eager' attention, or draft chains")
        if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
            raise QuickdraftError(f"{self.name}: token trees need causal attention; this model attends "
                                  "bidirectionally")
        kind = getattr(config, "model_type", None)
        family = FAMILIES.get(kind)
        types = list(getattr(config, "layer_types", None) or ())
        if family is None:
            window = getattr(config, "sliding_window", None)
            if window is not None or set(types) - {"full_attention"}:
                raise QuickdraftError(f"{self.name}: token trees on the transformers runner know which layers of "
                                      f"{', '.join(sorted(FAMILIES))} slide their attention window; {kind!r} with "
                                      f"sliding_window={window!r} and layer types {sorted(set(types))} is not among "
                                      "them: draft chains for it")
            return {None: None}
        windows = [sliding_window(family, config, i) for i in range(self.num_layers)]
        if len(set(windows)) == 1:
            return {None: windows[0]}
        by_type: dict[str | None, int | None] = {}
        for layer_type, window in zip(types, windows):  # windows differ only where layer_types mark them
            if by_type.setdefault(layer_type, window) != window:
                raise QuickdraftError(f"{self.name}: layers of type {layer_type!r} attend through different "
                                      "windows; one tree mask per layer type cannot describe them: draft chains")
        return by_type

    def _tree_inputs(self, tree: TreeAttention, start: int) -> dict:
        """The model's position_ids [1, n] and attention_mask (additive [1, 1, n, end] in the model's dtype: 0
        where a row sees a slot, the dtype's minimum elsewhere; or such masks by layer type) for the rows of
        slots start..tree.end - 1."""
        positions = tree_positions(tree)[start:].to(self.device)[None]  # [1, n]
        masks: dict[int | None, torch.Tensor] = {}  # by window
        by_kind = {}
        for kind, window in self._tree_layer_windows().items():
            if window not in masks:
                unseen = ~tree_visibility(tree, start, window).to(self.device)  # [n, end]
                masks[window] = torch.zeros(unseen.shape, dtype=self.dtype, device=self.device).masked_fill_(
                    unseen, torch.finfo(self.dtype).min)[None, None]  # [1, 1, n, end]
            by_kind[kind] = masks[window]
        return {"position_ids": positions, "attention_mask": by_kind[None] if None in by_kind else by_kind}


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

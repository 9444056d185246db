"""Model runners: a causal LM behind one small interface, run one sequence at a time with its own cache.

A runner is stateless across sequences; each sequence owns a SequenceCache. forward_batch takes several
sequences at once (one model call for all on the native runner; here, one call per sequence behind the same
interface), so that batching requests changes the runner, not its callers.
"""

from __future__ import annotations

import copy
import inspect
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError


@runtime_checkable
class Runner(Protocol):
    """What the engine and the drafts use of a model: quickdraft's native decoder (models/native.py) and the
    transformers forward (HFRunner) both provide it."""

    name: str
    vocab_size: int
    max_len: int
    forwards: int  # model calls so far, for metrics

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int:
        """What one position of one sequence's cache takes: layers x kv_heads x head_dim x 2 x dtype size."""

    @property
    def rows_invariant(self) -> bool:
        """Whether a row's outputs are bitwise the same whatever the other rows of a forward (then a token's
        logits and cached keys do not depend on how it was batched, verified or prefilled)."""

    def new_cache(self) -> SequenceCache: ...

    def forward(self, cache: SequenceCache, tokens: torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        """Append tokens [n] to the sequence; float32 logits of the last num_logits inputs [num_logits, V]."""

    def forward_batch(self, caches: list[SequenceCache], tokens: list[torch.Tensor],
                      num_logits: list[int], return_hidden: bool = False):
        """Several sequences in one step; their logits concatenated in order, [sum(num_logits), V]. With
        return_hidden, (logits, hidden): every input row's last hidden state after the final norm (the output
        layer's input; what an EAGLE head reads), [sum(n_i), hidden], at no extra forward."""

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [n] -> the input embeddings the first layer reads, [n, hidden]."""

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] (forward_batch's return_hidden) -> float32 logits [n, V]."""

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the output layer's weight, float32 on the CPU [len(ids), hidden]."""

    def truncated(self, num_layers: int) -> "Runner":
        """The first num_layers layers, final norm and head, sharing this runner's weights (a self-draft)."""

    def quantized(self, scheme: str) -> "Runner":
        """A weight-only quantized copy (a self-draft), or a QuickdraftError where the runner has none."""


class HFRunner:
    """Any transformers causal LM, with an incremental DynamicCache per sequence (a Runner)."""

    def __init__(self, model: nn.Module, name: str = "model"):
        self.model = model
        self.name = name
        self.config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_len = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
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
        return int(self.config.num_hidden_layers)

    @property
    def rows_invariant(self) -> bool:
        return False  # torch's matmuls round a row differently with the number of rows

    @property
    def kv_bytes_per_token(self) -> int:
        config = self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        size = torch.empty((), dtype=self.dtype).element_size()
        return int(self.num_layers) * int(kv_heads) * int(head_dim) * 2 * size

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
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach()[ids.to(self.device)].float().cpu()

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


def check_batch(runner, caches: list, tokens: list, num_logits: list) -> list[torch.Tensor]:
    """What a runner's forward_batch checks before it changes any cache: one token tensor [n_i] (n_i >= 1) and
    one num_logits (0 <= k_i <= n_i) per cache, no cache twice, and every sequence within the runner's
    context. Returns the token tensors flattened to [n_i]."""
    if not len(caches) == len(tokens) == len(num_logits):
        raise QuickdraftError(f"{runner.name}: forward_batch takes one token tensor and one num_logits per cache; "
                              f"got {len(caches)} caches, {len(tokens)} token tensors and {len(num_logits)} num_logits")
    if not caches:
        raise QuickdraftError(f"{runner.name}: forward_batch needs at least one sequence")
    if len({id(cache) for cache in caches}) != len(caches):
        raise QuickdraftError(f"{runner.name}: forward_batch got the same cache twice; each sequence has its own")
    flat = []
    for i, (cache, ids, k) in enumerate(zip(caches, tokens, num_logits)):
        ids = torch.as_tensor(ids).reshape(-1)  # [n_i]
        n = ids.shape[0]
        which = f" (sequence {i} of the batch)" if len(caches) > 1 else ""
        if n == 0:
            raise QuickdraftError(f"{runner.name}: no tokens to append{which}; each sequence needs at least one")
        if not 0 <= int(k) <= n:
            raise QuickdraftError(f"{runner.name}: num_logits {int(k)} of a sequence of {n} new tokens{which}; it must "
                                  f"be in [0, {n}]")
        if len(cache) + n > runner.max_len:
            raise QuickdraftError(f"{runner.name}: sequence of {len(cache) + n} tokens exceeds the context of "
                                  f"{runner.max_len}{which}; shorten the prompt or max_tokens")
        flat.append(ids)
    return flat


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


RUNNERS = ("auto", "native", "hf")


def make_runner(model: nn.Module, name: str, kind: str = "auto", quantized=None) -> Runner:
    """The runner for `model`: `native` (quickdraft's own decoder, Llama family and Gemma 3), `hf` (the
    transformers forward, any causal LM), or `auto` (native where the architecture has one). quantized: a GGUF
    file's blocks (models/gguf_weights.QuantizedWeights) for the native runner to keep in their stored format."""
    if kind not in RUNNERS:
        raise QuickdraftError(f"unknown runner {kind!r}; use one of {', '.join(RUNNERS)}")
    if kind == "hf":
        return HFRunner(model, name=name)
    from quickdraft.models.native import NativeRunner, supports

    reason = supports(model)
    if reason is None:
        return NativeRunner(model, name=name, quantized=quantized)
    if kind == "native":
        raise QuickdraftError(f"{name}: {reason}; use runner='auto' or 'hf'")
    return HFRunner(model, name=name)


def quantized(runner: Runner, scheme: str) -> Runner:
    """A weight-only quantized copy of `runner` (for drafts); only native runners have one."""
    return runner.quantized(scheme)

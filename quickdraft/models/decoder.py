"""What quickdraft's three decoder runners share: the Runner interface over one DecoderWeights (models/weights.py),
the layer loop around attention, the input rows, the final norm and the output head.

A runner is one backend (models/base.py): CpuKernelRunner (models/cpu_runner.py: the C++ layer loop on
AVX512-BF16 CPUs, keys packed for its attention), TorchRunner (models/torch_runner.py: eager torch ops on any
device, the reference) and CudaRunner (models/cuda_runner.py: static shapes, every forward a CUDA graph). They
differ in how a forward writes the cache and attends, and in their cache class; models/factory.py picks one by
device, dtype and the kernels this machine has. Derived runners (truncated, quantized, with_vocabulary) are
the same backend over derived weights.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.kv.static_cache import StaticSequenceCache
from quickdraft.models.base import TreeAttention, check_batch, check_trees
from quickdraft.errors import QuickdraftError
from quickdraft.models.gguf_weights import QuantizedWeights
from quickdraft.models.weights import DecoderWeights, Layer
from quickdraft.sampling import argmax_rows

# attend(index, layer, qkv [rows, (Hq + 2 Hkv) d]) -> [rows, Hq d]: a runner's rope, cache write and attention.
Attend = Callable[[int, Layer, torch.Tensor], torch.Tensor]


def rms_norm_llama(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    # Llama rounds the normalised activations to the model dtype before the weight multiplies them; a float32
    # result (for a float32 residual stream's GGUF layers) is computed in float32 throughout, as llama.cpp does.
    if dtype == torch.float32:
        return weight.float() * F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return (weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(weight.dtype)).to(dtype)


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    # Gemma multiplies by (1 + w) in float32 (stored so in `weight`), then rounds.
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight).to(dtype)


def _of_weights(name: str) -> property:
    """A runner's read-only attribute that is its weights' attribute `name`."""
    return property(lambda self: getattr(self.weights, name))


class DecoderRunner:
    """A Llama-family or Gemma 3 decoder on quickdraft's own forward; a Runner (models/base.py), as HFRunner is.
    Subclasses are the backends; this class is not built on its own."""

    kind = "native"
    backend = ""  # the subclass's: "cpu-kernels", "torch", "cuda"
    packed_keys = False  # whether its caches keep keys in the CPU kernels' packed layout
    cache_class: type[StaticSequenceCache] = StaticSequenceCache

    def __init__(self, weights: DecoderWeights, name: str = "model"):
        self.weights = weights
        self.name = name
        self.forwards = 0

    @classmethod
    def from_model(cls, model: nn.Module, name: str = "model", quantized: QuantizedWeights | None = None):
        """This backend's runner of a transformers model (QuickdraftError where the family is not supported)."""
        return cls(DecoderWeights(model, name, quantized), name)

    def _derived(self, weights: DecoderWeights, name: str) -> "DecoderRunner":
        """The same backend over derived weights: its own state (counters, compiled loops, graphs) starts afresh."""
        return type(self)(weights, name)

    # --- the interface shared with HFRunner (models/base.Runner): the weights' figures ---
    model = _of_weights("model")  # the transformers model (weights it keeps quantized are released from it)
    text_config = _of_weights("text_config")
    device = _of_weights("device")
    dtype = _of_weights("dtype")
    vocab_size = _of_weights("vocab_size")
    max_len = _of_weights("max_len")
    quantized_weights = _of_weights("quantized_weights")
    quant_kernel_in_use = _of_weights("quant_kernel_in_use")
    num_layers = _of_weights("num_layers")
    num_kv_heads = _of_weights("num_kv_heads")
    head_dim = _of_weights("head_dim")
    weight_bytes = _of_weights("weight_bytes")

    @property
    def key_dtype(self) -> torch.dtype:
        """The key cache's dtype (the model's; the CPU kernels keep float16 keys beside a float32 stream)."""
        return self.weights.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * size

    @property
    def rows_invariant(self) -> bool:
        """Whether every row of a forward is computed alike whatever the other rows (the CPU kernels' property)."""
        return False

    def new_cache(self) -> StaticSequenceCache:
        return self.cache_class(self)

    def truncated(self, num_layers: int) -> "DecoderRunner":
        return self._derived(self.weights.truncated(num_layers), f"{self.name}[:{num_layers} layers]")

    def quantized(self, scheme: str) -> "DecoderRunner":
        return self._derived(self.weights.quantized(scheme), f"{self.name}[{scheme}]")

    def with_vocabulary(self, size: int) -> "DecoderRunner":
        """The same model scoring only token ids [0, size): its output head's first `size` rows, logits [n, size].
        A draft's smaller head (FR-Spec, Zhao et al. 2025): a byte-level BPE's low ids are its earliest merges,
        its most frequent pieces."""
        weights = self.weights.with_vocabulary(size, self.name)
        return self if weights is self.weights else self._derived(weights, f"{self.name}[vocab {size}]")

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ids [n] as the first layer reads them (Gemma's scale applied),
        [n, hidden] in the model's dtype: what an EAGLE head pairs with the target's features."""
        return self._input_rows(ids.to(self.device)).to(self.dtype)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] (after the final norm) -> float32 logits [n, V], softcapped where the
        family does."""
        logits = self.weights.lm_head(hidden.contiguous(), float_output=True).float()
        softcap = self.weights.final_softcap
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def output_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of output_logits [n]: the output layer's own (Linear.argmax, on the CPU kernels'
        blocks without writing the logits) where no softcap follows it (tanh may make near-ties ties)."""
        if self.weights.final_softcap is not None:
            return argmax_rows(self.output_logits(hidden))
        return self.weights.lm_head.argmax(hidden.contiguous())

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head.rows(ids)

    def final_norm_weight(self) -> torch.Tensor:
        return self.weights.final_norm_weight()

    def forward(self, cache: StaticSequenceCache, tokens: torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        """Append `tokens` [n] at positions len(cache)... and return the float32 logits of the last `num_logits`
        inputs, [num_logits, V]: forward_batch of one sequence."""
        return self.forward_batch([cache], [tokens], [num_logits])

    def forward_batch(self, caches: list[StaticSequenceCache], tokens: list[torch.Tensor], num_logits: list[int],
                      inputs_embeds: list[torch.Tensor] | None = None, return_hidden: bool = False,
                      trees: list[TreeAttention | None] | None = None, argmax_only: bool = False):
        """One forward over several sequences (continuous batching): sequence i appends tokens[i] [n_i]
        (n_i >= 1) at positions len(caches[i]).., and the result is the float32 logits of the last
        num_logits[i] (0..n_i) inputs of each sequence, concatenated in order: [sum(num_logits), V].

        All rows of all sequences go through each linear layer, norm and activation as one call (the weights
        are read once per step for the whole batch); rotary embedding, the cache write and attention run per
        sequence, on its own cache, positions and window.

        inputs_embeds: the first layer's input rows [n_i, hidden] per sequence instead of the tokens' embeddings
        (an EAGLE head's fused features; the tokens are still what the caches record).
        return_hidden: also return every input row's final hidden state after the final norm (what the output
        layer reads; EAGLE's features), [sum(n_i), hidden] in the model's dtype: (logits, hidden).
        trees: per sequence None or a TreeAttention ending at len(cache) + n_i (models/base.py): its tree rows sit
        at positions by depth and attend the prefix and their ancestors.
        argmax_only: each of those rows' argmax [sum(num_logits)] int64 instead of the logits (output_argmax)."""
        return self._eager_forward_batch(caches, tokens, num_logits, inputs_embeds, return_hidden, trees,
                                         self._layers, argmax_only)

    def _layers(self, x: torch.Tensor, caches: list[StaticSequenceCache], starts: list[int], counts: list[int],
                trees: list[TreeAttention | None] | None) -> torch.Tensor:
        """The decoder layers over rows x [num_tokens, hidden], the counts[i] rows of sequence i (at slots
        starts[i]..) after those of the sequences before it; trees per sequence None or its TreeAttention."""
        raise NotImplementedError

    # --- the forward's parts ---
    def _checked(self, caches: list, tokens: list, num_logits: list, inputs_embeds: list | None,
                 trees: list | None) -> tuple[list[torch.Tensor], list[TreeAttention | None] | None]:
        """What forward_batch checks before any cache changes: the token tensors flattened, and the trees (None
        when no sequence has one)."""
        flat = check_batch(self, caches, tokens, num_logits)
        trees = check_trees(self, caches, flat, trees)
        if inputs_embeds is not None and [int(e.shape[0]) for e in inputs_embeds] != [int(t.shape[0]) for t in flat]:
            raise QuickdraftError(f"{self.name}: inputs_embeds must give one row per token of each sequence")
        return flat, trees

    @torch.inference_mode()
    def _eager_forward_batch(self, caches, tokens, num_logits, inputs_embeds, return_hidden, trees,
                             layers: Callable, argmax_only: bool = False
                             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """forward_batch with the layers run by `layers` (a _layers of the runner), shapes as the rows come."""
        flat, trees = self._checked(caches, tokens, num_logits, inputs_embeds, trees)
        counts = [ids.shape[0] for ids in flat]
        starts = [len(cache) for cache in caches]
        ids = (flat[0] if len(flat) == 1 else torch.cat(flat)).to(self.device)  # [num_tokens]
        for cache, start, count in zip(caches, starts, counts):
            cache.reserve(start + count)
        if inputs_embeds is not None:
            x = (inputs_embeds[0] if len(inputs_embeds) == 1 else torch.cat(inputs_embeds)).to(
                self.weights.residual_dtype).contiguous()
        else:
            x = self._input_rows(ids)  # [num_tokens, hidden]
        x = layers(x, caches, starts, counts, trees)
        if ids.device.type == "cpu":  # the ids read once for every cache: no device tensor to keep per cache
            values, lo = ids.tolist(), 0
            for cache, count in zip(caches, counts):
                cache.record_ids(values[lo:lo + count])
                lo += count
        else:
            for cache, part in zip(caches, ids.split(counts) if len(caches) > 1 else (ids,)):
                cache.record(part)
        self.forwards += 1
        hidden = None
        if return_hidden:  # every row normed (a row is normed alike alone or among others), then selected
            x = self._final_norm(x)  # [num_tokens, hidden]
            hidden = x.to(self.dtype)  # what an EAGLE head reads: the model's dtype
        # The final norm and the output head on the selected rows only: the last num_logits[i] of sequence i.
        if len(caches) == 1:
            rows = x[counts[0] - int(num_logits[0]):]
        elif counts == list(num_logits):  # every row (a decode step's): no selection
            rows = x
        else:
            bounds = [0]
            for count in counts:
                bounds.append(bounds[-1] + count)
            rows = torch.cat([x[hi - int(k):hi] for hi, k in zip(bounds[1:], num_logits)])
        if rows.shape[0] == 0:
            logits = torch.zeros((0,) if argmax_only else (0, self.vocab_size),
                                 dtype=torch.long if argmax_only else torch.float32, device=self.device)
            return (logits, hidden) if return_hidden else logits
        if hidden is None:
            rows = self._final_norm(rows)
        # [sum(num_logits), vocab], or [sum(num_logits)]
        logits = self.output_argmax(rows) if argmax_only else self.output_logits(rows)
        return (logits, hidden) if return_hidden else logits

    def _input_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows for ids [n] (on the device): their embeddings, Gemma's scale applied, in the
        residual stream's dtype."""
        x = self.weights.embedding(ids)
        scale = self.weights.embed_scale
        return x * scale if scale is not None else x

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of rows x [n, hidden]: float32 rows where a float32 residual stream feeds an output head
        on GGUF blocks (as the other norms hand their GGUF layers), else the model's dtype."""
        w = self.weights
        return self._norm(x.contiguous(), w.final_norm, float_output=w.float_residual and w.lm_head.reads_float32)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, gemma_style: bool = False,
              float_output: bool = False) -> torch.Tensor:
        """RMSNorm of x (model dtype or float32) into the model's dtype, or float32 if float_output (for a float32
        residual stream: a Gemma post-norm that joins it, a norm feeding a layer that reads float32 rows)."""
        w = self.weights
        dtype = torch.float32 if float_output else w.dtype
        return (rms_norm_gemma if gemma_style or w.family.gemma_norms else rms_norm_llama)(x, weight, w.eps, dtype)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's activation of its gate times its up projection, [n, intermediate]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.weights.act(gate) * up

    def _rope(self, kind: str, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [>= end, head_dim] of rope kind `kind`, in the dtype the keys are roped in: float32 beside
        float16 keys, else the model's."""
        return self.weights.rope(kind, end, torch.float32 if self.key_dtype == torch.float16 else self.dtype)

    def _decoder_layers(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The layers over rows x [n, hidden], attention by `attend`: every norm, linear layer and activation takes
        all rows at once."""
        w = self.weights
        norm = self._norm
        wide = w.float_residual
        for index, layer in enumerate(w.layers):
            qkv = layer.qkv(norm(x, layer.input_norm, float_output=wide and layer.qkv.reads_float32),
                            float_output=wide)
            # float16 keys take q, k, v in float32 (see key_dtype); the model's dtype otherwise
            qkv = qkv.float() if self.key_dtype == torch.float16 else qkv.to(w.dtype)
            attn = attend(index, layer, qkv)  # [n, Hq * head_dim]
            attn = layer.o(attn if layer.o.reads_float32 else attn.to(w.dtype), float_output=wide)
            if layer.post_attn_norm is not None:
                attn = norm(attn, layer.post_attn_norm, float_output=wide)
            x = x + attn
            gate_up = layer.gate_up(norm(x, layer.pre_mlp_norm, float_output=wide and layer.gate_up.reads_float32))
            mlp = layer.down(self._gated(gate_up), float_output=wide)
            if layer.post_mlp_norm is not None:
                mlp = norm(mlp, layer.post_mlp_norm, float_output=wide)
            x = x + mlp
        return x

    def _roped(self, qkv: torch.Tensor, layer: Layer, cos_rows: torch.Tensor,
               sin_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [n, Hq, d] and keys [n, Hkv, d] normed (Qwen 3, Gemma 3) and roped by the rows' cos/sin [n, d],
        and values [n, Hkv, d], from qkv [n, (Hq + 2 Hkv) d] (torch ops)."""
        w = self.weights
        n, h_q, h_kv, d = qkv.shape[0], w.num_heads, w.num_kv_heads, w.head_dim
        qk = qkv[:, : (h_q + h_kv) * d].view(n, h_q + h_kv, d)  # queries and keys, roped together
        if layer.qk_norm is not None:
            qk = self._norm(qk.contiguous(), layer.qk_norm, gemma_style=True)
        # rotate_half(x) * sin == roll(x, d/2) * sin_signed (sin with its first half negated): exact.
        qk = qk * cos_rows[:, None] + qk.roll(d // 2, -1) * sin_rows[:, None]
        return qk[:, :h_q], qk[:, h_q:], qkv[:, (h_q + h_kv) * d:].view(n, h_kv, d)

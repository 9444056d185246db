"""Native decoder runners for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM) and Gemma 3.

Built from a loaded transformers model (so every source the loader accepts works, GGUF included): the
weights are taken once into fused matrices (q|k|v and gate|up), and a forward is a short loop of tensor
operations over a static KV cache that each sequence preallocates. Rolling back rejected draft tokens
is a change of length; nothing is copied or recomputed. forward_batch runs one forward over several
sequences (continuous batching): every linear layer, norm and activation takes all their rows in one call,
while rotary embedding, the cache write and attention run per sequence on its own cache.

Why not the transformers forward: per layer it dispatches through dozens of modules, builds masks and
cache updates in Python, and uses scaled_dot_product_attention, whose CPU kernel splits its work by the
number of queries. On CPUs with AVX512-BF16, a forward here is one call into quickdraft's C++ layer loop
(kernels/cpu_decoder.cpp) over kernels that compute every token's row the same way whatever the number of
tokens: a token's logits are bitwise the same whether it is verified alone or among K+1 tokens, and greedy
speculative output equals plain greedy output (tests/models/test_native.py checks this). Elsewhere (other CPUs,
CUDA, float32) the same loop runs in Python on torch ops, attention as two matmuls with a float32 softmax; on
CUDA its one-sequence forwards can be captured as CUDA graphs and replayed (use_cuda_graphs), since eagerly a
forward there is launch-bound.

What differs between the families is one row of settings each in models/families.py; config features no row
describes are refused by supports(), and those models run on the transformers forward
(tests/models/test_families.py checks every family and feature against transformers).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft import kernels
from quickdraft.errors import QuickdraftError
from quickdraft.kernels.quant import QuantizedWeight
from quickdraft.kv.static_cache import StaticSequenceCache
from quickdraft.models.base import QUANTIZATION_SCHEMES, TreeAttention, check_batch, check_trees
from quickdraft.models.config import get_text_config
from quickdraft.models.families import FAMILIES, NO_ROPE, STATIC_ROPE_TYPES, FamilySettings, sliding_window, \
    unsupported_reason
from quickdraft.models.gguf_weights import QuantizedWeights
from quickdraft.models.linear import BlockLinear, Linear, blocks_fit, dense_linear, fused_bias
from quickdraft.models.tree_mask import tree_positions, tree_visibility

# (Linear and QUANTIZATION_SCHEMES, defined here before models/linear.py and models/base.py, import from here still.)

SUPPORTED = set(FAMILIES)
GRAPHS_KEPT = 8  # CUDA graphs a runner keeps (each holds its activations' memory): the last caches' row counts
GRAPH_MAX_ROWS = 64  # forwards of more rows (prefills) are eager: launches are a small part of them


def supports(model: nn.Module) -> str | None:
    """None when `model` can run natively, else the reason it cannot (a family the runner lacks, or a config
    feature of the family that it does not implement: see models/families.py)."""
    config = get_text_config(model.config)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"architecture {kind!r} has no native runner (native: {', '.join(sorted(SUPPORTED))})"
    inner = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return f"{type(model).__name__} has no decoder layer list"
    reason = unsupported_reason(FAMILIES[kind], config)
    if reason:
        return reason
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        return f"{type(model).__name__} has no rotary embedding module"
    rope_types = getattr(rotary, "rope_type", "default")
    rope_types = set(rope_types.values()) if isinstance(rope_types, dict) else {rope_types}
    if not rope_types <= STATIC_ROPE_TYPES:
        return (f"rope type {', '.join(sorted(map(str, rope_types - STATIC_ROPE_TYPES)))} has no native runner "
                f"(native: {', '.join(sorted(STATIC_ROPE_TYPES))})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for name, buffer in rotary.named_buffers():
        if name.endswith("inv_freq") and 2 * buffer.numel() != head_dim:  # partial rotary embedding
            return f"rotary embedding over {2 * buffer.numel()} of {head_dim} head dimensions has no native runner"
    return None


# --- weights (the linear layers themselves: models/linear.py) -------------------------------------------------

@dataclass
class Layer:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    input_norm: torch.Tensor
    # Llama: the norm before the MLP. Gemma 3: norms after attention, before and after the MLP.
    pre_mlp_norm: torch.Tensor
    post_attn_norm: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [q_heads + kv_heads, head_dim]: per-head norms of queries then keys
    sliding_window: int | None
    rope: str  # key of the cos/sin table this layer uses


def _release(modules: list[nn.Module]) -> None:
    """Drop the transformers model's copy of weights the runner holds quantized: a weight on the meta device
    keeps its shape and dtype (so the model still describes itself) and holds no memory."""
    for module in modules:
        weight = module.weight
        module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def _widen_packed(parts: list[QuantizedWeight | None], modules: tuple[nn.Linear, ...], dtype: torch.dtype) -> None:
    """A fused group (q|k|v, gate|up) runs dense when some part has no quantized kernel (a Q5_K_M file of a small
    model keeps q and k in Q5_1 beside a Q8_0 v): the direct GGUF loader left the packed parts' layers on meta, so
    those take their blocks' exact values, in the model's dtype, as the transformers path would have."""
    for part, module in zip(parts, modules):
        if part is not None and module.weight.device.type == "meta":
            weight = kernels.quant_kernels(dtype).dequantize_rows(part.packed, part.qtype, torch.arange(part.rows),
                                                                  part.cols)
            module.weight = nn.Parameter(weight.to(dtype), requires_grad=False)


# --- the runner -----------------------------------------------------------------------------------------------

def _kernel_trees(trees: list[TreeAttention | None] | None) -> tuple[list[int], list[torch.Tensor]]:
    """The kernels' form of the trees (cpu_attention.cpp's cache_segments): per sequence its base slot (0: none)
    and its parent slots as an int64 tensor; empty lists when no sequence has a tree."""
    if trees is None:
        return [], []
    return ([0 if t is None else t.base for t in trees],
            [torch.empty(0, dtype=torch.long) if t is None else torch.tensor(t.parents, dtype=torch.long)
             for t in trees])


def _rms_norm_llama(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    # Llama rounds the normalised activations to the model dtype before the weight multiplies them; a float32
    # result (for a float32 residual stream's GGUF layers) is computed in float32 throughout, as llama.cpp does.
    if dtype == torch.float32:
        return weight.float() * F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return (weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(weight.dtype)).to(dtype)


def _rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    # Gemma multiplies by (1 + w) in float32 (stored so in `weight`), then rounds.
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight).to(dtype)


def _visible_keys(positions: torch.Tensor, capacity: int, window: int | None) -> torch.Tensor:
    """Which of key slots 0..capacity each query at `positions` [n] (a device tensor) sees, [n, capacity] bool:
    the causal ones within the sliding window (slots past the sequence none)."""
    k_pos = torch.arange(capacity, device=positions.device)[None, :]
    q_pos = positions[:, None]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def _additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    """A bool visibility [n, keys] as the additive mask attention adds to its scores: 0 where seen, -inf elsewhere."""
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class NativeRunner:
    """A Llama-family or Gemma 3 decoder with a static KV cache; a Runner (models/base.py), as HFRunner is."""

    kind = "native"

    def __init__(self, model: nn.Module, name: str = "model", quantized: QuantizedWeights | None = None):
        """quantized: the GGUF file's own blocks for the linear layers and the embedding (models/gguf_weights);
        used on CPUs with quickdraft's kernels in bf16, where the transformers model's copies of those weights
        are then released (one resident copy, in the stored format)."""
        reason = supports(model)
        if reason:
            raise QuickdraftError(f"{name}: {reason}; use runner='hf'")
        self.name = name
        self.model = model  # kept for its rotary module and for methods that need the transformers model
        config = self.text_config = get_text_config(model.config)
        family = self.family = FAMILIES[config.model_type]
        inner = getattr(model, getattr(model, "base_model_prefix", "model"))
        # The first real parameter: a skeleton from models/gguf_loader keeps its packed matrices on meta.
        first = next(p for p in model.parameters() if p.device.type != "meta")
        self.device, self.dtype = first.device, first.dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.max_len = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.forwards = 0
        self.scale = (getattr(config, family.query_scale) if family.query_scale else self.head_dim) ** -0.5
        self.embed = inner.embed_tokens.weight.detach()
        self.embed_quantized: QuantizedWeight | None = None
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the model's dtype.
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=self.dtype).item()
                            if family.embed_scale else None)
        self.final_softcap = getattr(config, "final_logit_softcapping", None) if family.final_softcap else None
        from transformers.activations import ACT2FN
        activation = getattr(config, family.activation)
        self.act: Callable = ACT2FN[activation]
        # quickdraft's CPU kernels for attention and norms (bf16 on AVX512-BF16 CPUs); torch otherwise.
        self._cpu_kernels = None
        if (self.device.type == "cpu" and self.dtype == torch.bfloat16 and self.head_dim % 16 == 0
                and config.hidden_size % 16 == 0):
            self._cpu_kernels = kernels.cpu_linear()
        self._no_tensor = torch.empty(0)
        self.packed_keys = self._cpu_kernels is not None  # the layout the kernels' attention reads
        self._decoder = None  # the C++ layer loop, built on first use (see _native_decoder)
        # CUDA graphs of one sequence's forwards (see _positional_forward): opt-in with QUICKDRAFT_CUDA_GRAPHS=1 or
        # `use_cuda_graphs`; the graphs of the caches seen last, by (cache tensors, rows, logits).
        self.cuda_graphs = self.device.type == "cuda" and os.environ.get("QUICKDRAFT_CUDA_GRAPHS", "") == "1"
        self._graphs: OrderedDict = OrderedDict()
        # The fused kernel knows SiLU (False) and tanh-approximated GELU (True); other activations use torch.
        self._fused_activation = None if self._cpu_kernels is None else \
            {"silu": False, "swish": False, "gelu_pytorch_tanh": True}.get(activation)
        gemma_norms = family.gemma_norms
        norm = (lambda m: (1.0 + m.weight.detach().float())) if gemma_norms else (lambda m: m.weight.detach())
        sandwich = family.sandwich_norms

        if quantized is not None and not (self.device.type == "cpu" and kernels.quant_kernels(self.dtype) is not None):
            quantized = None  # no quantized kernel for these activations on this CPU: dense weights
        self.quantized_weights = quantized
        # The residual stream (the hidden states between layers) of a GGUF model on its own blocks is float32,
        # as llama.cpp keeps it: bf16 sums lose the small updates of later layers to large channels (measured
        # in benchmarks/RESULTS.md, session 21). The norms hand GGUF layers float32 rows and other layers
        # model-dtype ones; attention, the KV cache and the other weights keep the model's dtype.
        self.residual_dtype = torch.float32 if quantized is not None else self.dtype
        # The integer scheme of the blocks' activations: the family's measured choice where it applies.
        self.quant_kernel = kernels.model_quant_kernel(family.quant_kernel) if quantized is not None else ""
        released: list[nn.Module] = []

        def linear(index: int, roles: tuple[str, ...], modules: tuple[nn.Linear, ...]) -> Linear:
            parts = [quantized.get(index, role) for role in roles] if quantized is not None else []
            if blocks_fit(parts, modules):
                released.extend(modules)
                return BlockLinear(parts, fused_bias(modules), dtype=self.dtype, quant_kernel=self.quant_kernel)
            _widen_packed(parts, modules, self.dtype)
            return dense_linear(modules)

        self.layers: list[Layer] = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(Layer(
                qkv=linear(i, ("q", "k", "v"), (attn.q_proj, attn.k_proj, attn.v_proj)),
                o=linear(i, ("o",), (attn.o_proj,)),
                gate_up=linear(i, ("gate", "up"), (mlp.gate_proj, mlp.up_proj)),
                down=linear(i, ("down",), (mlp.down_proj,)),
                input_norm=norm(layer.input_layernorm),
                pre_mlp_norm=norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                post_attn_norm=norm(layer.post_attention_layernorm) if sandwich else None,
                post_mlp_norm=norm(layer.post_feedforward_layernorm) if sandwich else None,
                qk_norm=self._qk_norm(attn, norm),
                sliding_window=sliding_window(family, config, i), rope=self._rope_key(family, config, attn, i)))
        self.final_norm = norm(inner.norm)
        output = model.get_output_embeddings()
        head = None
        if quantized is not None:
            head = quantized.output if quantized.output is not None else (
                quantized.embedding if quantized.tied and output.weight is inner.embed_tokens.weight else None)
        if head is not None and head.rows == output.weight.shape[0] and head.cols == output.weight.shape[1]:
            self.lm_head = BlockLinear([head], None if output.bias is None else output.bias.detach(), dtype=self.dtype,
                                       quant_kernel=self.quant_kernel)
            released.append(output)
        else:
            self.lm_head = dense_linear((output,))
        if quantized is not None and quantized.embedding is not None and \
                quantized.embedding.cols == self.embed.shape[1] and quantized.embedding.rows >= self.embed.shape[0]:
            self.embed_quantized = quantized.embedding
            released.append(inner.embed_tokens)
        _release(released)
        if self.embed_quantized is not None:
            self.embed = None
        self.vocab_size = self.lm_head.out_features
        self._rotary = inner.rotary_emb
        self._rope_tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _rope_key(family: FamilySettings, config, attn: nn.Module, index: int) -> str:
        """The cos/sin table of layer `index`: none (a no-RoPE layer), its layer type's (Gemma 3), or the model's."""
        if family.no_rope_layers:  # SmolLM3: no_rope_layers[index] == 0 marks a layer without RoPE
            flags = getattr(config, "no_rope_layers", None)
            if not getattr(attn, "use_rope", flags[index] if flags else 1):
                return NO_ROPE
        if family.rope_by_layer_type:
            return config.layer_types[index]
        return "default"

    def _qk_norm(self, attn: nn.Module, norm: Callable) -> torch.Tensor | None:
        if not hasattr(attn, "q_norm"):
            return None
        q, k = norm(attn.q_norm).float(), norm(attn.k_norm).float()
        return torch.cat([q.expand(self.num_heads, -1), k.expand(self.num_kv_heads, -1)])

    # --- derived runners (share every tensor they do not change) ---
    def truncated(self, num_layers: int) -> "NativeRunner":
        """The first `num_layers` layers, then the final norm and output head (a self-draft)."""
        total = len(self.layers)
        if not 1 <= num_layers <= total:
            raise QuickdraftError(f"layer_skip: num_layers must be in [1, {total}] for this model, got {num_layers}")
        view = self._copy(f"{self.name}[:{num_layers} layers]")
        view.layers = self.layers[:num_layers]
        return view

    def quantized(self, scheme: str) -> "NativeRunner":
        """The same model with weight-only quantized linear layers (the embedding and norms are shared):
        `int8` (per-output scales) or `q4` (4-bit codes, a float16 scale and min per 32 inputs: GGML's Q4_1,
        on the quantized kernels; int8 where those cannot run; a GGUF file's 4-bit blocks stay as stored)."""
        if scheme not in QUANTIZATION_SCHEMES:
            raise QuickdraftError(f"unknown quantization {scheme!r}; supported: {', '.join(QUANTIZATION_SCHEMES)}")
        if self.device.type != "cpu" and self.device.type != "cuda":
            raise QuickdraftError(f"{scheme} weights need a CPU or CUDA device, not {self.device.type}")

        def convert(linear: Linear) -> Linear:  # the layer's own method (BlockLinear keeps its 4-bit parts)
            return linear.int8() if scheme == "int8" else linear.q4()

        view = self._copy(f"{self.name}[{scheme}]")
        view.layers = [Layer(**{**layer.__dict__, **{name: convert(getattr(layer, name))
                                                     for name in ("qkv", "o", "gate_up", "down")}})
                       for layer in self.layers]
        view.lm_head = convert(self.lm_head)
        return view

    def with_vocabulary(self, size: int) -> "NativeRunner":
        """The same model scoring only token ids [0, size): its output head's first `size` rows (a prefix of the
        packed weight, so a step reads only those), logits [n, size]. A draft's smaller head (FR-Spec, Zhao et
        al. 2025): a byte-level BPE's low ids are its earliest merges, its most frequent pieces."""
        if not 0 < size <= self.vocab_size:
            raise QuickdraftError(f"{self.name}: a vocabulary of {size} tokens; give 1..{self.vocab_size}")
        if size == self.vocab_size:
            return self
        view = self._copy(f"{self.name}[vocab {size}]")
        view.lm_head = self.lm_head.leading(size)
        view.vocab_size = size
        return view

    def _copy(self, name: str) -> "NativeRunner":
        view = object.__new__(NativeRunner)
        view.__dict__.update(self.__dict__)
        view.name, view.forwards, view._decoder = name, 0, None
        view._graphs = OrderedDict()  # a graph captures its runner's layers: a view captures its own
        return view

    def _native_decoder(self):
        """The C++ loop over this runner's layers (kernels/cpu_decoder.cpp), or None where some layer needs
        torch: no kernels, an activation the kernels lack, a linear layer the kernels cannot take."""
        if self._decoder is None:
            linears = [getattr(layer, name) for layer in self.layers for name in ("qkv", "o", "gate_up", "down")]
            if self._cpu_kernels is None or self._fused_activation is None or not all(
                    linear.on_cpu_kernels for linear in linears):
                self._decoder = False
            else:
                decoder = self._cpu_kernels.Decoder(self.num_heads, self.eps, self.scale, self.family.gemma_norms,
                                                    self._fused_activation)
                kinds = sorted({layer.rope for layer in self.layers})
                for layer in self.layers:
                    decoder.add_layer(*(getattr(layer, name).spec() for name in ("qkv", "o", "gate_up", "down")),
                                      layer.input_norm, layer.pre_mlp_norm, layer.post_attn_norm,
                                      layer.post_mlp_norm, layer.qk_norm, layer.sliding_window or 0,
                                      kinds.index(layer.rope))
                self._decoder = (decoder, kinds)
        return self._decoder or None

    # --- the interface shared with HFRunner ---
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_bytes_per_token(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * size

    @property
    def quant_kernel_in_use(self) -> str | None:
        if self.quantized_weights is None:
            return None
        module = kernels.quant_kernels(self.dtype)
        return module.quant_kernel(self.quant_kernel) if module is not None else None

    @property
    def rows_invariant(self) -> bool:
        """Whether every row of a forward is computed alike whatever the other rows of the call: quickdraft's
        CPU kernels for every layer, bf16 weights (int8 ones widen differently from 32 rows on)."""
        linears = [self.lm_head] + [getattr(layer, name) for layer in self.layers
                                    for name in ("qkv", "o", "gate_up", "down")]
        return self._cpu_kernels is not None and self._fused_activation is not None and all(
            linear.rows_alike for linear in linears)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decoding step reads (the embedding rows it gathers are negligible)."""
        total = self.lm_head.nbytes
        for layer in self.layers:
            total += layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes + layer.down.nbytes
        return total

    def new_cache(self) -> StaticSequenceCache:
        return StaticSequenceCache(self)

    @property
    def key_dtype(self) -> torch.dtype:
        """The key cache's dtype: float16 for a float32 residual stream on the kernels (llama.cpp's f16 keys,
        read by float32 queries), else the model's (see kernels/cpu_attention.cpp)."""
        return torch.float16 if self._float_residual and self.packed_keys else self.dtype

    def _rope(self, kind: str, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [>= end, head_dim] of rope kind `kind` (sin's first half negated), in the dtype the
        kernels' rope reads: float32 beside float16 keys, else the model's."""
        dtype = torch.float32 if self.key_dtype == torch.float16 else self.dtype
        table = self._rope_tables.get((kind, dtype))
        if table is None or table[0].shape[0] < end:
            size = max(end, 2 * (table[0].shape[0] if table else 0), 512)
            if kind == NO_ROPE:  # x * 1 + rotate(x) * 0 == x exactly: no rotation, in every loop
                table = self._rope_tables[(kind, dtype)] = (
                    torch.ones(size, self.head_dim, dtype=dtype, device=self.device),
                    torch.zeros(size, self.head_dim, dtype=dtype, device=self.device))
                return table
            positions = torch.arange(size, device=self.device)[None]
            probe = torch.empty(0, dtype=dtype, device=self.device)
            if self.family.rope_by_layer_type:
                cos, sin = self._rotary(probe, positions, kind)
            else:
                cos, sin = self._rotary(probe, positions)
            sin = sin[0].clone()
            sin[:, : sin.shape[1] // 2].neg_()
            table = self._rope_tables[(kind, dtype)] = (cos[0], sin)
        return table

    @property
    def _float_residual(self) -> bool:
        """Whether the residual stream is float32 where the model's dtype is not (a GGUF model on its blocks)."""
        return self.residual_dtype == torch.float32 and self.dtype != torch.float32

    def _embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ids [n] in the residual stream's dtype (the quantized table's rows are float32)."""
        if self.embed_quantized is not None:
            table = self.embed_quantized
            return kernels.quant_kernels(self.dtype).dequantize_rows(table.packed, table.qtype, ids,
                                                                     table.cols).to(self.residual_dtype)
        return F.embedding(ids, self.embed).to(self.residual_dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, gemma_style: bool = False,
              float_output: bool = False) -> torch.Tensor:
        """RMSNorm of x (model dtype or float32) into the model's dtype, or float32 if float_output (for a float32
        residual stream: a Gemma post-norm that joins it, a norm feeding a layer that reads float32 rows)."""
        gemma_style = gemma_style or self.family.gemma_norms
        if self._cpu_kernels is not None:
            return self._cpu_kernels.rms_norm(x, weight, self.eps, not gemma_style, float_output)
        dtype = torch.float32 if float_output else self.dtype
        return (_rms_norm_gemma if gemma_style else _rms_norm_llama)(x, weight, self.eps, dtype)

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   window: int | None, masks: dict, tree: TreeAttention | None = None) -> torch.Tensor:
        """Torch attention of queries q [n, Hq, d] at positions start.. over keys/values [Hkv, end, d]; with a
        tree, the queries of slots start.. see what it says (models/tree_mask.py), the window by position."""
        n, h_q, d = q.shape
        h_kv, end = keys.shape[0], keys.shape[1]
        group = h_q // h_kv
        mask = masks.get(window)
        if mask is None:
            allowed = (tree_visibility(tree, start, window).to(q.device) if tree is not None  # [n, end]
                       else _visible_keys(torch.arange(start, end, device=q.device), end, window))
            mask = masks[window] = _additive_mask(allowed)
        # Grouped-query attention without repeating keys: a kv head's queries are rows of one matmul.
        q = q.reshape(n, h_kv, group, d).permute(1, 2, 0, 3).reshape(h_kv, group * n, d)
        scores = (q @ keys.transpose(1, 2)).view(h_kv, group, n, end)
        probs = torch.add(mask, scores, alpha=self.scale).softmax(-1).to(q.dtype)  # float32 softmax
        attn = probs.view(h_kv, group * n, end) @ values
        return attn.view(h_kv, group, n, d).permute(2, 0, 1, 3).reshape(n, h_q * d)

    def _layers(self, x: torch.Tensor, caches: list[StaticSequenceCache], starts: list[int],
                counts: list[int], trees: list[TreeAttention | None] | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers in Python: the kernels one by one where they apply, torch ops elsewhere.
        x: [num_tokens, hidden], the counts[i] rows of sequence i (at slots starts[i]..) after those of the
        sequences before it. Linear layers, norms and the activation take all rows at once; the cache write and
        attention run per sequence, on its own cache. trees: per sequence None (causal rows at positions equal
        to their slots) or the TreeAttention its rows form (end starts[i] + counts[i], checked by the caller):
        each row is roped at the tree's position for its slot and attends as the tree says.
        positions: one sequence's slots as a device tensor [n] (torch ops only): every shape is then independent of
        where the rows sit (rope rows gathered, the cache written by index, attention over the whole capacity with
        a mask built on the device), so the same kernels serve every position: what a CUDA graph needs."""
        n = x.shape[0]
        h_q, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        ends = [start + count for start, count in zip(starts, counts)]
        bounds = [0]  # rows of sequence i: bounds[i]:bounds[i + 1]
        for count in counts:
            bounds.append(bounds[-1] + count)
        keys_list, values_list = [cache.keys for cache in caches], [cache.values for cache in caches]
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: list[dict[int | None, torch.Tensor]] = [{} for _ in caches]  # per sequence, per window
        fast = self._cpu_kernels
        trees = trees or [None] * len(caches)
        bases, parents = _kernel_trees(trees if any(tree is not None for tree in trees) else None)
        # The rows of each sequence's positions in the rope tables: its slots, or its tree's positions.
        rope_rows = [slice(start, end) if tree is None else tree_positions(tree)[start:].to(self.device)
                     for start, end, tree in zip(starts, ends, trees)]
        norm = self._norm
        wide = self._float_residual
        for index, layer in enumerate(self.layers):
            if layer.rope not in ropes:
                cos, sin = self._rope(layer.rope, max(ends))
                if positions is not None:  # gathered on the device: [n, head_dim]
                    cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
                elif fast is None:  # the rows of every token's position: [num_tokens, head_dim]
                    cos = torch.cat([cos[rows] for rows in rope_rows]) if len(caches) > 1 else cos[rope_rows[0]]
                    sin = torch.cat([sin[rows] for rows in rope_rows]) if len(caches) > 1 else sin[rope_rows[0]]
                ropes[layer.rope] = (cos, sin)  # the kernels take whole tables, indexed by position
            cos_rows, sin_rows = ropes[layer.rope]

            qkv = layer.qkv(norm(x, layer.input_norm, float_output=wide and layer.qkv.reads_float32),
                            float_output=wide)
            # float16 keys take q, k, v in float32 (see key_dtype); the model's dtype otherwise
            qkv = qkv.float() if self.key_dtype == torch.float16 else qkv.to(self.dtype)
            if fast is not None:
                q = fast.rope_and_cache_segments(qkv, h_q, self._no_tensor if layer.qk_norm is None else layer.qk_norm,
                                                 self.eps, cos_rows, sin_rows, keys_list, values_list, index, starts,
                                                 counts, bases, parents)  # [num_tokens, Hq, head_dim]
                attn = fast.attention_segments(q, h_q, keys_list, values_list, index, starts, counts,
                                               layer.sliding_window or 0, self.scale, bases,
                                               parents)  # [num_tokens, Hq * head_dim]
            else:
                qk = qkv[:, : (h_q + h_kv) * d].view(n, h_q + h_kv, d)  # queries and keys, roped together
                if layer.qk_norm is not None:
                    qk = norm(qk.contiguous(), layer.qk_norm, gemma_style=True)
                # rotate_half(x) * sin == roll(x, d/2) * sin_signed (sin with its first half negated): exact.
                qk = qk * cos_rows[:, None] + qk.roll(d // 2, -1) * sin_rows[:, None]
                if positions is not None:  # one sequence, every shape independent of its slots
                    keys, values = keys_list[0][index], values_list[0][index]  # [Hkv, capacity, d]
                    keys.index_copy_(1, positions, qk[:, h_q:].transpose(0, 1).to(keys.dtype))
                    values.index_copy_(1, positions, qkv[:, (h_q + h_kv) * d:].view(n, h_kv, d).transpose(0, 1))
                    if layer.sliding_window not in masks[0]:
                        masks[0][layer.sliding_window] = _additive_mask(
                            _visible_keys(positions, keys.shape[1], layer.sliding_window))
                    attn = self._attention(qk[:, :h_q], keys, values, 0, layer.sliding_window, masks[0])
                else:
                    parts = []
                    for i, (start, end) in enumerate(zip(starts, ends)):
                        lo, hi = bounds[i], bounds[i + 1]
                        keys, values = keys_list[i][index], values_list[i][index]
                        keys[:, start:end] = qk[lo:hi, h_q:].transpose(0, 1)
                        values[:, start:end] = qkv[lo:hi, (h_q + h_kv) * d:].view(hi - lo, h_kv, d).transpose(0, 1)
                        parts.append(self._attention(qk[lo:hi, :h_q], keys[:, :end], values[:, :end], start,
                                                     layer.sliding_window, masks[i], trees[i]))
                    attn = parts[0] if len(parts) == 1 else torch.cat(parts)  # [num_tokens, Hq * head_dim]
            attn = layer.o(attn if layer.o.reads_float32 else attn.to(self.dtype), float_output=wide)
            if layer.post_attn_norm is not None:
                attn = norm(attn, layer.post_attn_norm, float_output=wide)
            x = x + attn

            gate_up = layer.gate_up(norm(x, layer.pre_mlp_norm, float_output=wide and layer.gate_up.reads_float32))
            if self._fused_activation is not None:
                mlp = layer.down(fast.gated_activation(gate_up, self._fused_activation), float_output=wide)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                mlp = layer.down(self.act(gate) * up, float_output=wide)
            if layer.post_mlp_norm is not None:
                mlp = norm(mlp, layer.post_mlp_norm, float_output=wide)
            x = x + mlp
        return x

    def forward(self, cache: StaticSequenceCache, tokens: torch.Tensor, num_logits: int = 1,
                use_decoder: bool = True) -> torch.Tensor:
        """Append `tokens` [n] at positions len(cache)... and return the float32 logits of the last
        `num_logits` inputs, [num_logits, V]: forward_batch of one sequence. use_decoder=False runs the layer
        loop in Python even where the C++ loop could (the same kernels, so the same bits; for tests)."""
        return self.forward_batch([cache], [tokens], [num_logits], use_decoder=use_decoder)

    def _static_forward(self, cache: StaticSequenceCache, ids: torch.Tensor, positions: torch.Tensor,
                        num_logits: int) -> torch.Tensor:
        """One sequence's rows ids [n] at slots `positions` [n] (device tensors), cache reserved: float32 logits
        [num_logits, V]. No shape depends on the positions: the kernels are the same at every step."""
        n = ids.shape[0]
        # starts: only the rope tables' length reads it here (they must cover every slot of the capacity).
        x = self._layers(self._input_rows(ids), [cache], [cache.capacity - n], [n], None, positions=positions)
        if num_logits == 0:
            return torch.zeros((0, self.vocab_size), dtype=torch.float32, device=self.device)
        return self.output_logits(self._final_norm(x[n - num_logits:]))

    def _positional_forward(self, cache: StaticSequenceCache, ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """forward of one sequence on the position-independent path (`cuda_graphs`). On CUDA each (cache storage,
        rows, logits) is captured once as a CUDA graph and replayed: a step is one launch instead of ~35 a layer
        (RESULTS.md, session 32: an eager forward of a 1.5B is launch-bound, 11-19 ms whatever its rows; its graph
        replays in ~3 ms). Elsewhere the same path runs eagerly (what the tests check on the CPU). A cache that
        grows gets a new storage and so new graphs; the graphs of the last GRAPHS_KEPT keys are kept."""
        n, start = ids.shape[0], len(cache)
        cache.reserve(start + n)
        if not cache.free_slots_finite:  # attended under the mask: a cache made before the path was on
            cache.zero_free_slots()
        if self.device.type != "cuda":
            logits = self._static_forward(cache, ids.to(self.device),
                                          torch.arange(start, start + n, device=self.device), num_logits)
        else:
            # A graph reads and writes fixed addresses: it serves whichever cache has these tensors now.
            key = (cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity, n, num_logits)
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._graphs[key] = self._capture(cache, start, n, num_logits)
                while len(self._graphs) > GRAPHS_KEPT:
                    self._graphs.popitem(last=False)
            self._graphs.move_to_end(key)
            graph, static_ids, static_positions, static_logits, _ = entry
            static_ids.copy_(ids)
            static_positions.copy_(torch.arange(start, start + n))
            graph.replay()
            logits = static_logits.clone()  # the next replay overwrites the graph's output
        cache.record(ids)
        self.forwards += 1
        return logits

    def _capture(self, cache: StaticSequenceCache, start: int, n: int, num_logits: int):
        """A CUDA graph of _static_forward on `cache` for n rows: (graph, its ids, its positions, its logits, the
        rope tables it reads). Warmed up twice on a side stream first, as torch asks (the warm-ups write slots
        start.. of this cache, which the step's own replay then overwrites; the rope tables are built then, not
        inside the capture, and the entry keeps them alive: a longer cache later replaces them in _rope_tables)."""
        static_ids = torch.zeros(n, dtype=torch.long, device=self.device)
        static_positions = torch.arange(start, start + n, device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._static_forward(cache, static_ids, static_positions, num_logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = self._static_forward(cache, static_ids, static_positions, num_logits)
        return graph, static_ids, static_positions, static_logits, list(self._rope_tables.values())

    def use_cuda_graphs(self, enabled: bool = True) -> None:
        """Turn the position-independent path (CUDA graphs on CUDA) on or off for this runner's forwards."""
        if enabled and self.packed_keys:
            raise QuickdraftError(f"{self.name}: CUDA graphs are for torch's layer loop; this runner uses the CPU "
                                  "kernels")
        self.cuda_graphs = enabled
        self._graphs.clear()

    def _input_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows for ids [n] (on the device): their embeddings, Gemma's scale applied, in the
        residual stream's dtype."""
        x = self._embedding(ids)
        return x * self.embed_scale if self.embed_scale is not None else x

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of rows x [n, hidden]: float32 rows where a float32 residual stream feeds an output head
        on GGUF blocks (as the other norms hand their GGUF layers), else the model's dtype."""
        return self._norm(x.contiguous(), self.final_norm,
                          float_output=self._float_residual and self.lm_head.reads_float32)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ids [n] as the first layer reads them (Gemma's scale applied),
        [n, hidden] in the model's dtype: what an EAGLE head pairs with the target's features."""
        return self._input_rows(ids.to(self.device)).to(self.dtype)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] (after the final norm) -> float32 logits [n, V], softcapped where the
        family does."""
        logits = self.lm_head(hidden.contiguous(), float_output=True).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head.rows(ids)

    def final_norm_weight(self) -> torch.Tensor:
        """The transformers model's own final norm weight (Gemma's: w, where the runner keeps 1 + w)."""
        inner = getattr(self.model, getattr(self.model, "base_model_prefix", "model"))
        return inner.norm.weight.detach().float().cpu()

    @torch.inference_mode()
    def forward_batch(self, caches: list[StaticSequenceCache], tokens: list[torch.Tensor], num_logits: list[int],
                      use_decoder: bool = True, inputs_embeds: list[torch.Tensor] | None = None,
                      return_hidden: bool = False, trees: list[TreeAttention | None] | None = None):
        """One forward over several sequences (continuous batching): sequence i appends tokens[i] [n_i]
        (n_i >= 1) at positions len(caches[i]).., and the result is the float32 logits of the last
        num_logits[i] (0..n_i) inputs of each sequence, concatenated in order: [sum(num_logits), V].

        All rows of all sequences go through each linear layer, norm and activation as one call (the weights
        are read once per step for the whole batch); rotary embedding, the cache write and attention run per
        sequence, on its own cache, positions and window. On the CPU kernels every row is computed alike
        whatever the other rows, so each sequence's logits and cache are bitwise those of `forward` on it
        alone (int8 linear layers: while the batch has fewer than 32 rows, see kernels/cpu_linear.cpp).

        inputs_embeds: the first layer's input rows [n_i, hidden] per sequence instead of the tokens' embeddings
        (an EAGLE head's fused features; the tokens are still what the caches record).
        return_hidden: also return every input row's final hidden state after the final norm (what the output
        layer reads; EAGLE's features), [sum(n_i), hidden] in the model's dtype: (logits, hidden).
        trees: per sequence None or a TreeAttention ending at len(cache) + n_i (models/base.py): its tree rows sit at
        positions by depth and attend the prefix and their ancestors; on the CPU kernels a tree node's logits and
        keys are bitwise those of its path's tokens fed in a line."""
        flat = check_batch(self, caches, tokens, num_logits)  # before any cache changes
        trees = check_trees(self, caches, flat, trees)
        # (cuda_graphs is never on beside the CPU kernels' packed keys: use_cuda_graphs refuses them.)
        if (self.cuda_graphs and len(caches) == 1 and flat[0].shape[0] <= GRAPH_MAX_ROWS and inputs_embeds is None
                and not return_hidden and (trees is None or trees[0] is None)):
            return self._positional_forward(caches[0], flat[0], int(num_logits[0]))
        if inputs_embeds is not None and [int(e.shape[0]) for e in inputs_embeds] != [int(t.shape[0]) for t in flat]:
            raise QuickdraftError(f"{self.name}: inputs_embeds must give one row per token of each sequence")
        counts = [ids.shape[0] for ids in flat]
        starts = [len(cache) for cache in caches]
        ends = [start + count for start, count in zip(starts, counts)]
        ids = (flat[0] if len(flat) == 1 else torch.cat(flat)).to(self.device)  # [num_tokens]
        for cache, end in zip(caches, ends):
            cache.reserve(end)
        if inputs_embeds is not None:
            x = (inputs_embeds[0] if len(inputs_embeds) == 1 else torch.cat(inputs_embeds)).to(
                self.residual_dtype).contiguous()
        else:
            x = self._input_rows(ids)  # [num_tokens, hidden]
        decoder = self._native_decoder() if use_decoder else None
        if decoder is not None:
            decoder, kinds = decoder
            tables = [self._rope(kind, max(ends)) for kind in kinds]  # whole tables, indexed by position
            bases, parents = _kernel_trees(trees)
            x = decoder.forward_batch(x, [cache.keys for cache in caches], [cache.values for cache in caches],
                                      starts, counts, [cos for cos, _ in tables], [sin for _, sin in tables],
                                      bases, parents)
        else:
            x = self._layers(x, caches, starts, counts, trees)

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
        else:
            bounds = [0]
            for count in counts:
                bounds.append(bounds[-1] + count)
            rows = torch.cat([x[hi - int(k):hi] for hi, k in zip(bounds[1:], num_logits)])
        if rows.shape[0] == 0:
            logits = torch.zeros((0, self.vocab_size), dtype=torch.float32, device=self.device)
            return (logits, hidden) if return_hidden else logits
        if hidden is None:
            rows = self._final_norm(rows)
        logits = self.output_logits(rows)  # [sum(num_logits), vocab]
        return (logits, hidden) if return_hidden else logits

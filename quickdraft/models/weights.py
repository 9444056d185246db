"""One prepared set of a decoder's weights, shared by every runner of quickdraft's own decoder.

Built once from a loaded transformers model (so every source the loader accepts works, GGUF included): the
family's settings (models/families.py), the linear layers fused into q|k|v and gate|up matrices in their format
(models/linear.py: dense, int8, a GGUF file's blocks), the norms as the kernels read them, the embedding, the
output head and the rotary tables. The runners (models/cpu_runner.py, models/torch_runner.py,
models/cuda_runner.py) compute with it; none holds weights of its own, and the derived views a draft uses
(first layers, quantized, a vocabulary prefix) are new DecoderWeights sharing every tensor they do not change.

What differs between the families is one row of settings each in models/families.py; config features no row
describes are refused by supports(), and those models run on the transformers forward (models/hf.py;
tests/models/test_families.py checks every family and feature against transformers).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft import kernels
from quickdraft.errors import QuickdraftError
from quickdraft.kernels.quant import QuantizedWeight
from quickdraft.models.base import QUANTIZATION_SCHEMES
from quickdraft.models.config import get_text_config
from quickdraft.models.families import FAMILIES, NO_ROPE, STATIC_ROPE_TYPES, FamilySettings, sliding_window, \
    unsupported_reason
from quickdraft.models.gguf_weights import QuantizedWeights
from quickdraft.models.linear import BlockLinear, Linear, blocks_fit, dense_linear, fused_bias

SUPPORTED = set(FAMILIES)
LINEARS = ("qkv", "o", "gate_up", "down")  # a layer's linear layers, in the order the C++ loop takes them


def supports(model: nn.Module) -> str | None:
    """None when quickdraft's own decoder can run `model`, else the reason it cannot (a family it lacks, or a
    config feature of the family that it does not implement: see models/families.py)."""
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
    """Drop the transformers model's copy of weights held quantized here: a weight on the meta device keeps its
    shape and dtype (so the model still describes itself) and holds no memory."""
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


class DecoderWeights:
    """A Llama-family or Gemma 3 decoder's weights, prepared once for the device they sit on."""

    def __init__(self, model: nn.Module, name: str = "model", quantized: QuantizedWeights | None = None):
        """quantized: the GGUF file's own blocks for the linear layers and the embedding (models/gguf_weights);
        kept on CPUs with quantized kernels for these activations, where the transformers model's copies of those
        weights are then released (one resident copy, in the stored format)."""
        reason = supports(model)
        if reason:
            raise QuickdraftError(f"{name}: {reason}; use runner='hf'")
        self.model = model  # kept for its rotary module and for methods that need the transformers model
        config = self.text_config = get_text_config(model.config)
        family = self.family = FAMILIES[config.model_type]
        inner = getattr(model, getattr(model, "base_model_prefix", "model"))
        # The first real parameter: a skeleton from models/gguf_loader keeps its packed matrices on meta.
        first = next(p for p in model.parameters() if p.device.type != "meta")
        self.device, self.dtype = first.device, first.dtype
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.max_len = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.scale = (getattr(config, family.query_scale) if family.query_scale else self.head_dim) ** -0.5
        self.embed = inner.embed_tokens.weight.detach()
        self.embed_quantized: QuantizedWeight | None = None
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the model's dtype.
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=self.dtype).item()
                            if family.embed_scale else None)
        self.final_softcap = getattr(config, "final_logit_softcapping", None) if family.final_softcap else None
        from transformers.activations import ACT2FN
        self.activation: str = getattr(config, family.activation)
        self.act: Callable = ACT2FN[self.activation]
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
            self.lm_head: Linear = BlockLinear([head], None if output.bias is None else output.bias.detach(),
                                               dtype=self.dtype, quant_kernel=self.quant_kernel)
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
        # cos/sin tables by (rope kind, dtype), shared with the derived views (same positions, same rotation).
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

    # --- figures ---
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def linears(self) -> Iterator[Linear]:
        """Every layer's linear layers, in layer order (not the output head)."""
        for layer in self.layers:
            for name in LINEARS:
                yield getattr(layer, name)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decoding step reads (the embedding rows it gathers are negligible)."""
        return self.lm_head.nbytes + sum(linear.nbytes for linear in self.linears())

    @property
    def float_residual(self) -> bool:
        """Whether the residual stream is float32 where the model's dtype is not (a GGUF model on its blocks)."""
        return self.residual_dtype == torch.float32 and self.dtype != torch.float32

    @property
    def quant_kernel_in_use(self) -> str | None:
        if self.quantized_weights is None:
            return None
        module = kernels.quant_kernels(self.dtype)
        return module.quant_kernel(self.quant_kernel) if module is not None else None

    # --- tensors the forwards read ---
    def rope(self, kind: str, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [>= end, head_dim] of rope kind `kind` (sin's first half negated: rotate_half(x) * sin ==
        roll(x, d/2) * sin_signed, exactly) in `dtype`. A table grows (a new tensor) when a forward reaches
        past it; one kept by a CUDA graph stays alive with the graph."""
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

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ids [n] in the residual stream's dtype (the quantized table's rows are float32)."""
        if self.embed_quantized is not None:
            table = self.embed_quantized
            return kernels.quant_kernels(self.dtype).dequantize_rows(table.packed, table.qtype, ids,
                                                                     table.cols).to(self.residual_dtype)
        return F.embedding(ids, self.embed).to(self.residual_dtype)

    def final_norm_weight(self) -> torch.Tensor:
        """The transformers model's own final norm weight (Gemma's: w, where these weights keep 1 + w)."""
        inner = getattr(self.model, getattr(self.model, "base_model_prefix", "model"))
        return inner.norm.weight.detach().float().cpu()

    # --- derived weights (share every tensor they do not change) ---
    def truncated(self, num_layers: int) -> "DecoderWeights":
        """The first `num_layers` layers, then the final norm and output head (a self-draft)."""
        total = len(self.layers)
        if not 1 <= num_layers <= total:
            raise QuickdraftError(f"layer_skip: num_layers must be in [1, {total}] for this model, got {num_layers}")
        view = copy.copy(self)
        view.layers = self.layers[:num_layers]
        return view

    def quantized(self, scheme: str) -> "DecoderWeights":
        """The same weights with weight-only quantized linear layers (the embedding and norms are shared): `int8`
        (per-output scales) or `q4` (4-bit codes, a float16 scale and min per 32 inputs: GGML's Q4_1, on the
        quantized kernels; int8 where those cannot run; a GGUF file's 4-bit blocks stay as stored)."""
        if scheme not in QUANTIZATION_SCHEMES:
            raise QuickdraftError(f"unknown quantization {scheme!r}; supported: {', '.join(QUANTIZATION_SCHEMES)}")
        if self.device.type != "cpu" and self.device.type != "cuda":
            raise QuickdraftError(f"{scheme} weights need a CPU or CUDA device, not {self.device.type}")

        def convert(linear: Linear) -> Linear:  # the layer's own method (BlockLinear keeps its 4-bit parts)
            return linear.int8() if scheme == "int8" else linear.q4()

        view = copy.copy(self)
        view.layers = [Layer(**{**layer.__dict__, **{name: convert(getattr(layer, name)) for name in LINEARS}})
                       for layer in self.layers]
        view.lm_head = convert(self.lm_head)
        return view

    def with_vocabulary(self, size: int, name: str) -> "DecoderWeights":
        """The output head's first `size` rows (a prefix of the packed weight, so a step reads only those)."""
        if not 0 < size <= self.vocab_size:
            raise QuickdraftError(f"{name}: a vocabulary of {size} tokens; give 1..{self.vocab_size}")
        if size == self.vocab_size:
            return self
        view = copy.copy(self)
        view.lm_head = self.lm_head.leading(size)
        view.vocab_size = size
        return view

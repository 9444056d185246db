"""The CPU-kernel runner: quickdraft's C++ layer loop (kernels/cpu_decoder.cpp) on CPUs with AVX512-BF16.

Why not the transformers forward: per layer it dispatches through dozens of modules, builds masks and cache
updates in Python, and uses scaled_dot_product_attention, whose CPU kernel splits its work by the number of
queries. Here a bf16 forward is one call into the C++ layer loop over kernels that compute every token's row the
same way whatever the number of tokens: a token's logits are bitwise the same whether it is verified alone or
among K+1 tokens, or batched with other sequences, and greedy speculative output equals plain greedy output
(tests/models/test_native.py checks this). Its caches keep each head's keys packed like a weight
(kernels/cpu_attention.cpp reads them so; float16 keys beside a GGUF model's float32 residual stream).

Where some layer cannot go into the C++ loop (an activation the kernels lack, a linear layer they cannot take)
the same kernels are called from a Python loop, with the same bits (`use_decoder=False` asks for it in tests).
"""

from __future__ import annotations

import torch

from quickdraft import kernels
from quickdraft.errors import QuickdraftError
from quickdraft.kv.static_cache import StaticSequenceCache
from quickdraft.models.base import TreeAttention
from quickdraft.models.decoder import DecoderRunner
from quickdraft.models.weights import LINEARS, DecoderWeights, Layer

# The activations the fused kernel knows: SiLU (False) and tanh-approximated GELU (True); others use torch.
FUSED_ACTIVATIONS = {"silu": False, "swish": False, "gelu_pytorch_tanh": True}


def kernel_trees(trees: list[TreeAttention | None] | None) -> tuple[list[int], list[torch.Tensor]]:
    """The kernels' form of the trees (cpu_attention.cpp's cache_segments): per sequence its base slot (0: none)
    and its parent slots as an int64 tensor; empty lists when no sequence has a tree."""
    if trees is None:
        return [], []
    return ([0 if t is None else t.base for t in trees],
            [torch.empty(0, dtype=torch.long) if t is None else torch.tensor(t.parents, dtype=torch.long)
             for t in trees])


class CpuKernelRunner(DecoderRunner):
    """bf16 weights on the CPU kernels: the C++ layer loop, packed keys."""

    backend = "cpu-kernels"
    packed_keys = True
    cache_class = StaticSequenceCache

    @staticmethod
    def runs(weights: DecoderWeights) -> bool:
        """Whether these weights can run here: bf16 on the CPU, head and hidden sizes in 16s, kernels built."""
        return (weights.device.type == "cpu" and weights.dtype == torch.bfloat16 and weights.head_dim % 16 == 0
                and weights.hidden_size % 16 == 0 and kernels.cpu_linear() is not None)

    def __init__(self, weights: DecoderWeights, name: str = "model"):
        if not self.runs(weights):
            raise QuickdraftError(f"{name}: the CPU-kernel runner takes bf16 weights on a CPU with AVX512-BF16 and "
                                  "head and hidden sizes in multiples of 16; use the torch runner")
        super().__init__(weights, name)
        self.kernels = kernels.cpu_linear()
        self.fused_activation = FUSED_ACTIVATIONS.get(weights.activation)
        self._decoder = None  # the C++ layer loop, built on first use (see decoder())
        self._no_tensor = torch.empty(0)

    @property
    def key_dtype(self) -> torch.dtype:
        """float16 beside a float32 residual stream (llama.cpp's f16 keys, read by float32 queries), else the
        model's (see kernels/cpu_attention.cpp)."""
        return torch.float16 if self.weights.float_residual else self.dtype

    @property
    def rows_invariant(self) -> bool:
        """Every layer on the kernels and bf16 weights (int8 ones widen differently from 32 rows on)."""
        w = self.weights
        return self.fused_activation is not None and all(
            linear.rows_alike for linear in [w.lm_head, *w.linears()])

    def decoder(self):
        """(the C++ loop over these layers, its rope kinds), or None where some layer needs torch: an activation
        the kernels lack, a linear layer the kernels cannot take."""
        if self._decoder is None:
            w = self.weights
            if self.fused_activation is None or not all(linear.on_cpu_kernels for linear in w.linears()):
                self._decoder = False
            else:
                decoder = self.kernels.Decoder(w.num_heads, w.eps, w.scale, w.family.gemma_norms,
                                               self.fused_activation)
                kinds = sorted({layer.rope for layer in w.layers})
                for layer in w.layers:
                    decoder.add_layer(*(getattr(layer, name).spec() for name in LINEARS),
                                      layer.input_norm, layer.pre_mlp_norm, layer.post_attn_norm,
                                      layer.post_mlp_norm, layer.qk_norm, layer.sliding_window or 0,
                                      kinds.index(layer.rope))
                self._decoder = (decoder, kinds)
        return self._decoder or None

    def forward(self, cache: StaticSequenceCache, tokens: torch.Tensor, num_logits: int = 1,
                use_decoder: bool = True) -> torch.Tensor:
        """DecoderRunner.forward; use_decoder=False runs the layer loop in Python even where the C++ loop could
        (the same kernels, so the same bits; for tests and profiles)."""
        return self.forward_batch([cache], [tokens], [num_logits], use_decoder=use_decoder)

    def forward_batch(self, caches, tokens, num_logits, inputs_embeds=None, return_hidden=False, trees=None,
                      argmax_only: bool = False, use_decoder: bool = True):
        """DecoderRunner.forward_batch. Every row is computed alike whatever the other rows, so each sequence's
        logits and cache are bitwise those of `forward` on it alone (int8 linear layers: while the batch has fewer
        than 32 rows, see kernels/cpu_linear.cpp); a tree node's logits and keys are bitwise those of its path's
        tokens fed in a line."""
        layers = self._cpp_layers if use_decoder and self.decoder() is not None else self._layers
        return self._eager_forward_batch(caches, tokens, num_logits, inputs_embeds, return_hidden, trees, layers,
                                         argmax_only)

    def _cpp_layers(self, x, caches, starts, counts, trees) -> torch.Tensor:
        decoder, kinds = self.decoder()
        ends = max(start + count for start, count in zip(starts, counts))
        tables = [self._rope(kind, ends) for kind in kinds]  # whole tables, indexed by position
        bases, parents = kernel_trees(trees)
        return decoder.forward_batch(x, [cache.keys for cache in caches], [cache.values for cache in caches],
                                     starts, counts, [cos for cos, _ in tables], [sin for _, sin in tables],
                                     bases, parents)

    def _layers(self, x, caches, starts, counts, trees) -> torch.Tensor:
        """The layers in Python, the kernels called one by one: the cache write and attention per sequence on
        its own (packed) cache, in one call each for the whole batch."""
        fast, w = self.kernels, self.weights
        end = max(start + count for start, count in zip(starts, counts))
        keys_list, values_list = [cache.keys for cache in caches], [cache.values for cache in caches]
        bases, parents = kernel_trees(trees)

        def attend(index: int, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:
            cos, sin = self._rope(layer.rope, end)  # the kernels take whole tables, indexed by position
            q = fast.rope_and_cache_segments(qkv, w.num_heads,
                                             self._no_tensor if layer.qk_norm is None else layer.qk_norm,
                                             w.eps, cos, sin, keys_list, values_list, index, starts, counts,
                                             bases, parents)  # [num_tokens, Hq, head_dim]
            return fast.attention_segments(q, w.num_heads, keys_list, values_list, index, starts, counts,
                                           layer.sliding_window or 0, w.scale, bases, parents)

        return self._decoder_layers(x, attend)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, gemma_style: bool = False,
              float_output: bool = False) -> torch.Tensor:
        gemma_style = gemma_style or self.weights.family.gemma_norms
        return self.kernels.rms_norm(x, weight, self.weights.eps, not gemma_style, float_output)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_activation is not None:
            return self.kernels.gated_activation(gate_up, self.fused_activation)
        return super()._gated(gate_up)

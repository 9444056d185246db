"""The decoder families the native runner implements, one row of settings each (by transformers model_type).

Every family is a stack of pre-norm decoder layers: RMSNorm, attention with RoPE (grouped-query, optionally
q/k/v/o biases and per-head q/k norms), a residual add, RMSNorm, a gated MLP (optionally with biases), a
residual add; then a final RMSNorm and the output head (tied or not). What differs between families is
listed in FamilySettings, and DecoderWeights (weights.py) reads these settings instead of testing family names.

A config feature that changes the math and is not listed here is refused by weights.supports(), so the model
runs on the transformers forward instead (tests/models/test_families.py checks both: the features each family
claims against transformers, and the refusals).

Config features audited (transformers 5.x): head_dim, attention_bias, mlp_bias, Qwen2's q/k/v biases, Qwen 3 and
Gemma 3 q/k norms (taken from the attention modules), tie_word_embeddings (the output module is read as is) and
the static RoPE scalings (tables come from the model's own rotary module) need no setting. Refused: RoPE types
that depend on the forward's length (dynamic, longrope), RoPE on part of a head, Gemma 3's attention logit
softcapping and bidirectional attention, sliding layer_types without a window or without the family's switch.
Ignored because transformers ignores them for these families: pretraining_tp, a Llama config's sliding_window,
layer_types or final_logit_softcapping, a Mistral config's layer_types."""

from __future__ import annotations

from dataclasses import dataclass

NO_ROPE = "none"  # the rope key of layers without rotary embedding (a table of cos 1, sin 0)

# RoPE types whose tables depend only on the config, not on how far a forward reaches: the native runner takes
# them from the model's rotary module once. "dynamic" and "longrope" recompute frequencies from the longest
# position of each forward (and change the rotary module as they do), so they are refused.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True)
class FamilySettings:
    name: str
    # RMSNorm as Gemma computes it: x normalised in float32 times (1 + w), then rounded to the model dtype.
    # Otherwise Llama's: w times x normalised and rounded to the model dtype.
    gemma_norms: bool = False
    # Embeddings times sqrt(hidden_size) (rounded to the model dtype).
    embed_scale: bool = False
    # Gemma 3's four norms a layer: the attention output and the MLP output are normed before their residual
    # adds, and the MLP's input norm is pre_feedforward_layernorm (Llama's is post_attention_layernorm).
    sandwich_norms: bool = False
    # The config attribute whose -1/2 power scales attention scores; None: the head size.
    query_scale: str | None = None
    # Which layers attend through a window of config.sliding_window positions: "none" (even if the config
    # carries a window, as Llama configs sometimes do), "every_layer" (Mistral), "layer_types" (the layers
    # config.layer_types marks "sliding_attention").
    window: str = "none"
    # A config switch that must be on for layer_types' sliding layers to slide (else those layers are refused:
    # transformers' mask functions slide them, its attention modules do not).
    window_switch: str | None = None
    # The rotary module computes a table per layer type (Gemma 3: local and global RoPE).
    rope_by_layer_type: bool = False
    # Attention modules carry use_rope; layers where it is false (SmolLM3's no_rope_layers[i] == 0) skip RoPE.
    no_rope_layers: bool = False
    # Logits become tanh(logits / c) * c with c = config.final_logit_softcapping.
    final_softcap: bool = False
    # The config's MLP activation attribute.
    activation: str = "hidden_act"
    # Config attributes the native runner does not implement: set (not None, not False) means refuse.
    unsupported: tuple[str, ...] = ()
    # The integer activation scheme of the family's GGUF blocks on CPUs with VNNI and no AMX tiles (None: the
    # kernels' default, int16; see kernels.model_quant_kernel). By issue 23's rule, the fastest scheme whose
    # teacher-forced agreement and KL against the float32 model are no worse than llama.cpp's on the same file:
    # int8x32 on Qwen2.5-Coder 0.5B/1.5B and Gemma 3 270M (not on SmolLM2, a Llama; benchmarks/RESULTS.md,
    # sessions 22 and 27), where verification's rows and prefill cost 0.6-0.8x int16's.
    quant_kernel: str | None = None


LLAMA = FamilySettings("llama")
MISTRAL = FamilySettings("mistral", window="every_layer")
QWEN2 = FamilySettings("qwen2", window="layer_types", window_switch="use_sliding_window", quant_kernel="int8x32")
QWEN3 = FamilySettings("qwen3", window="layer_types", window_switch="use_sliding_window")
SMOLLM3 = FamilySettings("smollm3", window="layer_types", window_switch="use_sliding_window", no_rope_layers=True)
GEMMA3 = FamilySettings("gemma3", gemma_norms=True, embed_scale=True, sandwich_norms=True,
                        query_scale="query_pre_attn_scalar", window="layer_types", rope_by_layer_type=True,
                        final_softcap=True, activation="hidden_activation", quant_kernel="int8x32",
                        unsupported=("attn_logit_softcapping", "use_bidirectional_attention"))

FAMILIES: dict[str, FamilySettings] = {
    "llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "smollm3": SMOLLM3,
    "gemma3_text": GEMMA3, "gemma3": GEMMA3,
}


def sliding_window(family: FamilySettings, config, index: int) -> int | None:
    """The attention window of layer `index` (None: full causal attention)."""
    if family.window == "every_layer":
        return getattr(config, "sliding_window", None)
    if family.window == "layer_types":
        types = getattr(config, "layer_types", None)
        if types and types[index] == "sliding_attention":
            return getattr(config, "sliding_window", None)
    return None


def unsupported_reason(family: FamilySettings, config) -> str | None:
    """Why a config of this family cannot run natively (a feature the settings lack), or None."""
    for name in family.unsupported:
        value = getattr(config, name, None)
        if value is not None and value is not False:
            return f"{family.name} with {name}={value!r} has no native runner"
    if family.window == "layer_types" and "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        if getattr(config, "sliding_window", None) is None:
            return f"{family.name}: layer_types mark sliding layers but sliding_window is unset"
        if family.window_switch and not getattr(config, family.window_switch, False):
            return (f"{family.name}: layer_types mark sliding layers while {family.window_switch} is off "
                    "(transformers' masks slide them, its attention modules do not); no native runner")
    return None

"""Every native family against the transformers forward, one tiny model per config feature the native runner
claims (see quickdraft/models/families.py), and every feature it does not implement sent to transformers.

float32 runs the Python layer loop on torch ops (tolerance ~1e-4 relative); bf16 runs quickdraft's CPU kernels
(the C++ layer loop and, bitwise equal to it, the Python loop over the same kernels) where this CPU has them.
Each check feeds a prompt and then decoding steps of several sizes, so the static cache is read back too."""

from __future__ import annotations

import pytest
import torch

from conftest import _sharpen
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import cpu_linear
from quickdraft.models.factory import native_runner
from quickdraft.models.weights import supports
from quickdraft.models import make_runner
from quickdraft.models.hf import HFRunner

needs_kernels = pytest.mark.skipif(cpu_linear() is None, reason="quickdraft's CPU kernels need AVX512-BF16")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

# family -> (config class, model class), by name in transformers
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v projections with biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # per-head RMSNorm of queries and keys
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),  # default config: every 4th layer without RoPE
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),  # sandwich norms, qk norms, embed scale, per-type RoPE
}

ROPE = {
    "rope_linear": {"rope_type": "linear", "factor": 4.0},
    "rope_llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64},
    "rope_yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "smollm3")

# (family, feature) -> config overrides. Windows of 4 tokens are well inside the 24-token sequences checked.
FEATURES: dict[tuple[str, str], dict] = {}
for _family in CLASSES:
    FEATURES[_family, "base"] = {}
    FEATURES[_family, "tied"] = {"tie_word_embeddings": True}
    FEATURES[_family, "untied"] = {"tie_word_embeddings": False}
    FEATURES[_family, "head_dim_32"] = {"head_dim": 32}  # head_dim != hidden / heads
for _family in ("llama", "qwen3", "smollm3", "gemma3"):
    FEATURES[_family, "attention_bias"] = {"attention_bias": True}  # q, k, v and o biases
for _family in ("llama", "smollm3"):
    FEATURES[_family, "mlp_bias"] = {"mlp_bias": True}
for _family in LLAMA_LIKE:
    for _name, _rope in ROPE.items():
        FEATURES[_family, _name] = {"rope_scaling": dict(_rope)}
FEATURES.update({
    ("mistral", "sliding_window"): {"sliding_window": 4},  # every layer
    ("qwen2", "sliding_window"): {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    ("qwen3", "sliding_window"): {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    ("smollm3", "no_rope_layers"): {"no_rope_layers": [1, 0, 1, 0]},
    ("smollm3", "no_rope_interval"): {"no_rope_layer_interval": 2},
    # SmolLM3 slides the window on its no-RoPE layers when use_sliding_window is on.
    ("smollm3", "sliding_window"): {"use_sliding_window": True, "sliding_window": 4},
    ("gemma3", "sliding_window_2"): {"sliding_window": 2},
    # Gemma 3's checkpoints scale RoPE linearly on their global (full-attention) layers only.
    ("gemma3", "rope_linear_global"): {"rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                       "rope_local_base_freq": 100.0},
    ("gemma3", "rope_yarn_global"): {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64}},
    ("gemma3", "final_softcap"): {"final_logit_softcapping": 3.0},
    ("gemma3", "query_pre_attn_scalar"): {"query_pre_attn_scalar": 40},
    # Attributes a config may carry that its transformers model ignores: the native runner must ignore them too.
    ("llama", "stray_window_and_softcap"): {"sliding_window": 4, "final_logit_softcapping": 3.0,
                                            "layer_types": ["sliding_attention"] * 4},
    ("mistral", "stray_layer_types"): {"sliding_window": 4,
                                       "layer_types": ["full_attention", "sliding_attention"] * 2},
    ("qwen3", "stray_window"): {"sliding_window": 4, "max_window_layers": 0},  # use_sliding_window is off
})


def build(family: str, overrides: dict, seed: int = 0):
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    settings = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "gemma3":
        settings.update(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).eval()
    with torch.no_grad():  # random norm weights, so that Gemma's (1 + w) and Qwen 3's q/k norms matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return _sharpen(model)


CASES = sorted(FEATURES)
STEPS = ((0, 13), (13, 14), (14, 19), (19, 24))  # a prompt, one decoding step, two verifications


def _reference(model, ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids[None, :hi]).logits[0, lo:hi].float()


@pytest.mark.parametrize("family,feature", CASES)
def test_float32_logits_match_transformers(family, feature):
    model = build(family, FEATURES[family, feature])
    assert supports(model) is None
    runner = native_runner(model)
    ids = torch.randint(0, 48, (24,), generator=torch.Generator().manual_seed(1))
    cache = runner.new_cache()
    for lo, hi in STEPS:
        got = runner.forward(cache, ids[lo:hi], hi - lo)
        expected = _reference(model, ids, lo, hi)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("family,feature", CASES)
def test_bf16_kernel_logits_match_transformers(family, feature):
    model = build(family, FEATURES[family, feature])
    ids = torch.randint(0, 48, (24,), generator=torch.Generator().manual_seed(2))
    exact = _reference(model, ids, 0, 24)  # float32
    model = model.to(torch.bfloat16)
    theirs = _reference(model, ids, 0, 24)  # transformers in bf16
    runner = native_runner(model)
    assert runner.decoder() is not None  # the C++ layer loop takes every case here
    in_cpp, in_python = runner.new_cache(), runner.new_cache()
    rows = []
    for lo, hi in STEPS:
        rows.append(runner.forward(in_cpp, ids[lo:hi], hi - lo))
        assert torch.equal(rows[-1], runner.forward(in_python, ids[lo:hi], hi - lo, use_decoder=False))
    ours = torch.cat(rows)
    # bf16 keeps 8 bits of mantissa, and the two forwards round in different places: the native runner's error
    # must be of the size of transformers' own bf16 error (a wrong feature gives 5-15 times it).
    assert (ours - exact).abs().max() <= 2.5 * (theirs - exact).abs().max() + 1e-3 * exact.abs().max()
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75


# --- features the native runner does not implement go to transformers -------------------------------------------

REFUSED = {
    # RoPE whose frequencies depend on the sequence length a forward reaches (and that mutate the rotary module).
    ("llama", "rope_dynamic"): ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope"),
    ("qwen2", "rope_longrope"): ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                   "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}},
                                 "rope"),
    ("gemma3", "rope_dynamic_global"): ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope"),
    # RoPE on part of each head (transformers' Llama-family attention would not run it either).
    ("llama", "partial_rotary"): ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
                                  "rotary embedding over 8 of 16"),
    ("gemma3", "attn_softcap"): ({"attn_logit_softcapping": 20.0}, "softcapping"),
    ("gemma3", "bidirectional"): ({"use_bidirectional_attention": True}, "bidirectional"),
    # transformers' eager/sdpa masks slide these layers' window, its flash attention does not: ambiguous.
    ("smollm3", "sliding_types_without_use_sliding_window"): (
        {"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"] * 2}, "use_sliding_window"),
}


@pytest.mark.parametrize("family,feature", sorted(REFUSED))
def test_unimplemented_features_fall_back_to_transformers(family, feature):
    overrides, reason = REFUSED[family, feature]
    model = build(family, overrides)
    assert reason in (supports(model) or "")
    assert isinstance(make_runner(model, "m", "auto"), HFRunner)
    with pytest.raises(QuickdraftError, match=reason):
        make_runner(model, "m", "native")
    with pytest.raises(QuickdraftError, match=reason):
        native_runner(model)


def test_smollm3_no_rope_layers_mean_what_transformers_means():
    """no_rope_layers[i] == 1: layer i uses RoPE; 0: it does not (and its config default drops every 4th)."""
    model = build("smollm3", {})
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [1, 1, 1, 0]
    runner = native_runner(model)
    assert [layer.rope for layer in runner.weights.layers] == ["default", "default", "default", "none"]
    cos, sin = runner._rope("none", 8)
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_float32_greedy_output_equals_transformers(family):
    """The review's symptom: a tiny SmolLM3 with a no-RoPE layer decoded greedily diverged from its first token."""
    from quickdraft import LLM, SamplingParams

    model = build(family, {})
    prompt = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9]
    params = SamplingParams(temperature=0, max_tokens=16)
    native = LLM(model, runner="native").generate({"prompt_token_ids": prompt}, params)[0]
    theirs = LLM(model, runner="hf").generate({"prompt_token_ids": prompt}, params)[0]
    assert native.outputs[0].token_ids == theirs.outputs[0].token_ids


@needs_kernels
def test_kernel_rope_with_the_no_rope_table_is_exactly_the_identity():
    """No-RoPE layers go through the same kernel with cos 1 and sin 0: queries and cached keys come out bitwise
    as projected (x * 1 + y * 0 == x for finite x, y; the kernel rounds once, to the bf16 x already is)."""
    k = cpu_linear()
    h_q, h_kv, d, n, start = 4, 2, 16, 5, 9
    qkv = (torch.randn(n, (h_q + 2 * h_kv) * d) * 1e3).to(torch.bfloat16)
    keys = torch.zeros(h_kv, 1, d // 2, 16, 2, dtype=torch.bfloat16)  # 16 positions, packed
    values = torch.zeros(h_kv, 16, d, dtype=torch.bfloat16)
    cos, sin = torch.ones(n, d, dtype=torch.bfloat16), torch.zeros(n, d, dtype=torch.bfloat16)
    q = k.rope_and_cache(qkv, h_q, torch.empty(0), 1e-6, cos, sin, keys, values, start)
    assert torch.equal(q.reshape(n, h_q * d), qkv[:, : h_q * d])
    cached = keys.permute(0, 1, 3, 2, 4).reshape(h_kv, 16, d)[:, start:start + n]  # unpacked [Hkv, n, d]
    assert torch.equal(cached, qkv[:, h_q * d:(h_q + h_kv) * d].view(n, h_kv, d).transpose(0, 1))

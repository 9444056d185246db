"""The native runner against the transformers forward, its static cache, its kernels, and the batch
invariance that keeps greedy speculative output equal to plain output in bf16."""

import pytest
import torch
import torch.nn.functional as F

from conftest import gguf_blocks_of, tiny_gemma3, tiny_gemma16, tiny_llama, tiny_llama16, tiny_qwen2
from quickdraft import LLM, SamplingParams
from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import cpu_linear, pack
from quickdraft.models import make_runner
from quickdraft.models.hf import HFRunner
from quickdraft.models.linear import BlockLinear, DenseLinear
from quickdraft.models.decoder import DecoderRunner
from quickdraft.models.factory import native_runner

needs_kernels = pytest.mark.skipif(cpu_linear() is None, reason="quickdraft's CPU kernels need AVX512-BF16")


BUILDS = {"llama": tiny_llama, "gemma3": tiny_gemma3, "llama16": tiny_llama16, "gemma16": tiny_gemma16,
          "qwen2": tiny_qwen2}


def _vocab(model):
    return model.config.vocab_size


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_native_logits_match_transformers_in_float32(name):
    model = BUILDS[name]()
    native, hf = native_runner(model), HFRunner(model)
    ids = torch.randint(0, _vocab(model), (24,), generator=torch.Generator().manual_seed(1))
    a_cache, b_cache = native.new_cache(), SequenceCache()
    # A prompt, then steps of several sizes: every row must match the transformers forward.
    for lo, hi in ((0, 13), (13, 14), (14, 19), (19, 24)):
        a = native.forward(a_cache, ids[lo:hi], hi - lo)
        b = hf.forward(b_cache, ids[lo:hi], hi - lo)
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama16", "gemma16", "qwen2"])
def test_native_logits_match_transformers_in_bf16(name):
    model = BUILDS[name]().to(torch.bfloat16)
    native, hf = native_runner(model), HFRunner(model)
    ids = torch.randint(0, _vocab(model), (20,), generator=torch.Generator().manual_seed(2))
    a = native.forward(native.new_cache(), ids, 20)
    b = hf.forward(SequenceCache(), ids, 20)
    # bf16 keeps 8 bits of mantissa; the two forwards round in different places.
    scale = b.abs().max()
    assert (a - b).abs().max() <= 0.05 * scale
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@needs_kernels  # torch's bf16 matmuls round a row differently by the call's row count
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_bf16_verification_rows_equal_single_steps_bitwise(name):
    model = BUILDS[name]().to(torch.bfloat16)
    runner = native_runner(model)
    ids = torch.randint(0, _vocab(model), (20,), generator=torch.Generator().manual_seed(3))
    one_by_one = runner.new_cache()
    runner.forward(one_by_one, ids[:12], 1)
    singles = torch.cat([runner.forward(one_by_one, ids[i:i + 1], 1) for i in range(12, 20)])
    together = runner.new_cache()
    runner.forward(together, ids[:12], 1)
    verified = runner.forward(together, ids[12:], 8)
    assert torch.equal(singles, verified)
    # Rolling back rejected positions and re-verifying gives the same rows again.
    together.rollback(15)
    assert torch.equal(runner.forward(together, ids[15:18], 3), verified[3:6])


@needs_kernels  # bitwise-alike rows are the kernels' property (as above)
@pytest.mark.parametrize("name", ["llama", "gemma3", "llama16", "gemma16"])
@pytest.mark.parametrize("method", ["ngram", "layer_skip", "quantized", "draft_model"])
def test_bf16_greedy_speculative_equals_plain(name, method):
    build = BUILDS[name]
    target = build(seed=0).to(torch.bfloat16)
    prompt = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9]
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "layer_skip":
        config["num_layers"] = 2
    if method == "draft_model":
        config["model"] = build(seed=1).to(torch.bfloat16)
    sp = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM(target, speculative_config={"method": "none"}).generate({"prompt_token_ids": prompt}, sp)[0]
    spec = LLM(target, speculative_config=config).generate({"prompt_token_ids": prompt}, sp)[0]
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec.metrics.proposed_tokens > 0


def test_runner_choice_and_fallback():
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = tiny_llama()
    assert isinstance(LLM(llama).target, DecoderRunner)
    assert isinstance(LLM(llama, runner="hf").target, HFRunner)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    assert isinstance(make_runner(gpt2, "gpt2", "auto"), HFRunner)
    with pytest.raises(QuickdraftError, match="no native runner"):
        make_runner(gpt2, "gpt2", "native")
    with pytest.raises(QuickdraftError, match="unknown runner"):
        LLM(llama, runner="fast")
    with pytest.raises(QuickdraftError, match="needs the native runner"):
        LLM(gpt2, speculative_config={"method": "quantized"})


def test_layer_skip_and_quantized_drafts_share_what_they_do_not_change():
    target = tiny_llama16()
    llm = LLM(target, speculative_config={"method": "layer_skip", "num_layers": 2})
    draft, full = llm.proposer.runner, llm.target
    assert draft.num_layers == 2 and full.num_layers == 4
    assert all(a is b for a, b in zip(draft.weights.layers, full.weights.layers))
    quantized = full.quantized("int8")
    assert quantized.weights.embed is full.weights.embed and quantized.weight_bytes < 0.6 * full.weight_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_its_dense_weight(dtype):
    torch.manual_seed(0)
    weight = torch.randn(40, 64, dtype=dtype)  # 40 outputs: not a multiple of 16, the kernels pad
    dense = DenseLinear(weight)
    q = dense.int8()
    x = torch.randn(40, 64, dtype=dtype)  # 40 rows: the kernels' many-row (prefill) path; 5: the decoding path
    step = weight.float().abs().amax(1) / 127  # per-output quantization step
    # without the kernels torch's int8 matmul takes the scales in the activations' dtype: bf16 rounds them (2^-9)
    rounding = weight.float().abs() * 2.0 ** -8 if q.scales.dtype == torch.bfloat16 else 0.0
    assert ((q.dense().float() - weight.float()).abs() <= step[:, None] / 2 + 1e-3 + rounding).all()
    reference = x.float() @ q.dense().float().T
    for rows in (5, 40):
        expected = reference[:rows]
        torch.testing.assert_close(q(x[:rows]).float(), expected, atol=0.05 * expected.abs().max().item(), rtol=0.02)
    torch.testing.assert_close(dense(x[:5]).float(), x[:5].float() @ weight.float().T,
                               atol=0.02 * reference[:5].abs().max().item(), rtol=0.02)


@needs_kernels
def test_kernel_linear_is_row_invariant_and_exact_in_float32_accumulation():
    k = cpu_linear()
    torch.manual_seed(0)
    for n, d in ((40, 64), (96, 160), (512, 96)):
        w = torch.randn(n, d, dtype=torch.bfloat16)
        x = torch.randn(20, d, dtype=torch.bfloat16)
        packed = pack(w)
        full = k.linear_bf16(x, packed, True)[:, :n]
        for m in (1, 2, 7, 16, 17):
            assert torch.equal(k.linear_bf16(x[:m].contiguous(), packed, True)[:, :n], full[:m])
        reference = (x.float() @ w.float().T).to(torch.bfloat16).float()
        torch.testing.assert_close(full.float(), reference, atol=0.02, rtol=0.01)
        # The AVX-512 path (no AMX) is row-invariant too.
        plain = k.linear_bf16(x, packed, False)[:, :n]
        assert torch.equal(k.linear_bf16(x[:3].contiguous(), packed, False)[:, :n], plain[:3])
        torch.testing.assert_close(plain.float(), reference, atol=0.02, rtol=0.01)


@needs_kernels
@pytest.mark.parametrize("window", [0, 5])
def test_kernel_attention_matches_a_float64_reference(window):
    k = cpu_linear()
    torch.manual_seed(0)
    h_q, h_kv, d, cap, start, n = 6, 2, 32, 48, 20, 7
    keys = torch.randn(h_kv, cap, d, dtype=torch.bfloat16)
    values = torch.randn(h_kv, cap, d, dtype=torch.bfloat16)
    q = torch.randn(n, h_q, d, dtype=torch.bfloat16)
    packed = torch.stack([pack(head) for head in keys])  # the cache layout: each head's keys packed like a weight
    out = k.attention(q, h_q, packed, values, start, window, 0.2)
    for i in range(n):
        pos = start + i
        lo = max(0, pos - window + 1) if window else 0
        for h in range(h_q):
            kv = h // (h_q // h_kv)
            p = (q[i, h].double() @ keys[kv, lo:pos + 1].double().T * 0.2).softmax(-1)
            expected = p @ values[kv, lo:pos + 1].double()
            torch.testing.assert_close(out[i, h * d:(h + 1) * d].double(), expected, atol=0.02, rtol=0.01)
        single = k.attention(q[i:i + 1], h_q, packed, values, pos, window, 0.2)
        assert torch.equal(single[0], out[i])


@needs_kernels
@pytest.mark.parametrize("window", [0, 5])
def test_kernel_attention_of_float16_keys_takes_float32_queries(window):
    """A float32 residual stream's caches hold float16 keys (llama.cpp's f16 cache): float32 queries score them
    unrounded, the output is float32, close to a float64 reference, and a row is the same alone or in a call."""
    k = cpu_linear()
    torch.manual_seed(0)
    h_q, h_kv, d, cap, start, n = 6, 2, 32, 48, 20, 7
    keys = (torch.randn(h_kv, cap, d) * 3).half()
    values = torch.randn(h_kv, cap, d, dtype=torch.bfloat16)
    q = torch.randn(n, h_q, d)
    packed = torch.stack([head.view(cap // 16, 16, d // 2, 2).transpose(1, 2).contiguous() for head in keys])
    out = k.attention(q, h_q, packed, values, start, window, 0.2)
    assert out.dtype == torch.float32
    for i in range(n):
        pos = start + i
        lo = max(0, pos - window + 1) if window else 0
        for h in range(h_q):
            kv = h // (h_q // h_kv)
            p = (q[i, h].double() @ keys[kv, lo:pos + 1].double().T * 0.2).softmax(-1)
            expected = p @ values[kv, lo:pos + 1].double()
            torch.testing.assert_close(out[i, h * d:(h + 1) * d].double(), expected, atol=1e-5, rtol=1e-5)
        single = k.attention(q[i:i + 1], h_q, packed, values, pos, window, 0.2)
        assert torch.equal(single[0], out[i])
    with pytest.raises(RuntimeError, match="float16 keys take float32 q"):
        k.attention(q.to(torch.bfloat16), h_q, packed, values, start, window, 0.2)


@needs_kernels
def test_rope_and_cache_writes_float16_keys_from_float32_rows_saturating():
    """Beside a float32 stream the keys are stored float16 (rounded to nearest, past 65504 saturated rather than
    inf), values bf16, and the roped queries come back float32; bf16 rows into a float16 cache are refused."""
    k = cpu_linear()
    h_q, h_kv, d, cap, n = 2, 1, 32, 16, 3
    qkv = torch.randn(n, (h_q + 2 * h_kv) * d)
    qkv[1, h_q * d + 3] = 1e6  # a key beyond float16's range
    cos, sin = torch.ones(n, d), torch.zeros(n, d)  # no rotation: the rows are stored as they are
    keys = torch.zeros(h_kv, cap // 16, d // 2, 16, 2, dtype=torch.float16)
    values = torch.zeros(h_kv, cap, d, dtype=torch.bfloat16)
    q = k.rope_and_cache(qkv, h_q, torch.empty(0), 1e-6, cos, sin, keys, values, 0)
    assert q.dtype == torch.float32 and torch.equal(q.flatten(1), qkv[:, :h_q * d])
    stored = keys[0].transpose(1, 2).reshape(cap, d)[:n]  # position p, dimension c
    expected = qkv[:, h_q * d:(h_q + 1) * d].clamp(-65504, 65504).half()
    assert torch.equal(stored, expected) and stored[1, 3] == 65504
    assert torch.equal(values[0, :n], qkv[:, (h_q + 1) * d:].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        k.rope_and_cache(qkv.to(torch.bfloat16), h_q, torch.empty(0), 1e-6, cos, sin, keys, values, 0)


@needs_kernels
def test_kernel_rms_norm_rounds_like_llama_and_gemma():
    k = cpu_linear()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    llama = w * F.rms_norm(x.float(), (64,), None, 1e-6).to(torch.bfloat16)
    assert torch.equal(k.rms_norm(x, w, 1e-6, True), llama)
    wf = torch.randn(64)
    gemma = (F.rms_norm(x.float(), (64,), None, 1e-6) * wf).to(torch.bfloat16)
    torch.testing.assert_close(k.rms_norm(x, wf, 1e-6, False).float(), gemma.float(), atol=1e-2, rtol=1e-2)


@needs_kernels
def test_kernel_rms_norm_of_a_float32_residual_stream():
    """float32 x (a GGUF model's residual stream): bf16 out rounded as for bf16 x, or float32 out without the
    model's bf16 roundings (llama.cpp's float32 norm); every row alike whatever the call."""
    k = cpu_linear()
    torch.manual_seed(0)
    x = torch.randn(7, 64) * torch.tensor([1.0, 30.0, 1e-3, 1.0, 1.0, 5.0, 1.0])[:, None]
    w, wf = torch.randn(64, dtype=torch.bfloat16), torch.randn(64)
    normed = F.rms_norm(x.double(), (64,), None, 1e-6)
    assert torch.equal(k.rms_norm(x.bfloat16(), w, 1e-6, True), k.rms_norm(x.bfloat16().float(), w, 1e-6, True))
    for weight, llama in ((w, True), (wf, False)):
        bf16 = k.rms_norm(x, weight, 1e-6, llama)
        full = k.rms_norm(x, weight, 1e-6, llama, float_output=True)
        assert bf16.dtype == torch.bfloat16 and full.dtype == torch.float32
        exact = normed * weight.double()
        torch.testing.assert_close(full.double(), exact, atol=1e-6, rtol=1e-5)
        assert (full.double() - exact).abs().max() < (bf16.double() - exact).abs().max()
        for m in (1, 3):
            assert torch.equal(k.rms_norm(x[2:2 + m].contiguous(), weight, 1e-6, llama, float_output=True), full[2:2 + m])


@needs_kernels
@pytest.mark.parametrize("gelu", [False, True])
def test_kernel_gated_activation_matches_torch_and_is_row_invariant(gelu):
    k = cpu_linear()
    torch.manual_seed(0)
    gate_up = (torch.randn(9, 2 * 40) * 4).to(torch.bfloat16)  # 40 features: a masked last chunk of 16
    out = k.gated_activation(gate_up, gelu)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    torch.testing.assert_close(out.float(), (act * up).float(), atol=0.02, rtol=0.02)
    for m in (1, 4):
        assert torch.equal(k.gated_activation(gate_up[:m].contiguous(), gelu), out[:m])


@needs_kernels
@pytest.mark.parametrize("name", ["llama16", "gemma16", "qwen2"])
def test_cpp_decoder_loop_equals_the_python_loop_bitwise(name):
    runner = native_runner(BUILDS[name]().to(torch.bfloat16))
    assert runner.decoder() is not None
    ids = torch.randint(0, _vocab(runner.model), (30,), generator=torch.Generator().manual_seed(1))
    for view in (runner, runner.quantized("int8"), runner.truncated(1)):
        in_cpp, in_python = view.new_cache(), view.new_cache()
        for chunk in (ids[:20], ids[20:21], ids[21:30]):  # a prompt, a step, a verification
            a = view.forward(in_cpp, chunk, len(chunk))
            b = view.forward(in_python, chunk, len(chunk), use_decoder=False)
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_cache_keeps_its_contents_when_it_grows(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    runner = native_runner(LlamaForCausalLM(config).eval().to(dtype))
    ids = torch.randint(0, 48, (300,), generator=torch.Generator().manual_seed(2))
    grown, reserved = runner.new_cache(), runner.new_cache()
    reserved.reserve(300)
    capacity = reserved.capacity
    runner.forward(grown, ids[:250], 1)
    runner.forward(reserved, ids[:250], 1)
    assert grown.capacity < 300
    a, b = runner.forward(grown, ids[250:], 50), runner.forward(reserved, ids[250:], 50)
    assert grown.capacity >= 300 and reserved.capacity == capacity
    assert torch.equal(a, b)


# --- quantized weights (GGUF blocks) on the native runner -------------------------------------------------------

def _dequantized_copy(model, weights):
    """A float32 model whose weights are exactly the blocks' values (the reference for the quantized runner)."""
    import copy

    module = cpu_linear()
    reference = copy.deepcopy(model).float()
    roles = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    with torch.no_grad():
        for (i, role), w in weights.layers.items():
            reference.model.layers[i].get_submodule(roles[role]).weight.copy_(
                module.dequantize_rows(w.packed, w.qtype, torch.arange(w.rows), w.cols))
        table = weights.embedding
        reference.model.embed_tokens.weight.copy_(
            module.dequantize_rows(table.packed, table.qtype, torch.arange(table.rows), table.cols))
    return reference


@needs_kernels
@pytest.mark.parametrize("name", ["llama16", "gemma16"])
def test_quantized_runner_runs_the_blocks_and_releases_the_dense_copies(name):
    model = BUILDS[name](seed=0).to(torch.bfloat16)
    weights = gguf_blocks_of(model)
    reference = _dequantized_copy(model, weights)
    runner = native_runner(model, quantized=weights)
    assert runner.quantized_weights is weights and runner.weights.embed is None
    assert all(p.device.type == "meta" for n, p in model.named_parameters() if "proj" in n or "embed" in n)
    # a step streams the blocks, and the output head: the quantized embedding when tied (Gemma), else its own
    # (dense here: the weights have no `output` matrix)
    tied = model.config.tie_word_embeddings
    head = weights.embedding.nbytes if tied else runner.weights.lm_head.nbytes
    assert isinstance(runner.weights.lm_head, BlockLinear) == tied
    assert runner.weight_bytes == sum(w.nbytes for w in weights.layers.values()) + head
    prompt = torch.tensor([5, 9, 3, 7, 5, 9, 3, 1, 2])
    logits = runner.forward(runner.new_cache(), prompt, len(prompt))
    exact = HFRunner(reference).forward(SequenceCache(), prompt, len(prompt))
    # bf16 activations (or the int16 kernel's two digits) against float32 ones: within 3% of the largest logit;
    # the int8 kernel's one digit an activation (llama.cpp's way): 8% (measured 5.2% on llama16)
    tolerance = 0.08 if runner.weights.quant_kernel_in_use.startswith("int8") else 0.03
    assert (logits - exact).abs().max() <= tolerance * exact.abs().max()
    # verification rows equal single steps bitwise
    cache = runner.new_cache()
    runner.forward(cache, prompt[:4])
    singles = torch.cat([runner.forward(cache, prompt[i:i + 1]) for i in range(4, 9)])
    cache.rollback(4)
    assert torch.equal(runner.forward(cache, prompt[4:9], 5), singles)


@needs_kernels
@pytest.mark.parametrize("name", ["llama16", "gemma16"])
@pytest.mark.parametrize("residual", [torch.float32, torch.bfloat16])
def test_gguf_runner_keeps_a_float32_residual_stream_and_its_cpp_loop_equals_the_python_loop(name, residual):
    """A runner on GGUF blocks keeps its hidden states in float32 (llama.cpp's way; bf16 as before on request):
    the C++ loop and the Python loop give the same bits either way, verification rows those of single steps."""
    model = BUILDS[name](seed=0).to(torch.bfloat16)
    runner = native_runner(model, quantized=gguf_blocks_of(model))
    assert runner.weights.residual_dtype == torch.float32 and runner.decoder() is not None
    runner.weights.residual_dtype = residual
    ids = torch.randint(0, _vocab(model), (30,), generator=torch.Generator().manual_seed(1))
    in_cpp, in_python, steps = runner.new_cache(), runner.new_cache(), runner.new_cache()
    for chunk in (ids[:20], ids[20:21], ids[21:30]):  # a prompt, a step, a verification
        a = runner.forward(in_cpp, chunk, len(chunk))
        assert torch.equal(a, runner.forward(in_python, chunk, len(chunk), use_decoder=False))
        assert torch.equal(*(cache.keys.transpose(3, 4).flatten(2, 3)[:, :, :len(cache)]
                             for cache in (in_cpp, in_python)))  # the keys written, by position
    # a float32 stream keeps float16 keys (llama.cpp's cache), a bf16 one bf16 keys; values bf16 either way
    assert in_cpp.keys.dtype == (torch.float16 if residual == torch.float32 else torch.bfloat16)
    assert in_cpp.values.dtype == torch.bfloat16
    runner.forward(steps, ids[:21])
    singles = torch.cat([runner.forward(steps, ids[i:i + 1]) for i in range(21, 30)])
    assert torch.equal(a, singles)
    logits, hidden = runner.forward_batch([runner.new_cache()], [ids[:5]], [1], return_hidden=True)
    assert hidden.dtype == torch.bfloat16  # what an EAGLE head reads: the model's dtype
    assert torch.equal(logits, runner.forward(runner.new_cache(), ids[:5]))  # the same logits either way


@needs_kernels
@pytest.mark.parametrize("method", ["ngram", "quantized"])
def test_quantized_target_greedy_speculative_equals_plain_on_tiny_models(method, monkeypatch):
    import quickdraft.api

    model = tiny_llama16(seed=0).to(torch.bfloat16)
    weights = gguf_blocks_of(model)
    # LLM builds its target as it does for a GGUF file kept quantized
    monkeypatch.setattr(quickdraft.api, "make_runner", lambda m, name, kind, quantized=None:
                        make_runner(m, name, kind, weights if m is model else quantized))
    llm = LLM(model, speculative_config={"method": "none"})
    assert llm.target.quantized_weights is weights
    prompt = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9]
    sp = SamplingParams(temperature=0, max_tokens=40)
    plain = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "quantized":
        config["quantization"] = "q4"
    spec = llm.with_speculative_config(config)
    out = spec.generate({"prompt_token_ids": prompt}, sp)[0]
    assert out.outputs[0].token_ids == plain and out.metrics.proposed_tokens > 0


@needs_kernels
def test_q4_of_gguf_blocks_keeps_4_bit_parts_and_requantizes_the_wider():
    """A GGUF layer's q4: its Q4_K part as stored (the same packed tensor), its Q8_0 part Q4_1 blocks of its values;
    a layer of 4-bit parts only is itself."""
    from quickdraft.kernels import quant
    from quickdraft.models.linear import BlockLinear
    from tests.models.test_quant_kernels import random_blocks

    four = quant.pack(quant.decode(random_blocks(quant.Q4_K, 32, 256), quant.Q4_K, 256))
    eight = quant.pack(quant.decode(random_blocks(quant.Q8_0, 48, 256), quant.Q8_0, 256))
    layer = BlockLinear([four, eight], dtype=torch.bfloat16)
    q4 = layer.q4()
    assert q4.parts[0] is four and [p.name for p in q4.parts] == ["Q4_K", "Q4_1"]
    expected = quant.pack(quant.quantize_q4_1(layer.dense()[32:]))
    assert torch.equal(q4.parts[1].packed, expected.packed)
    assert BlockLinear([four], dtype=torch.bfloat16).q4().parts[0] is four
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(q4(x)[:, :32], layer(x)[:, :32])  # the kept part computes the same outputs
    model = tiny_llama16(seed=0).to(torch.bfloat16)  # a runner's q4 view: the same rule, layer by layer
    runner = native_runner(model, quantized=gguf_blocks_of(model))
    for layer, view in zip(runner.weights.layers, runner.quantized("q4").weights.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            for stored, part in zip(getattr(layer, name).parts, getattr(view, name).parts):
                assert (part is stored) == (stored.name in ("Q4_0", "Q4_1")) and part.name in ("Q4_0", "Q4_1")


@needs_kernels
def test_q4_self_draft_is_4_bit_and_exact():
    target = tiny_llama16()
    full = LLM(target).target
    q4 = full.quantized("q4")
    assert all(layer.qkv.parts[0].name == "Q4_1" for layer in q4.weights.layers) and q4.weights.embed is full.weights.embed
    assert q4.weight_bytes < 0.35 * full.weight_bytes
    with pytest.raises(QuickdraftError, match="unknown quantization"):
        full.quantized("q3")
    from quickdraft.drafts import parse_draft

    assert parse_draft("quantized:q4", 5) == {"method": "quantized", "quantization": "q4", "num_speculative_tokens": 5}
    with pytest.raises(QuickdraftError, match="quantized:SCHEME"):
        parse_draft("quantized:fp8", 5)


def test_quantized_weights_cache_round_trip(tmp_path):
    from quickdraft.models import gguf_weights

    weights = gguf_blocks_of(tiny_gemma16())
    weights.skipped = {"blk.0.attn_q.weight": "IQ2_XS"}
    path = tmp_path / "quantized-v1.safetensors"
    gguf_weights.save(weights, path)
    back = gguf_weights.load(path)
    assert back.tied == weights.tied and back.skipped == weights.skipped and back.output is None
    assert back.layers.keys() == weights.layers.keys()
    for key, w in weights.layers.items():
        b = back.layers[key]
        assert (b.qtype, b.rows, b.cols) == (w.qtype, w.rows, w.cols) and torch.equal(b.packed, w.packed)
    assert torch.equal(back.embedding.packed, weights.embedding.packed) and back.nbytes == weights.nbytes


def _head_views():
    """Runners whose output heads are each Linear kind: dense float32 (torch), bf16 on the kernels, int8 and q4
    views, and a GGUF model's blocks (Gemma's tied head: the quantized embedding)."""
    views = {"float32": native_runner(tiny_llama(seed=0))}
    if cpu_linear() is not None:
        bf16 = native_runner(tiny_llama16(seed=0).to(torch.bfloat16))
        gemma = tiny_gemma16(seed=0).to(torch.bfloat16)
        views.update({"bf16": bf16, "int8": bf16.quantized("int8"), "q4": bf16.quantized("q4"),
                      "gguf": native_runner(gemma, quantized=gguf_blocks_of(gemma))})
    return views


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8", "q4", "gguf"])
def test_a_vocabulary_prefix_scores_its_ids_as_the_whole_head_does(kind):
    """with_vocabulary(n): logits [rows, n] the whole head's first n columns, bitwise on the kernels (a prefix of
    the packed head, odd n included), fewer bytes a step, the other weights shared; the transformers runner
    refuses."""
    views = _head_views()
    if kind not in views:
        pytest.skip("needs quickdraft's CPU kernels")
    runner = views[kind]
    prompt = torch.tensor([5, 9, 3, 7, 5, 9, 3, 1, 2])
    whole = runner.forward(runner.new_cache(), prompt, len(prompt))
    for n in (runner.vocab_size // 2 + 3, 16):  # odd (inside a group of 16 outputs), and one group
        part = runner.with_vocabulary(n)
        assert part.vocab_size == n and part.weights.layers is runner.weights.layers and part.weight_bytes < runner.weight_bytes
        logits = part.forward(part.new_cache(), prompt, len(prompt))
        if runner.rows_invariant:  # the kernels compute an output alike whatever the others
            assert torch.equal(logits, whole[:, :n]), n
        else:  # torch's float32 matmul may block a narrower product differently
            torch.testing.assert_close(logits, whole[:, :n], rtol=1e-5, atol=1e-5)
    assert runner.with_vocabulary(runner.vocab_size) is runner
    with pytest.raises(QuickdraftError, match="give 1"):
        runner.with_vocabulary(runner.vocab_size + 1)
    with pytest.raises(QuickdraftError, match="needs the native runner"):
        HFRunner(tiny_llama(seed=0)).with_vocabulary(20)


@needs_kernels
@pytest.mark.parametrize("name", ["llama16", "gemma16", "qwen2"])
def test_a_gguf_runner_runs_its_familys_quant_kernel_in_both_loops(name):
    """Gemma 3 and Qwen2 choose int8x32 on VNNI CPUs without AMX tiles (models/families.py), Llama the default;
    the choice reaches the C++ loop and the Python loop alike, and an override beats it."""
    from quickdraft import kernels

    model = BUILDS[name](seed=0).to(torch.bfloat16)
    runner = native_runner(model, quantized=gguf_blocks_of(model))
    preferred = {"llama16": None, "gemma16": "int8x32", "qwen2": "int8x32"}[name]
    assert runner.weights.quant_kernel == kernels.model_quant_kernel(preferred)
    assert all(linear.quant_kernel == runner.weights.quant_kernel for layer in runner.weights.layers
               for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
    if runner.decoder() is None:
        pytest.skip("no C++ loop for this model here")
    ids = torch.randint(0, _vocab(model), (12,), generator=torch.Generator().manual_seed(2))
    module = cpu_linear()
    before = module.set_quant_kernel("")
    try:
        in_cpp = runner.forward(runner.new_cache(), ids, len(ids))
        assert torch.equal(in_cpp, runner.forward(runner.new_cache(), ids, len(ids), use_decoder=False))
        module.set_quant_kernel(module.quant_kernel(runner.weights.quant_kernel))
        assert torch.equal(in_cpp, runner.forward(runner.new_cache(), ids, len(ids)))
        if runner.weights.quant_kernel:  # the family's choice took effect: the default's bits differ
            module.set_quant_kernel("int16")
            assert not torch.equal(in_cpp, runner.forward(runner.new_cache(), ids, len(ids)))
    finally:
        module.set_quant_kernel(before)

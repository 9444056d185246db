"""quickdraft on a CUDA device: the engine's promises where the forwards, caches, sampling and verification all
run on the GPU (torch's ops: cuBLAS matmuls, the Python layer loop, tree attention by masks). Greedy speculation
gives plain decoding's tokens for every draft method, chains and trees, alone and batched; sampled speculation
follows the target's exact law; a request's seed gives the same text with speculation on or off; a GGUF file's
blocks load onto the GPU; with CUDA graphs (QUICKDRAFT_CUDA_GRAPHS=1) the tokens are the eager loop's.

Skipped where torch sees no GPU (CI never has one): `benchmarks/gpu_check.sh` runs it on a lent one.
QUICKDRAFT_TEST_DEVICE=cpu runs the same tests on the CPU, to check the tests themselves."""

from __future__ import annotations

import itertools
import os
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import tiny_gemma3, tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.sampling import PenaltyHistory, process

DEVICE = os.environ.get("QUICKDRAFT_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9]
# Repetitive prompts: the lookups (ngram, suffix) find earlier continuations of their last tokens.
REPETITIVE = [5, 9, 3, 7, 5, 9, 4, 1, 5, 9, 3, 2, 5, 9, 4, 8, 5, 9, 3, 7, 5, 9]
PROMPTS = [PROMPT, REPETITIVE, REPETITIVE[:9]]


def _methods(draft):
    return {
        "none": {"method": "none"},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "layer_skip": {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3},
        "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 5},
        "draft_model-tree": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4,
                             "tree": {"max_nodes": 8, "max_depth": 4}},
        "ngram-tree": {"method": "ngram", "num_speculative_tokens": 4, "tree": {"max_nodes": 8, "max_depth": 4}},
        "draft_model-auto-tree": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4,
                                  "tree": "auto"},
    }


def _reference_greedy(model, prompt, n):
    """transformers' own greedy decoding of the model, on the CPU in float32."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("method", list(_methods(None)))
def test_float32_greedy_speculation_gives_the_model_greedy_tokens(build, method):
    target = build(seed=0)
    expected = [_reference_greedy(target, p, 32) for p in PROMPTS]
    llm = LLM(target, dtype="float32", device=DEVICE, speculative_config=_methods(build(seed=1))[method])
    assert llm.device.type == torch.device(DEVICE).type
    for batch in (1, 3):
        llm.max_num_seqs = batch
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=32))
        assert [o.outputs[0].token_ids for o in out] == expected, (method, batch)
        if method != "none":
            assert sum(o.metrics.proposed_tokens for o in out) > 0
    if method == "draft_model-tree":  # the lookups' trees are chains where each match has one continuation
        assert sum(o.metrics.tree_steps for o in out) > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model-tree"])
def test_bfloat16_greedy_and_seeded_speculation_equal_plain(method):
    """bf16 on the device, the draft model the target itself (its drafts mostly right, so steps verify many
    rows): speculation's tokens are plain decoding's, greedy and with a request seed."""
    target = tiny_llama(seed=0).to(torch.bfloat16)
    draft = tiny_llama(seed=0).to(torch.bfloat16)
    plain = LLM(target, device=DEVICE, speculative_config={"method": "none"})
    llm = LLM(target, device=DEVICE, speculative_config=_methods(draft)[method])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for params in ([SamplingParams(temperature=0, max_tokens=32)] * 3,
                   [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=s) for s in range(3)]):
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        out = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == want, (method, params[0])
        assert sum(o.metrics.proposed_tokens for o in out) > 0
        if method != "ngram":  # the target drafting for itself: right but at near-ties
            assert sum(o.metrics.accepted_tokens for o in out) > 0


def _exact_three_token_law(model, prompt, params):
    """P(y1, y2, y3) under plain sampling, by enumeration over the (tiny) vocabulary, on the CPU in float64."""
    vocab = model.config.vocab_size
    with torch.inference_mode():
        def probs(prefix):
            logits = model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1:].double()
            history = PenaltyHistory(prompt, vocab, torch.device("cpu"))
            history.append(list(prefix))
            seen, counts = history.rows(torch.empty(0, dtype=torch.long), 1)
            return process(logits, params, seen, counts)[0]
        p1 = probs(())
        p2 = {(a,): probs((a,)) for a in range(vocab)}
        p3 = {(a, b): probs((a, b)) for a in range(vocab) for b in range(vocab)}
    return {(a, b, c): (p1[a] * p2[(a,)][b] * p3[(a, b)][c]).item()
            for a, b, c in itertools.product(range(vocab), repeat=3)}


def _chi_square_pvalue(samples: Counter, law: dict, n: int) -> float:
    """Goodness of fit, cells with expected count < 5 pooled into one (the usual validity rule)."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, prob in law.items():
        if prob * n >= 5:
            observed.append(samples.get(cell, 0))
            expected.append(prob * n)
        else:
            pooled_obs += samples.get(cell, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return stats.chisquare(observed, [e * scale for e in expected]).pvalue


@pytest.mark.parametrize("params, config", [
    (dict(temperature=1.0), {"method": "draft_model", "num_speculative_tokens": 3}),
    (dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5),
     {"method": "draft_model", "num_speculative_tokens": 3}),
    (dict(temperature=1.0, min_p=0.05), {"method": "draft_model", "num_speculative_tokens": 3,
                                         "tree": {"max_nodes": 6, "max_depth": 3}}),
    (dict(temperature=1.2, top_k=5, frequency_penalty=0.6), {"method": "ngram", "num_speculative_tokens": 3}),
], ids=["t1-draft", "topp-penalties-draft", "minp-draft-tree", "topk-freq-ngram"])
def test_sampled_first_three_tokens_follow_the_target_law(params, config):
    """Chi-square goodness of fit of 3000 speculative samples drawn on the device against the exact law.
    Seeds are fixed; the test fails at p < 1e-4 (a false alarm rate of 1e-4 for each sample set)."""
    n = 3000
    target = tiny_llama(seed=0, vocab_size=8, layers=2)
    draft = tiny_llama(seed=5, vocab_size=8, layers=2)
    prompt = [1, 2, 3, 1, 2]
    sp = SamplingParams(n=n, max_tokens=3, **params)
    law = _exact_three_token_law(target, prompt, sp)
    if config["method"] == "draft_model":
        config = {**config, "model": draft}
    llm = LLM(target, dtype="float32", device=DEVICE, speculative_config=config, seed=99)
    out = llm.generate({"prompt_token_ids": prompt}, sp)[0]
    samples = Counter(tuple(c.token_ids) for c in out.outputs)
    assert sum(samples.values()) == n and all(len(k) == 3 for k in samples)
    assert out.metrics.proposed_tokens > 0
    pvalue = _chi_square_pvalue(samples, law, n)
    assert pvalue > 1e-4, (config, pvalue)


def test_a_gguf_file_loads_onto_the_device(tmp_path):
    """A GGUF file's Q8_0 blocks on the device: its logits are the dequantized model's (transformers' reader on the
    CPU, float32), and greedy speculation on it gives plain decoding's tokens."""
    gguf = pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM

    from quickdraft.models import loader

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(gguf, model, path)
    reference, _ = loader.load(loader.resolve(str(path)), torch.float32, torch.device("cpu"))
    llm = LLM(str(path), dtype="float32", device=DEVICE, tokenizer=None,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    plain = llm.with_speculative_config({"method": "none"})
    ids = torch.tensor([REPETITIVE])
    with torch.inference_mode():
        want = reference(input_ids=ids).logits[0, -1].float()
    runner = llm.target
    cache = runner.new_cache()
    got = runner.forward(cache, ids[0].to(llm.device), 1)[-1].float().cpu()
    torch.testing.assert_close(got, want, atol=2e-3 * max(1.0, want.abs().max().item()), rtol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])


def _write_gguf(gguf, model, path) -> None:
    """A tiny Llama as a GGUF file: 2-D weights in Q8_0, norms float32, q/k rows in llama.cpp's order."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    names = {hf: g for g, hf in get_gguf_hf_weights_map(model, TensorProcessor()).items()}
    for hf_name, tensor in model.state_dict().items():
        if hf_name not in names or hf_name == "lm_head.weight":
            continue
        name, w = names[hf_name], tensor.detach().float().numpy()
        if ".attn_q." in name or ".attn_k." in name:
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("method", ["none", "draft_model", "ngram"])
def test_cuda_graphs_decode_as_the_eager_loop(method, dtype, monkeypatch):
    """QUICKDRAFT_CUDA_GRAPHS=1: one sequence's forwards (decoding steps, verifications, the draft's steps) are
    captured and replayed; greedy and seeded tokens equal the eager loop's, one sequence at a time and batched."""
    target = tiny_llama(seed=0).to(dtype)
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model":
        config["model"] = tiny_llama(seed=0 if dtype == torch.bfloat16 else 1).to(dtype)
    eager = LLM(target, device=DEVICE, speculative_config=config)
    monkeypatch.setenv("QUICKDRAFT_CUDA_GRAPHS", "1")
    graphed = LLM(target, device=DEVICE, speculative_config=config)
    on_cuda = graphed.device.type == "cuda"
    assert graphed.target.cuda_graphs == on_cuda
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for params in ([SamplingParams(temperature=0, max_tokens=32)] * 3,
                   [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=s) for s in range(3)]):
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        for batch in (1, 3):
            graphed.max_num_seqs = batch
            assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == want, (params[0], batch)
    if on_cuda:
        assert graphed.target._graphs  # steps were replayed graphs
        if method == "draft_model":
            assert graphed.proposer.runner._graphs


def test_cuda_graphs_keep_the_sampled_law(monkeypatch):
    """The first law test above with every one-sequence forward a replayed CUDA graph."""
    monkeypatch.setenv("QUICKDRAFT_CUDA_GRAPHS", "1")
    test_sampled_first_three_tokens_follow_the_target_law(
        dict(temperature=1.0), {"method": "draft_model", "num_speculative_tokens": 3})

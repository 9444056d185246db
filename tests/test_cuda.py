"""quickdraft on a CUDA device: the engine's promises where the forwards, caches, sampling and verification all
run on the GPU, on the CUDA runner (models/cuda_runner.py: every sequence's keys and values in one paged KV pool,
every step of a bucketed shape a CUDA graph, by default). Greedy speculation gives plain decoding's tokens for
every draft method, chains and trees, alone and batched; sampled speculation follows the target's exact law; a
request's seed gives the same text with speculation on or off; a GGUF file's blocks load onto the GPU; the graphs'
tokens are the same runner's eager ones.

Skipped where torch sees no GPU (CI never has one): `benchmarks/gpu_check.sh` runs it on a lent one.
QUICKDRAFT_TEST_DEVICE=cpu runs the same tests on the CPU, every native runner a CUDA runner there too (its
paged path, eagerly), to check the tests and that path."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.models import factory
from quickdraft.models.cuda_runner import CudaRunner
from test_engine import _chi_square_pvalue, _exact_three_token_law, _reference_greedy

DEVICE = os.environ.get("QUICKDRAFT_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def cuda_runners(monkeypatch):
    """Every native runner the tests build is a CUDA runner: the factory's choice on CUDA, forced on the CPU."""
    monkeypatch.setattr(factory, "backend_for", lambda weights: CudaRunner)

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


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("method", list(_methods(None)))
def test_float32_greedy_speculation_gives_the_model_greedy_tokens(build, method):
    target = build(seed=0)
    expected = [_reference_greedy(target, p, 32) for p in PROMPTS]
    for batch in (1, 3):
        # A fresh LLM for each batch size: adaptive K drafts every cap until it has measured the draft, and then
        # stops drafting where it cannot pay (a draft as dear as its target cannot, and then not even probes), so
        # a reused LLM would verify nothing here.
        llm = LLM(target, dtype="float32", device=DEVICE, speculative_config=_methods(build(seed=1))[method])
        assert llm.device.type == torch.device(DEVICE).type
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
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for params in ([SamplingParams(temperature=0, max_tokens=32)] * 3,
                   [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=s) for s in range(3)]):
        # A fresh LLM each time: a draft as dear as its target cannot pay, so once measured adaptive K stops
        # drafting it (see the test above), and a reused LLM would verify nothing.
        llm = LLM(target, device=DEVICE, speculative_config=_methods(draft)[method])
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        out = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == want, (method, params[0])
        assert sum(o.metrics.proposed_tokens for o in out) > 0
        if method != "ngram":  # the target drafting for itself: right but at near-ties
            assert sum(o.metrics.accepted_tokens for o in out) > 0


@pytest.mark.parametrize("params, config", [
    (dict(temperature=1.0), {"method": "draft_model", "num_speculative_tokens": 3}),
    (dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5),
     {"method": "draft_model", "num_speculative_tokens": 3}),
    (dict(temperature=1.0, min_p=0.05), {"method": "draft_model", "num_speculative_tokens": 3,
                                         "tree": {"max_nodes": 6, "max_depth": 3}}),
    (dict(temperature=1.2, top_k=5, frequency_penalty=0.6), {"method": "ngram", "num_speculative_tokens": 3}),
], ids=["t1-draft", "topp-penalties-draft", "minp-draft-tree", "topk-freq-ngram"])
def test_sampled_first_three_tokens_follow_the_target_law(params, config, max_num_seqs: int = 64):
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
    llm = LLM(target, dtype="float32", device=DEVICE, speculative_config=config, seed=99, max_num_seqs=max_num_seqs)
    out = llm.generate({"prompt_token_ids": prompt}, sp)[0]
    samples = Counter(tuple(c.token_ids) for c in out.outputs)
    assert sum(samples.values()) == n and all(len(k) == 3 for k in samples)
    assert out.metrics.proposed_tokens > 0
    pvalue = _chi_square_pvalue(samples, law, n)
    assert pvalue > 1e-4, (config, pvalue)


def test_the_sampled_law_in_batches_of_graphed_steps():
    """The first law test's samples drawn 8 sequences a step: steps of 8 x 4 rows, within the graphs' buckets
    (64 sequences a step, the default, make forwards of more rows, which run eagerly)."""
    test_sampled_first_three_tokens_follow_the_target_law(
        dict(temperature=1.0), {"method": "draft_model", "num_speculative_tokens": 3}, max_num_seqs=8)


def test_a_gguf_file_loads_onto_the_device(tmp_path):
    """A GGUF file's Q8_0 blocks on the device: its logits are the dequantized model's (transformers' reader on the
    CPU, float32), and greedy speculation on it gives plain decoding's tokens."""
    gguf = pytest.importorskip("gguf")
    from models.test_gguf_loader import _write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    from quickdraft.models import loader

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(model, path, "llama", gguf.GGMLQuantizationType.Q8_0)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("method", ["none", "draft_model", "ngram", "draft_model-tree"])
def test_cuda_graphs_decode_as_the_eager_loop(method, dtype):
    """By default the CUDA runner captures its forwards (decoding steps, verifications, trees, the draft's steps,
    batches of them) and replays them; greedy and seeded tokens equal the same runner's eager forwards (the same
    kernels), one sequence at a time and batched."""
    target = tiny_llama(seed=0).to(dtype)
    draft = tiny_llama(seed=0 if dtype == torch.bfloat16 else 1).to(dtype)
    config = {key: value for key, value in _methods(draft)[method].items() if key != "num_speculative_tokens"}
    config.update(num_speculative_tokens=4, adaptive=False)
    eager = LLM(target, device=DEVICE, speculative_config=config)
    runners = [eager.target] + ([eager.proposer.runner] if method.startswith("draft_model") else [])
    for runner in runners:
        runner.capture_graphs = False
    graphed = LLM(target, device=DEVICE, speculative_config=config)
    on_cuda = graphed.device.type == "cuda"
    assert isinstance(graphed.target, CudaRunner) and graphed.target.capture_graphs == on_cuda
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for params in ([SamplingParams(temperature=0, max_tokens=32)] * 3,
                   [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=s) for s in range(3)]):
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        for batch in (1, 3):
            graphed.max_num_seqs = batch
            assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == want, (params[0], batch)
    if on_cuda:
        assert graphed.target.graph_replays > 0  # steps were replayed graphs
        if method.startswith("draft_model"):
            assert graphed.proposer.runner.graph_replays > 0
    assert all(runner.graph_replays == 0 for runner in runners)

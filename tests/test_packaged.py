"""End to end on the packaged GGUF models (SmolLM2-135M-Instruct, Gemma 3 270M)."""

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError, TokenizerMismatchError
from quickdraft.models import loader

pytestmark = pytest.mark.slow

CHATS = [
    "Repeat this sentence exactly twice: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list of numbers.",
    "What is the capital of France? Answer in one sentence.",
    "Summarize: Speculative decoding lets a small model draft tokens that a large model verifies in one pass.",
]


@pytest.fixture(scope="module")
def plain_outputs(smollm2):
    sp = SamplingParams(temperature=0, max_tokens=48)
    return [smollm2.chat([{"role": "user", "content": c}], sp)[0].outputs[0] for c in CHATS]


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False},
    {"method": "layer_skip", "num_layers": 24, "num_speculative_tokens": 4, "adaptive": False},
    {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 5, "adaptive": False},
], ids=["ngram", "layers24", "draft_model"])
def test_greedy_speculative_equals_plain_on_smollm2(smollm2, plain_outputs, config):
    if config["method"] == "layer_skip":
        llm = LLM(smollm2.target.model, tokenizer=smollm2.tokenizer, speculative_config=config,
                  dtype="float32", device="cpu")
    else:
        llm = LLM("smollm2-135m", speculative_config=config, dtype="float32", device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=48)
    for chat, expected in zip(CHATS, plain_outputs):
        out = llm.chat([{"role": "user", "content": chat}], sp)[0]
        assert out.outputs[0].token_ids == expected.token_ids, chat
        assert out.outputs[0].text == expected.text
        assert out.metrics.proposed_tokens > 0


def test_stream_stop_strings_and_seeds(smollm2):
    prompt = "List the numbers from one to ten, in words, separated by commas:"
    sp = SamplingParams(temperature=0, max_tokens=40)
    full = smollm2.generate(prompt, sp)[0].outputs[0]
    stream = smollm2.stream(prompt, sp)
    assert "".join(stream) == full.text and stream.output.outputs[0].token_ids == full.token_ids
    stop = full.text.strip().split()[2]
    stopped = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert full.text.startswith(stopped.text) and len(stopped.token_ids) < len(full.token_ids)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7)
    assert smollm2.generate(prompt, sp)[0].outputs[0].text == smollm2.generate(prompt, sp)[0].outputs[0].text


def test_gemma3_has_no_chat_template_and_another_tokenizer(gemma3, smollm2):
    with pytest.raises(QuickdraftError, match="no chat template"):
        gemma3.chat([{"role": "user", "content": "hi"}])
    out = gemma3.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text
    # A draft model object without a tokenizer cannot be compared with the target's: refused.
    with pytest.raises(TokenizerMismatchError, match="only one of them has a tokenizer"):
        LLM(smollm2.target.model, tokenizer=smollm2.tokenizer,
            speculative_config={"method": "draft_model", "model": gemma3.target.model},
            dtype="float32", device="cpu")


def test_a_draft_with_another_tokenizer_drafts_over_the_intersection(gemma3, smollm2):
    """Gemma 3 (SentencePiece-style, 262k tokens) as target, SmolLM2 (byte-level BPE, 49k) as draft: the draft
    proposes tokens of the intersection, compared by the bytes they stand for, and greedy output is plain
    greedy output."""
    from quickdraft.drafts.draft_model import DraftModelProposer
    from quickdraft.token_bytes import token_bytes

    llm = LLM(gemma3.target.model, tokenizer=gemma3.tokenizer, dtype="float32", device="cpu",
              speculative_config={"model": smollm2.target.model, "tokenizer": smollm2.tokenizer,
                                  "num_speculative_tokens": 4, "adaptive": False})
    assert isinstance(llm.proposer, DraftModelProposer)
    mapping = llm.proposer.mapping
    assert 30_000 < mapping.size < 49_152
    # The byte tables agree with each tokenizer's own decoding of its tokens.
    for tokenizer in (gemma3.tokenizer, smollm2.tokenizer):
        table, _, _ = token_bytes(tokenizer)
        sample = sorted(table)[::997]
        decoded = [tokenizer.decode([i]) for i in sample]
        assert sum(table[i].decode("utf-8", "replace") == text for i, text in zip(sample, decoded)) >= 0.98 * len(sample)
    # " the" is one token in both: it is in the intersection, the draft's token for the target's.
    target_the = gemma3.tokenizer.convert_tokens_to_ids("\u2581the")
    assert mapping.translate(target_the) == (smollm2.tokenizer.convert_tokens_to_ids("\u0120the"),)
    prompts = ["The capital of France is", "def add(a, b):\n    "]
    sp = SamplingParams(temperature=0, max_tokens=24)
    spec = llm.generate(prompts, sp)
    plain = gemma3.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.accepted_tokens for o in spec) > 0


def test_gguf_loading_without_the_conversion_cache(monkeypatch, tmp_path):
    """The real GGUF path through transformers (gguf_file=), bypassing the cache of converted models."""
    monkeypatch.setenv("QUICKDRAFT_NO_CONVERSION_CACHE", "1")
    source = loader.resolve("smollm2-135m")
    assert source.gguf_file and source.gguf_path.is_file()
    llm = LLM(str(source.gguf_path), dtype="float32", device="cpu")
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_not_a_gguf_and_unknown_models(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(QuickdraftError, match="not a GGUF file"):
        LLM(str(fake))
    with pytest.raises(QuickdraftError, match="unknown model"):
        LLM("no-such-model")
    with pytest.raises(QuickdraftError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_native_runner_matches_transformers_on_packaged_models(fixture, request):
    import torch

    from quickdraft.cache import SequenceCache
    from quickdraft.models.decoder import DecoderRunner
    from quickdraft.models.hf import HFRunner

    llm = request.getfixturevalue(fixture)
    assert isinstance(llm.target, DecoderRunner)
    ids = torch.tensor(llm.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"])
    native = llm.target.forward(llm.target.new_cache(), ids, len(ids))
    reference = HFRunner(llm.target.model).forward(SequenceCache(), ids, len(ids))
    torch.testing.assert_close(native, reference, atol=2e-3, rtol=1e-3)


@pytest.fixture(scope="module")
def smollm2_bf16():
    return LLM("smollm2-135m", dtype="bfloat16", device="cpu")


@pytest.mark.parametrize("method", ["ngram", "quantized"])
def test_bf16_greedy_speculative_equals_plain_on_smollm2(smollm2_bf16, method):
    _bf16_kernels_or_skip()
    sp = SamplingParams(temperature=0, max_tokens=48)
    llm = LLM(smollm2_bf16.target.model, tokenizer=smollm2_bf16.tokenizer,
              speculative_config={"method": method, "num_speculative_tokens": 6, "adaptive": False})
    for chat in CHATS:
        messages = [{"role": "user", "content": chat}]
        plain = smollm2_bf16.chat(messages, sp)[0].outputs[0]
        spec = llm.chat(messages, sp)[0]
        assert spec.outputs[0].token_ids == plain.token_ids, chat
        assert spec.metrics.proposed_tokens > 0


# --- the GGUF models kept quantized (dtype "auto" on CPUs with AVX512-BF16) ---------------------------------

def _kernels_or_skip():
    """Skips unless this CPU runs a GGUF file's blocks with dtype auto (AVX512-BF16: bf16; AVX2: float32)."""
    import torch

    from quickdraft import kernels
    from quickdraft.models.loader import resolve_dtype

    if kernels.quant_kernels(resolve_dtype("auto", torch.device("cpu"))) is None:
        pytest.skip("the quantized kernels need AVX512-BF16 or AVX2")


def _bf16_kernels_or_skip():
    """bf16 rows are computed alike whatever the call only on quickdraft's AVX512-BF16 kernels (torch's bf16 matmul
    rounds a row by the call's shape: greedy speculative output may then differ at near-ties, as the README says)."""
    from quickdraft import kernels

    if kernels.cpu_linear() is None:
        pytest.skip("bf16 exactness needs quickdraft's AVX512-BF16 kernels")


@pytest.fixture(scope="module")
def smollm2_quantized():
    _kernels_or_skip()
    return LLM("smollm2-135m", device="cpu")


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_gguf_blocks_are_the_dequantized_models_weights(fixture, request):
    """Every quantized matrix, read back from the packed layout, is bitwise the float32 weight transformers
    loads from the same file: the GGUF-to-runner name mapping and Llama's q/k row permutation are right."""
    _kernels_or_skip()
    import gguf
    import torch

    from quickdraft.models import gguf_weights
    from quickdraft.models.config import get_text_config

    llm = request.getfixturevalue(fixture)  # float32: transformers' dequantized weights, unreleased
    model = llm.target.model
    weights = gguf_weights.read(llm.source.gguf_path, get_text_config(model.config))
    inner = model.model
    modules = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    assert len(weights.layers) == 7 * len(inner.layers) and not weights.skipped
    from quickdraft import kernels

    module = kernels.cpu_linear() or kernels.cpu_quant_avx2()  # either reads the packed layout
    for index in (0, len(inner.layers) - 1):
        for role, path in modules.items():
            packed = weights.get(index, role)
            expected = inner.layers[index].get_submodule(path).weight
            got = module.dequantize_rows(packed.packed, packed.qtype, torch.arange(packed.rows), packed.cols)
            assert torch.equal(got, expected), (index, role)
    rows = torch.tensor([0, 1, 17, 1000, inner.embed_tokens.weight.shape[0] - 1])
    table = weights.embedding
    assert torch.equal(module.dequantize_rows(table.packed, table.qtype, rows, table.cols),
                       inner.embed_tokens.weight[rows])
    reader = gguf.GGUFReader(str(llm.source.gguf_path))
    stored = sum(int(t.n_bytes) for t in reader.tensors)
    assert weights.nbytes <= 1.15 * stored


def test_quantized_runner_keeps_the_stored_blocks(smollm2_quantized, smollm2):
    """dtype auto keeps the GGUF's blocks (the bytes a step streams are the file's), logits within a stated
    tolerance of the dequantized float32 model's, and no transformers copy of the weights resident."""
    import torch

    target = smollm2_quantized.target
    assert target.quantized_weights is not None and target.quantized_weights.types() == {"Q4_1": 210, "Q8_0": 1}
    assert target.weight_bytes <= 1.15 * 96.6e6 < LLM("smollm2-135m", dtype="bfloat16").target.weight_bytes
    assert all(p.device.type == "meta" for name, p in target.model.named_parameters() if "proj" in name)
    ids = torch.tensor(smollm2.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"])
    quantized = target.forward(target.new_cache(), ids, len(ids))
    exact = smollm2.target.forward(smollm2.target.new_cache(), ids, len(ids))
    # bf16 activations (the default int16 kernel): within 5% of the largest logit, 4% of the logits' spread in RMS,
    # and the same top token; one int8 digit an activation (QUICKDRAFT_QUANT_KERNEL=int8 or int8x32, the same
    # scheme on Q4_1's blocks of 32): 8% and 10% (measured 5.8% and 7.4%)
    coarse = target.quant_kernel_in_use.startswith("int8")  # AVX2's is int8x32
    assert (quantized - exact).abs().max() <= (0.08 if coarse else 0.05) * exact.abs().max()
    assert (quantized - exact).pow(2).mean().sqrt() <= (0.10 if coarse else 0.04) * exact.std()
    assert torch.equal(quantized.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 6, "adaptive": False},
    {"method": "quantized", "quantization": "q4", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 8},
], ids=["ngram", "q4-self-draft", "suffix"])
def test_quantized_target_greedy_speculative_equals_plain(smollm2_quantized, config):
    """On the quantized kernels every row is computed alike: speculative greedy output is plain greedy
    output, and a batch of requests gives each its batch-1 tokens."""
    sp = SamplingParams(temperature=0, max_tokens=40)
    spec = smollm2_quantized.with_speculative_config(config)
    plain = [smollm2_quantized.chat([{"role": "user", "content": c}], sp)[0].outputs[0].token_ids for c in CHATS]
    batched = spec.chat([[{"role": "user", "content": c}] for c in CHATS], sp)
    for expected, out in zip(plain, batched):
        assert out.outputs[0].token_ids == expected
    assert sum(out.metrics.proposed_tokens for out in batched) > 0


def test_q4_self_draft_of_a_bf16_target(smollm2_bf16):
    _bf16_kernels_or_skip()
    sp = SamplingParams(temperature=0, max_tokens=32)
    llm = smollm2_bf16.with_speculative_config({"method": "quantized", "quantization": "q4",
                                                "num_speculative_tokens": 4, "adaptive": False})
    draft = llm.proposer.runner
    assert draft.weight_bytes < 0.45 * smollm2_bf16.target.weight_bytes
    for chat in CHATS[:2]:
        messages = [{"role": "user", "content": chat}]
        out = llm.chat(messages, sp)[0]
        assert out.outputs[0].token_ids == smollm2_bf16.chat(messages, sp)[0].outputs[0].token_ids
        assert out.metrics.accepted_tokens > 0.5 * out.metrics.proposed_tokens  # a close copy of the target


# --- the shipped EAGLE heads ------------------------------------------------------------------------------

@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_shipped_eagle_head_drafts_exactly(alias, request):
    """`eagle` with no head given finds the head shipped for the packaged model (quickdraft/heads/), its greedy
    output is plain output (bf16, batched), and the head's own first drafts (lookup off) are accepted far more
    often than an untrained head's, which agrees with the target on about one token in its vocabulary size
    (measured: SmolLM2's head ~0.35 on held-out data, Gemma's ~0.14)."""
    from quickdraft.drafts.eagle import SHIPPED_HEADS

    _bf16_kernels_or_skip()
    plain = request.getfixturevalue("smollm2_bf16") if alias == "smollm2-135m" else \
        LLM(alias, dtype="bfloat16", device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=40)
    chat = alias == "smollm2-135m"
    prompts = [plain.chat_prompt([{"role": "user", "content": c}]) if chat else c for c in CHATS]
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, sp)]
    for lookup in (True, False):
        llm = plain.with_speculative_config({"method": "eagle", "num_speculative_tokens": 3, "adaptive": False,
                                             "eagle_lookup": lookup})
        assert str(SHIPPED_HEADS) in llm.proposer.head_path
        outs = llm.generate(prompts, sp)
        assert [out.outputs[0].token_ids for out in outs] == expected
    from quickdraft.sequence import RequestMetrics

    pooled = RequestMetrics.combine([out.metrics for out in outs])
    first = pooled.acceptance_by_position[0]  # the head's first draft (later ones read its own estimates)
    assert first is not None and first > 0.08, pooled.acceptance_by_position  # an untrained head: ~0

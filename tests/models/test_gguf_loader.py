"""The direct GGUF loader (models/gguf_loader.py): its header parser against gguf's reader, the slab-wise
packing against packing whole matrices, and a whole model read straight from a small GGUF file against the
transformers path on the same file (bitwise: dense tensors, buffers, packed blocks, logits)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from quickdraft.models import gguf_loader, loader

gguf = pytest.importorskip("gguf")


def _kernels_or_skip():
    """Skips unless this CPU runs a GGUF file's blocks with dtype auto (AVX512-BF16: bf16; AVX2: float32)."""
    import torch

    from quickdraft import kernels
    from quickdraft.models.loader import resolve_dtype

    if kernels.quant_kernels(resolve_dtype("auto", torch.device("cpu"))) is None:
        pytest.skip("the quantized kernels need AVX512-BF16 or AVX2")


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for q/k (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, path, arch: str, qtype, dense: tuple[str, ...] = ()) -> None:
    """`model` (a tiny transformers causal LM) as a GGUF file: its matrices in `qtype` (those named by `dense`, as
    "attn_q" or "output", in F16: a type without a quantized kernel), the rest float32, and metadata arrays (a
    fake vocabulary) for the header parser to skip."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None)
                              else 10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_array("test.words", [f"w{i}" for i in range(300)])
    writer.add_array("test.numbers", list(range(50)))
    names = {hf: g for g, hf in get_gguf_hf_weights_map(model, TensorProcessor()).items()}
    for hf_name, tensor in model.state_dict().items():
        if hf_name not in names or (hf_name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        name, w = names[hf_name], tensor.detach().float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = _llama_permute(w, c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads)
        if w.ndim == 2 and any(name.startswith(f"{part}.") or f".{part}." in name for part in dense):
            writer.add_tensor(name, w.astype(np.float16))
        elif w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny(kind: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = LlamaConfig if kind == "llama" else Qwen2Config
    config = cls(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=kind == "llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)  # norms not all ones, biases not all zero
    return model


@pytest.fixture(params=[("llama", "Q8_0"), ("qwen2", "Q4_0")], ids=["llama-q8_0", "qwen2-q4_0"])
def tiny_gguf(request, tmp_path):
    arch, qtype = request.param
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(_tiny(arch), path, arch, gguf.GGMLQuantizationType[qtype])
    return path


def test_header_parser_matches_gguf_reader(tiny_gguf):
    parsed = gguf_loader._File(tiny_gguf)
    parsed.close()
    reader = gguf.GGUFReader(str(tiny_gguf))
    assert parsed.architecture == tiny_gguf.stem.split("-")[1]
    expected = [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
                for t in reader.tensors]
    assert [(t.name, t.tensor_type, t.shape, t.data_offset, t.n_bytes) for t in parsed.tensors] == expected


def _without_fast_config(monkeypatch) -> None:
    """transformers' own GGUF config reading (its legacy reader for these architectures), for this test."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

    for architecture in gguf_loader.FAST_CONFIG_ARCHITECTURES:
        if GGUF_CONFIG_ARCHS.get(architecture) is gguf_loader.config_from_metadata:
            monkeypatch.delitem(GGUF_CONFIG_ARCHS, architecture)


def test_the_config_from_metadata_is_transformers_legacy_config(tiny_gguf, monkeypatch):
    """Issue 47: a 1.5B file's first load read its header twice with gguf.GGUFReader (in transformers' config
    and tokenizer readers, 31 s). The config now comes from transformers' quick reader's metadata, mapped as the
    legacy reader maps it: the same dict, and AutoConfig gets it without running gguf.GGUFReader at all."""
    from transformers import AutoConfig
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _without_fast_config(monkeypatch)
    legacy = load_gguf_checkpoint(str(tiny_gguf))["config"]
    assert gguf_loader.config_from_metadata(*read_gguf_metadata(str(tiny_gguf))) == legacy
    expected = AutoConfig.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name).to_dict()

    def no_reader(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader ran")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    assert gguf_loader.read_config(tiny_gguf).to_dict() == expected


def test_header_parser_refuses_other_files(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_loader._File(path)


@pytest.mark.parametrize("rows", [16, 40, 97])
def test_packing_by_slabs_is_packing_whole(tmp_path, monkeypatch, rows):
    """Slabs of whole 16-row groups, packed one after another, give the whole matrix's packed tensor, also with
    a row permutation (Llama's q/k) and a last group padded."""
    from quickdraft.kernels import quant

    rng = np.random.default_rng(rows)
    blocks = rng.integers(0, 256, (rows, 2 * 144), dtype=np.uint8)  # Q4_K blocks of random bytes (512 inputs)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = gguf_loader._File(path)
    (tensor,) = file.tensors
    order = rng.permutation(rows)

    class Permuting:
        def process(self, weights, name):
            return type("R", (), {"weights": weights[order]})()

    assert tensor.shape == (512, rows)
    whole = quant.pack(quant.decode(file.tensor_bytes(tensor)[order], tensor.tensor_type, 512))
    monkeypatch.setattr(gguf_loader, "SLAB_WEIGHTS", 16 * 512)  # 16 rows a slab
    slabbed = gguf_loader._pack_streamed(file, tensor, Permuting(), tensor.name)
    file.close()
    assert (slabbed.rows, slabbed.cols, slabbed.qtype) == (whole.rows, whole.cols, whole.qtype)
    assert torch.equal(slabbed.packed, whole.packed)


def test_direct_load_equals_the_transformers_path(tiny_gguf, tmp_path, monkeypatch):
    """Bitwise: every dense tensor and buffer of the skeleton, every packed matrix, and the logits of the
    native runner on both, for the same file; the packed matrices stay on the meta device."""
    _kernels_or_skip()
    from quickdraft.models.factory import native_runner

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    source = loader.resolve(str(tiny_gguf))
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    runners = []
    for _attempt in ("cold", "warm"):  # warm: config and packed matrices from the cache (memory-mapped)
        model, tokenizer, packed = loader.load_for_runner(source, bf16, cpu)
        assert packed is not None and all(p.device.type == "meta" for n, p in model.named_parameters()
                                          if n.endswith("proj.weight"))
        runners.append(native_runner(model, quantized=packed))
    reference_model, _ = loader.load(source, bf16, cpu)
    reference_packed = loader.quantized_weights(source, reference_model, bf16, cpu)
    real = {n: p for n, p in model.named_parameters() if p.device.type != "meta"}
    expected = dict(reference_model.named_parameters())
    assert real and all(torch.equal(p, expected[n]) for n, p in real.items())
    assert all(torch.equal(b, dict(reference_model.named_buffers())[n]) for n, b in model.named_buffers())
    got, want = packed.named(), gguf_weights_named(source, reference_model)
    assert got.keys() == want.keys() and all(torch.equal(got[k].packed, want[k].packed) for k in got)
    assert reference_packed is not None
    reference = native_runner(reference_model, quantized=reference_packed)
    ids = torch.tensor([3, 17, 200, 5, 9, 101, 64, 2])
    expected_logits = reference.forward(reference.new_cache(), ids, len(ids))
    for runner in runners:
        assert torch.equal(runner.forward(runner.new_cache(), ids, len(ids)), expected_logits)


@pytest.mark.parametrize("arch, dense", [("qwen2", ("attn_q", "ffn_up")), ("qwen2", ("attn_v", "ffn_gate")),
                                         ("qwen2", ("output",)), ("qwen2", ("token_embd",)),
                                         ("llama", ("token_embd", "attn_k")), ("llama", ("attn_output", "ffn_down"))])
def test_layers_of_mixed_types_run_as_through_transformers(arch, dense, tmp_path, monkeypatch):
    """Files whose matrices are not all of kernel types (a Q5_K_M file's Q5_1 q beside its Q8_0 v; an F16 head or
    embedding): a fused group (q|k|v, gate|up) with such a part runs dense, the rest on blocks, and the direct
    load's runner (its packed parts on meta) gives the transformers path's logits bitwise."""
    _kernels_or_skip()
    from quickdraft.models.linear import BlockLinear, DenseLinear
    from quickdraft.models.factory import native_runner

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mixed.gguf"
    _write_gguf(_tiny(arch), path, arch, gguf.GGMLQuantizationType.Q8_0, dense=dense)
    source = loader.resolve(str(path))
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    model, _, packed = loader.load_for_runner(source, bf16, cpu)
    runner = native_runner(model, quantized=packed)
    groups = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
              "down": ("ffn_down",)}
    for layer in runner.weights.layers:
        for name, parts in groups.items():
            kind = DenseLinear if any(part in dense for part in parts) else BlockLinear
            assert isinstance(getattr(layer, name), kind), (name, dense)
    reference_model, _ = loader.load(source, bf16, cpu)
    reference = native_runner(reference_model, quantized=loader.quantized_weights(source, reference_model, bf16, cpu))
    ids = torch.tensor([3, 17, 200, 5, 9, 101, 64, 2])
    assert torch.equal(runner.forward(runner.new_cache(), ids, len(ids)),
                       reference.forward(reference.new_cache(), ids, len(ids)))


def test_a_cache_written_before_a_type_had_kernels_is_not_read(tmp_path):
    """A packed cache lists the matrices it left dense by type: one that left Q5_1 dense (written before Q5_1 had
    kernels) would keep them dense, so it is read again from the GGUF file; one that left F16 dense is read."""
    from quickdraft.models import gguf_weights
    from quickdraft.models.gguf_weights import QuantizedWeights

    for kind, read in (("Q5_1", False), ("F16", True)):
        weights = QuantizedWeights("model.gguf")
        weights.skipped = {"blk.0.attn_q.weight": kind}
        path = tmp_path / f"cache-{kind}.safetensors"
        gguf_weights.save(weights, path)
        assert (loader._read_packed_cache(path) is not None) == read


def gguf_weights_named(source, model):
    """The packed matrices gguf_weights.read makes from the file (the reference the direct path must equal)."""
    from quickdraft.models import gguf_weights
    from quickdraft.models.config import get_text_config

    return gguf_weights.read(source.gguf_path, get_text_config(model.config)).named()


def test_architecture_without_a_native_runner_takes_the_transformers_path(tiny_gguf, monkeypatch, tmp_path):
    _kernels_or_skip()
    from quickdraft.models import weights

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "supports", lambda model: "no runner (test)")
    source = loader.resolve(str(tiny_gguf))
    model, _, packed = loader.load_for_runner(source, torch.bfloat16, torch.device("cpu"))
    assert all(p.device.type != "meta" for p in model.parameters())  # the dequantized transformers model


def test_explicit_dtype_or_no_blocks_takes_the_transformers_path(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    source = loader.resolve(str(tiny_gguf))
    model, _, packed = loader.load_for_runner(source, torch.bfloat16, torch.device("cpu"), keep_quantized=False)
    assert packed is None and all(p.device.type != "meta" for p in model.parameters())
    # a dtype no quantized kernel reads (float32 has one on AVX2 CPUs, where it is what dtype auto gives)
    model, _, packed = loader.load_for_runner(source, torch.float16, torch.device("cpu"))
    assert packed is None and all(p.device.type != "meta" for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_packaged_models_load_directly_as_through_transformers(alias, tmp_path, monkeypatch):
    """On the packaged models: the direct load's dense tensors, buffers and packed blocks are the transformers
    path's, bitwise, and so are the logits of a prompt and of greedy steps after it."""
    _kernels_or_skip()
    from quickdraft.models.factory import native_runner

    shared_cache = os.environ.get("QUICKDRAFT_CACHE")
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))  # the direct load converts from scratch
    source = loader.resolve(alias)
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    model, tokenizer, packed = loader.load_for_runner(source, bf16, cpu)
    # The transformers path from the shared cache, where other tests (the packaged fixtures) have usually saved
    # its conversion already: a fresh one costs ~60 s for Gemma 3, and the conversion's bits are transformers'.
    if shared_cache is None:
        monkeypatch.delenv("QUICKDRAFT_CACHE")
    else:
        monkeypatch.setenv("QUICKDRAFT_CACHE", shared_cache)
    reference_model, reference_tokenizer = loader.load(source, bf16, cpu)
    reference_packed = loader.quantized_weights(source, reference_model, bf16, cpu)
    expected = dict(reference_model.named_parameters())
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters() if p.device.type != "meta")
    assert all(torch.equal(b, dict(reference_model.named_buffers())[n]) for n, b in model.named_buffers())
    got, want = packed.named(), reference_packed.named()
    assert got.keys() == want.keys() and all(torch.equal(got[k].packed, want[k].packed) for k in got)
    prompt = "def fibonacci(n):\n    "
    ids = tokenizer(prompt)["input_ids"]
    assert ids == reference_tokenizer(prompt)["input_ids"]
    runners = [native_runner(model, quantized=packed), native_runner(reference_model, quantized=reference_packed)]
    caches = [r.new_cache() for r in runners]
    tokens = [torch.tensor(ids)] * 2
    for _ in range(8):
        logits = [r.forward(c, t) for r, c, t in zip(runners, caches, tokens)]
        assert torch.equal(logits[0], logits[1])
        tokens = [logits[0].argmax(-1)] * 2


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_packaged_models_config_and_tokenizer_are_transformers_own(alias, monkeypatch):
    """The config and tokenizer quickdraft reads from a packaged GGUF file (one quick pass over its header, no
    gguf.GGUFReader) are those transformers' readers give: the same config dict, tokenizer class, vocabulary,
    special tokens, chat template and token ids."""
    from transformers import AutoConfig, AutoTokenizer

    source = loader.resolve(alias)
    config = gguf_loader.read_config(source.gguf_path)
    tokenizer = loader._load_tokenizer(source.path, source.gguf_file, False)
    _without_fast_config(monkeypatch)  # transformers' readers from here on
    assert config.to_dict() == AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file).to_dict()
    reference = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    assert type(tokenizer) is type(reference) and tokenizer.get_vocab() == reference.get_vocab()
    assert tokenizer.special_tokens_map == reference.special_tokens_map
    assert tokenizer.chat_template == reference.chat_template
    assert tokenizer.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    for text in ("def fibonacci(n):\n    ", "Speculative decodng lets a smal draft model propose tokens.", "héllo 🙂"):
        assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]


@pytest.mark.slow
def test_the_qwen_pair_greedy_speculative_equals_plain():
    """The real pair (extra models-large; skipped where its parts are not installed): the 1.5B target with
    the 0.5B draft gives plain greedy decoding's tokens."""
    _kernels_or_skip()
    from quickdraft import LLM, SamplingParams
    from quickdraft.errors import ModelNotFoundError

    try:
        loader.resolve("qwen2.5-coder-1.5b"), loader.resolve("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    plain = LLM("qwen2.5-coder-1.5b")
    assert plain.target.quantized_weights is not None
    pair = plain.with_speculative_config({"method": "draft_model", "model": "qwen2.5-coder-0.5b",
                                          "num_speculative_tokens": 4})
    chat = [{"role": "user", "content": "Write a Python function is_prime(n)."}]
    sp = SamplingParams(temperature=0, max_tokens=32)
    expected = plain.chat(chat, sp)[0].outputs[0]
    out = pair.chat(chat, sp)[0]
    assert out.outputs[0].token_ids == expected.token_ids and out.metrics.accepted_tokens > 0


def test_load_runner_keeps_the_blocks_or_widens_them_as_asked(tiny_gguf, tmp_path, monkeypatch):
    """factory.load_runner (what the benchmarks time): the direct load's native runner with the file's blocks,
    the same logits as load_for_runner + make_runner; keep_quantized=False a bf16 runner with none; hf no
    blocks."""
    _kernels_or_skip()
    from quickdraft.models.factory import load_runner, make_runner
    from quickdraft.models.hf import HFRunner
    from quickdraft.models.decoder import DecoderRunner

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    runner, _ = load_runner(str(tiny_gguf))  # (the tiny file has no tokenizer)
    assert isinstance(runner, DecoderRunner) and runner.quantized_weights is not None
    model, _, packed = loader.load_for_runner(loader.resolve(str(tiny_gguf)), torch.bfloat16, torch.device("cpu"))
    reference = make_runner(model, "tiny", "native", packed)
    ids = torch.tensor([3, 17, 200, 5])
    assert torch.equal(runner.forward(runner.new_cache(), ids, 4), reference.forward(reference.new_cache(), ids, 4))
    from quickdraft import kernels

    assert runner.quant_kernel_in_use == kernels.quant_kernels(runner.dtype).quant_kernel(runner.weights.quant_kernel)
    widened, _ = load_runner(str(tiny_gguf), keep_quantized=False)
    assert isinstance(widened, DecoderRunner) and widened.quantized_weights is None
    assert widened.quant_kernel_in_use is None
    hf = load_runner(str(tiny_gguf), kind="hf")[0]
    assert isinstance(hf, HFRunner) and hf.quant_kernel_in_use is None

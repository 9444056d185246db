"""A GGUF file's quantized matrices (models/gguf_weights.py): which tensors are kept as blocks and which stay
dense, the rows put back in transformers' order, the values exactly the file's, and the cache file's round trip.
The files are a few tensors written with the `gguf` package."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quickdraft import kernels
from quickdraft.models import gguf_weights

gguf = pytest.importorskip("gguf")

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 2, 1, 8, 64, 32
CONFIG = SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)  # what the row orders read
Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0


def _exact_q8_0(rows: int, seed: int) -> np.ndarray:
    """Integers in [-127, 127] with a 127 in every block of 32: Q8_0's scale is then 1.0 and its codes the values."""
    w = np.random.default_rng(seed).integers(-127, 128, size=(rows, HIDDEN)).astype(np.float32)
    w[:, ::32] = 127
    return w


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for q/k, which transformers' GGUF loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (w, qtype) in tensors.items():
        if qtype is None:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def llama_file(tmp_path):
    """A Llama layer's q and k (Q8_0, exact, stored in llama.cpp's row order), its down projection in F16 (no
    quantized kernel), a norm, and a Q4_0 embedding; no output.weight (tied)."""
    q, k = _exact_q8_0(HEADS * HEAD_DIM, 0), _exact_q8_0(KV_HEADS * HEAD_DIM, 1)
    embedding = np.random.default_rng(2).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    _write(path, "llama", {
        "blk.0.attn_q.weight": (_llama_permute(q, HEADS), Q8_0),
        "blk.0.attn_k.weight": (_llama_permute(k, KV_HEADS), Q8_0),
        "blk.0.ffn_down.weight": (np.ones((HIDDEN, 16), dtype=np.float16), None),
        "blk.0.attn_norm.weight": (np.ones(HIDDEN, dtype=np.float32), None),
        "token_embd.weight": (embedding, Q4_0),
    })
    return path, q, k, embedding


def test_blocks_are_kept_by_role_and_other_types_stay_dense(llama_file):
    path, q, k, embedding = llama_file
    weights = gguf_weights.read(path, CONFIG)
    assert set(weights.layers) == {(0, "q"), (0, "k")}  # the norm is the transformers model's, down is F16
    assert weights.skipped == {"blk.0.ffn_down.weight": "F16"}
    assert weights.tied and weights.output is None
    assert weights.types() == {"Q8_0": 2, "Q4_0": 1}
    q_blocks = weights.get(0, "q")
    assert (q_blocks.qtype, q_blocks.rows, q_blocks.cols) == (int(Q8_0), HEADS * HEAD_DIM, HIDDEN)
    assert (weights.embedding.qtype, weights.embedding.rows) == (int(Q4_0), VOCAB)
    assert weights.get(1, "q") is None
    assert weights.nbytes == sum(w.packed.numel() for w in (q_blocks, weights.get(0, "k"), weights.embedding))


def test_an_output_head_of_its_own_is_not_tied(tmp_path):
    path = tmp_path / "untied.gguf"
    head = _exact_q8_0(VOCAB, 3)
    _write(path, "qwen2", {"token_embd.weight": (_exact_q8_0(VOCAB, 4), Q8_0), "output.weight": (head, Q8_0)})
    weights = gguf_weights.read(path, CONFIG)
    assert not weights.tied and weights.output.rows == VOCAB and set(weights.named()) == {"embedding", "output"}


def test_llama_q_and_k_rows_come_back_in_transformers_order(llama_file, tmp_path):
    """The same q and k stored un-permuted for an architecture transformers does not reorder (qwen2): the blocks
    read from the llama file, whose rows llama.cpp's converter permuted, are those blocks exactly."""
    _, q, k, _ = llama_file
    plain = tmp_path / "plain.gguf"
    _write(plain, "qwen2", {"blk.0.attn_q.weight": (q, Q8_0), "blk.0.attn_k.weight": (k, Q8_0)})
    permuted, straight = gguf_weights.read(llama_file[0], CONFIG), gguf_weights.read(plain, CONFIG)
    for role in ("q", "k"):
        assert torch.equal(permuted.get(0, role).packed, straight.get(0, role).packed), role
    # (and the permutation is not the identity: the stored llama rows differ from transformers' order)
    assert not np.array_equal(_llama_permute(q, HEADS), q)


@pytest.mark.skipif(kernels.cpu_linear() is None, reason="dequantizing packed blocks needs the CPU kernels")
def test_values_are_the_files_in_transformers_row_order(llama_file):
    path, q, k, embedding = llama_file
    weights = gguf_weights.read(path, CONFIG)
    dequantize = kernels.cpu_linear().dequantize_rows

    def dense(w):
        return dequantize(w.packed, w.qtype, torch.arange(w.rows), w.cols)

    # Exact values (scale 1.0), and the rows un-permuted as transformers un-permutes the dense tensor.
    assert torch.equal(dense(weights.get(0, "q")).float(), torch.from_numpy(q))
    assert torch.equal(dense(weights.get(0, "k")).float(), torch.from_numpy(k))
    # Q4_0 rounds: the blocks dequantize to gguf's own reference dequantization of the stored bytes.
    reference = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(embedding, Q4_0), Q4_0))
    rows = dense(weights.embedding)
    assert torch.equal(rows, reference.to(rows.dtype))


def test_the_cache_file_round_trips_every_matrix(llama_file, tmp_path):
    weights = gguf_weights.read(llama_file[0], CONFIG)
    gguf_weights.save(weights, tmp_path / "packed.safetensors")
    back = gguf_weights.load(tmp_path / "packed.safetensors")
    assert (back.path, back.tied, back.skipped) == (weights.path, weights.tied, weights.skipped)
    assert set(back.named()) == set(weights.named()) == {"layers.0.q", "layers.0.k", "embedding"}
    for name, w in weights.named().items():
        b = back.named()[name]
        assert (b.qtype, b.rows, b.cols) == (w.qtype, w.rows, w.cols) and torch.equal(b.packed, w.packed), name

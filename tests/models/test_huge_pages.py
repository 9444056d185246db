"""models/huge_pages: the packed matrices moved into one huge-page arena keep their bytes, shapes and types;
the switch and the conditions under which they stay as loaded."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels.quant import Q4_K, Q8_0, QuantizedWeight
from quickdraft.models import huge_pages
from quickdraft.models.gguf_weights import QuantizedWeights


def _weights(sizes: list[int]) -> QuantizedWeights:
    generator = torch.Generator().manual_seed(0)
    weights = QuantizedWeights("test.gguf")
    for i, size in enumerate(sizes):
        packed = torch.randint(0, 256, (size // 100, 1, 100), dtype=torch.uint8, generator=generator)
        weights.layers[(i, "down")] = QuantizedWeight(packed, Q4_K, packed.shape[0] * 16, 256)
    weights.embedding = QuantizedWeight(torch.randint(0, 256, (30, 1, 34), dtype=torch.uint8, generator=generator),
                                        Q8_0, 480, 32)
    return weights


def test_the_matrices_move_into_one_arena_with_their_bytes(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_HUGE_PAGES", "1")
    if huge_pages.available() is not None:
        pytest.skip(f"no huge pages here: {huge_pages.available()}")
    weights = _weights([1_500_000, 700_000, 2_300_000])
    before = {name: (w.packed.clone(), w.packed.data_ptr()) for name, w in weights.named().items()}
    assert huge_pages.move_into_huge_pages(weights)
    starts = []
    for name, w in weights.named().items():
        original, address = before[name]
        assert w.packed.data_ptr() != address  # a copy ...
        assert torch.equal(w.packed, original) and w.packed.shape == original.shape  # ... of the same bytes
        assert w.packed.is_contiguous() and w.packed.data_ptr() % 64 == 0
        starts.append(w.packed.data_ptr())
    # one arena, starting on a 2 MB boundary, the matrices side by side in it
    assert min(starts) % huge_pages.HUGE_PAGE == 0
    assert max(starts) - min(starts) < 1_500_000 + 700_000 + 2_300_000 + 64 * 4
    # the arena outlives the loader's references: only the tensors hold it
    del before
    assert torch.equal(weights.get(2, "down").packed[:1], weights.get(2, "down").packed[:1].clone())


def test_off_by_default_and_small_models_keep_them_as_loaded(monkeypatch):
    weights = _weights([1_500_000, 700_000, 2_300_000])
    addresses = [w.packed.data_ptr() for w in weights.named().values()]
    for setting in (None, "0"):  # off unless asked for
        if setting is None:
            monkeypatch.delenv("QUICKDRAFT_HUGE_PAGES", raising=False)
        else:
            monkeypatch.setenv("QUICKDRAFT_HUGE_PAGES", setting)
        assert "QUICKDRAFT_HUGE_PAGES=1" in huge_pages.available()
        assert not huge_pages.move_into_huge_pages(weights)
        assert [w.packed.data_ptr() for w in weights.named().values()] == addresses
    monkeypatch.setenv("QUICKDRAFT_HUGE_PAGES", "1")
    small = _weights([100_000])  # under one huge page in all: nothing to gain
    address = small.get(0, "down").packed.data_ptr()
    assert not huge_pages.move_into_huge_pages(small)
    assert small.get(0, "down").packed.data_ptr() == address


def test_a_kernel_without_transparent_huge_pages_is_said_so(monkeypatch, tmp_path):
    monkeypatch.setenv("QUICKDRAFT_HUGE_PAGES", "1")
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", setting)
    if huge_pages.sys.platform.startswith("linux"):
        assert "never" in huge_pages.available()
    monkeypatch.setattr(huge_pages, "_THP_SETTING", tmp_path / "missing")
    if huge_pages.sys.platform.startswith("linux"):
        assert "no transparent huge pages" in huge_pages.available()


def test_an_embedding_apart_from_the_head_stays(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_HUGE_PAGES", "1")
    if huge_pages.available() is not None:
        pytest.skip(f"no huge pages here: {huge_pages.available()}")
    weights = _weights([1_500_000, 2_300_000])
    weights.output = QuantizedWeight(torch.zeros(40, 1, 34, dtype=torch.uint8), Q8_0, 640, 32)
    weights.tied = False
    embedding, head = weights.embedding.packed.data_ptr(), weights.output.packed.data_ptr()
    assert huge_pages.move_into_huge_pages(weights)
    assert weights.embedding.packed.data_ptr() == embedding  # only looked up
    assert weights.output.packed.data_ptr() != head  # streamed every step

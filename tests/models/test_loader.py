"""Resolving a model string (models/loader.resolve): aliases, .gguf files, local directories, hub ids, and the
errors that say what was wrong and what to pass instead. No model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quickdraft.errors import ModelNotFoundError, QuickdraftError
from quickdraft.models import loader, sources


def _gguf_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + bytes(28))  # the magic is all resolve reads
    return path


@pytest.fixture
def alias(tmp_path, monkeypatch):
    """A fake alias `fake-alias` whose package holds tmp_path/pkg/fake.gguf."""
    target = _gguf_file(tmp_path / "pkg" / "fake.gguf")
    aliases = {**loader.ALIASES, "fake-alias": loader.Alias("pip install fake-pkg", lambda: target, "a fake")}
    monkeypatch.setattr(sources, "ALIASES", aliases)
    return target


def test_an_alias_resolves_to_its_packaged_file(alias):
    source = loader.resolve("fake-alias")
    assert source == loader.ModelSource("fake-alias", str(alias.parent), "fake.gguf")
    assert source.gguf_path == alias


def test_an_alias_without_its_package_says_what_to_install(monkeypatch):
    def missing():
        raise ModuleNotFoundError("no module", name="fake_pkg")

    monkeypatch.setattr(sources, "ALIASES", {"fake-alias": loader.Alias("pip install fake-pkg", missing, "a fake")})
    with pytest.raises(ModelNotFoundError, match=r"needs its package, which is not installed \(fake_pkg\); "
                                                 r"install it with: pip install fake-pkg"):
        loader.resolve("fake-alias")


def test_an_alias_whose_file_is_gone_says_to_reinstall(alias):
    alias.unlink()
    with pytest.raises(ModelNotFoundError, match=r"fake\.gguf is missing; reinstall it with: pip install fake-pkg"):
        loader.resolve("fake-alias")


def test_a_gguf_path_resolves_to_its_directory_and_file(tmp_path):
    path = _gguf_file(tmp_path / "m" / "Model.Q4.gguf")
    source = loader.resolve(str(path))
    assert (source.name, Path(source.path), source.gguf_file) == (str(path), path.parent.resolve(), "Model.Q4.gguf")


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    wrong_magic = tmp_path / "fake.gguf"
    wrong_magic.write_bytes(b"PK\x03\x04" + bytes(28))
    with pytest.raises(QuickdraftError, match=r"is not a GGUF file \(it starts with b'PK\\x03\\x04'"):
        loader.resolve(str(wrong_magic))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"GGUF")
    with pytest.raises(QuickdraftError, match="is a file but not a .gguf file"):
        loader.resolve(str(other))
    with pytest.raises(ModelNotFoundError, match="does not exist; check the path"):
        loader.resolve(str(tmp_path / "absent.gguf"))


def test_a_local_directory_resolves_with_or_without_a_gguf_file(tmp_path):
    transformers_dir = tmp_path / "hf"
    transformers_dir.mkdir()
    (transformers_dir / "config.json").write_text("{}")
    assert loader.resolve(str(transformers_dir)) == loader.ModelSource(str(transformers_dir),
                                                                       str(transformers_dir.resolve()))
    one_gguf = _gguf_file(tmp_path / "one" / "only.gguf").parent
    assert loader.resolve(str(one_gguf)).gguf_file == "only.gguf"
    _gguf_file(one_gguf / "second.gguf")
    with pytest.raises(ModelNotFoundError, match="has no config.json \\(and not exactly one .gguf file\\)"):
        loader.resolve(str(one_gguf))


def test_a_hub_id_is_kept_and_an_unknown_name_is_explained():
    assert loader.resolve("  org/some-model.v2 ") == loader.ModelSource("org/some-model.v2", "org/some-model.v2")
    with pytest.raises(ModelNotFoundError) as error:
        loader.resolve("no-such-model")
    message = str(error.value)
    assert "unknown model 'no-such-model'" in message and "hub id of the form 'org/name'" in message
    assert all(name in message for name in loader.ALIASES)  # the aliases it could have meant
    with pytest.raises(ModelNotFoundError, match="non-empty string"):
        loader.resolve("  ")


def test_dtype_names_resolve_and_unknown_ones_list_the_choices():
    cpu = torch.device("cpu")
    assert loader.resolve_dtype("bfloat16", cpu) is torch.bfloat16 and loader.resolve_dtype(torch.float32, cpu) is torch.float32
    with pytest.raises(QuickdraftError, match="unknown dtype 'half'; use one of auto, float32, bfloat16, float16"):
        loader.resolve_dtype("half", cpu)

"""How quickdraft's kernels announce themselves when they cannot be used."""

import logging

from quickdraft import kernels


def _failed_build(monkeypatch, caplog, has_bf16: bool, tmp_path):
    from torch.utils import cpp_extension

    def broken_load(*args, **kwargs):
        raise RuntimeError("Error building extension 'quickdraft_cpu_linear': no compiler")

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.delenv("QUICKDRAFT_NO_KERNELS", raising=False)
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    (tmp_path / "quickdraft_cpu_linear.so").touch()  # built before: no "compiling" notice before the failure
    monkeypatch.setattr(kernels, "_build_dir", lambda: tmp_path)
    with caplog.at_level(logging.INFO, logger="quickdraft.kernels"):
        assert kernels.cpu_linear() is None
        assert kernels.cpu_linear() is None  # cached: said once
    return [r for r in caplog.records if r.name == "quickdraft.kernels"]


def test_a_failed_build_warns_once_and_says_what_is_lost(monkeypatch, caplog, tmp_path):
    """Failed before: a failed build fell back with only an INFO line."""
    records = _failed_build(monkeypatch, caplog, has_bf16=True, tmp_path=tmp_path)
    assert [r.levelno for r in records] == [logging.WARNING]
    message = records[0].getMessage()
    assert "no compiler" in message and "greedy" in message and "bf16" in message


def test_a_cpu_without_bf16_is_not_a_warning(monkeypatch, caplog, tmp_path):
    records = _failed_build(monkeypatch, caplog, has_bf16=False, tmp_path=tmp_path)
    assert [r.levelno for r in records] == [logging.INFO] and "AVX512-BF16" in records[0].getMessage()


def test_a_build_lock_left_by_an_interrupted_build_is_removed(tmp_path):
    """torch's build `lock` file outlives a build killed midway and would make every later load wait forever;
    under quickdraft's own fcntl lock (released when its holder dies) such a file is known stale and removed."""
    (tmp_path / "lock").write_text("")
    with kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    with kernels._build_lock(tmp_path):  # taken again once released
        pass

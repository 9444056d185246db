"""Progress of the long first steps (issue 47: with an empty cache `quickdraft generate` printed one line, then
nothing for minutes): drawn where asked or where stderr is a terminal, absent elsewhere; the kernel build counts
its compiled sources."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from quickdraft import progress


@pytest.fixture(autouse=True)
def _default_setting(monkeypatch):
    monkeypatch.delenv("QUICKDRAFT_PROGRESS", raising=False)
    progress.set_shown(None)
    yield
    progress.set_shown(None)


def test_shown_where_asked_and_where_stderr_is_a_terminal(monkeypatch):
    assert not progress.shown()  # pytest captures stderr: no terminal
    monkeypatch.setenv("QUICKDRAFT_PROGRESS", "1")
    assert progress.shown()
    progress.set_shown(False)  # --no-progress over the environment
    assert not progress.shown()
    progress.set_shown(None)
    monkeypatch.setenv("QUICKDRAFT_PROGRESS", "0")
    assert not progress.shown()
    monkeypatch.delenv("QUICKDRAFT_PROGRESS")

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    assert progress.shown()


def test_steps_draw_nothing_where_progress_is_not_shown(capfd):
    with progress.task("converting a model", total=3, done="converted a model") as advance:
        advance()
        advance(3, absolute=True)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_nested_steps_share_one_display_and_say_what_they_did(capfd):
    progress.set_shown(True)
    with progress.task("loading a model"):
        with progress.task("packing its tensors", total=4, done="packed its tensors") as advance:
            for _ in range(4):
                advance()
                time.sleep(0.05)
        assert progress._display["depth"] == 1
    assert not progress._display  # the display is gone with the outermost step
    err = capfd.readouterr().err
    assert "loading a model" in err and "packing its tensors" in err and "/4" in err
    assert "[quickdraft] packed its tensors in " in err


def test_a_failed_step_leaves_no_done_line(capfd):
    progress.set_shown(True)
    with pytest.raises(RuntimeError), progress.task("building", done="built"):
        raise RuntimeError("no compiler")
    assert "[quickdraft] built" not in capfd.readouterr().err and not progress._display


def _fake_build(monkeypatch, seconds_a_source: float):
    from torch.utils import cpp_extension

    def load(name, sources, build_directory, **kwargs):
        for index in range(len(sources)):
            time.sleep(seconds_a_source)
            (Path(build_directory) / f"source{index}.o").touch()
        (Path(build_directory) / f"{name}.so").touch()
        return "the module"

    monkeypatch.setattr(cpp_extension, "load", load)


def test_a_kernel_build_counts_its_compiled_sources(monkeypatch, tmp_path, capfd):
    from quickdraft import kernels

    _fake_build(monkeypatch, 0.6)
    progress.set_shown(True)
    sources = [str(tmp_path / "a.cpp"), str(tmp_path / "b.cpp")]
    assert kernels._load("quickdraft_test", sources, tmp_path, [], "test kernels") == "the module"
    err = capfd.readouterr().err
    assert "compiling quickdraft's test kernels, once" in err and "/3" in err
    assert "[quickdraft] compiled quickdraft's test kernels in " in err
    # built: the next load compiles nothing and says nothing
    assert not kernels._needs_build("quickdraft_test", sources, tmp_path)
    assert kernels._load("quickdraft_test", sources, tmp_path, [], "test kernels") == "the module"
    assert "compiling" not in capfd.readouterr().err


def test_a_kernel_build_without_progress_warns_once_with_its_time(monkeypatch, tmp_path, caplog, capfd):
    from quickdraft import kernels

    _fake_build(monkeypatch, 0)
    with caplog.at_level(logging.WARNING, logger="quickdraft.kernels"):
        kernels._load("quickdraft_test", [str(tmp_path / "a.cpp")], tmp_path, [], "test kernels")
    assert [r.getMessage() for r in caplog.records] == [
        f"quickdraft: compiling its test kernels (once per machine and torch version; {kernels.BUILD_TIME}, less "
        "on more cores)"]
    assert "compiling" not in capfd.readouterr().err  # no progress drawn


def test_a_source_newer_than_the_module_rebuilds_it(tmp_path):
    from quickdraft import kernels

    source = tmp_path / "a.cpp"
    source.touch()
    assert kernels._needs_build("m", [str(source)], tmp_path)  # no module yet
    module = tmp_path / "m.so"
    module.touch()
    assert not kernels._needs_build("m", [str(source)], tmp_path)
    later = module.stat().st_mtime + 10
    import os

    os.utime(source, (later, later))
    assert kernels._needs_build("m", [str(source)], tmp_path)

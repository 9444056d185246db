"""The README says what the code does: claims a reader acts on, checked against the code's own tables."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_the_readme_never_denies_the_lossy_mode_it_documents():
    """The relaxed acceptance exists (by name only); a sentence saying there is no lossy mode contradicts it."""
    from quickdraft.drafts import ACCEPTANCES

    assert "relaxed" in ACCEPTANCES and '"acceptance": "relaxed"' in README
    assert not re.search(r"there is no lossy mode", README, re.IGNORECASE)


def test_every_file_the_readme_names_exists():
    """Paths drift when files move (the design round moved many): each tests/... and quickdraft/....py the README
    names must exist."""
    root = Path(__file__).parent.parent
    named = set(re.findall(r"\b((?:tests|quickdraft|benchmarks)/[\w/]+\.py)\b", README))
    named.discard("quickdraft/drafts/repeat_last.py")  # the README's example of a new method's file
    assert len(named) >= 10
    missing = sorted(p for p in named if not (root / p).exists())
    assert not missing, f"the README names files that do not exist: {missing}"


def test_the_readme_names_the_methods_that_take_a_tree_and_the_flag():
    """The token-tree paragraph names --tree and every method whose proposer proposes trees (tree_methods)."""
    from quickdraft.drafts import tree_methods

    paragraph = README[README.index("Token trees (`--tree N,D`"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    assert "`--tree auto`" in paragraph and '"tree": "auto"' in paragraph
    for method in tree_methods():
        assert f"`{method}`" in paragraph, method


def test_the_readme_states_adaptive_ks_exploration_as_the_code_has_it():
    """The probe interval and the age at which a draft cost is forgotten, as adaptive.py sets them."""
    from quickdraft import adaptive

    text = " ".join(README.split())
    assert f"drafts one token every {adaptive.PROBE_INTERVAL} steps" in text
    assert f"a draft cost not measured for {adaptive._Curve().max_age} steps is forgotten" in text


def _shell_blocks() -> list[str]:
    """The README's fenced blocks that are not Python: commands and their printed output."""
    return [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", README, re.DOTALL) if lang != "python"]


COMMAND = r"(\S*)quickdraft (generate|serve|batch|check|tune|bench|distill)\b"


def test_every_command_shown_runs_from_a_clone_as_written():
    """A clone's setup puts quickdraft in .venv, not on PATH: every command in a block, and every inline one with
    arguments, calls .venv/bin/quickdraft; every pip install is the venv's."""
    shown = [m for block in _shell_blocks() for m in re.finditer(COMMAND, block)]
    for span in re.findall(r"`([^`\n]+)`", README):
        if re.search(COMMAND + r" \S+ \S+", span):  # a command with arguments, not a mention of one
            shown += list(re.finditer(COMMAND, span))
    assert len(shown) >= 15
    bare = [m.string[m.start():m.start() + 60] for m in shown if m.group(1) != ".venv/bin/"]
    assert not bare, f"commands not runnable from a clone as written: {bare}"
    pips = re.findall(r"([\w./]*)pip install", README)
    assert pips and all(p == ".venv/bin/" for p in pips), pips


def test_the_bench_command_runs_on_a_clone_after_setup():
    """The README's bench command reads no file a clone lacks (no --dataset: the shipped prompts) and names no
    method that needs an extra scripts/setup.sh does not install (llama.cpp's: the `bench` extra)."""
    import shlex

    from quickdraft.bench.methods import parse_methods
    from quickdraft.cli import build_parser

    (command,) = [line for block in _shell_blocks() for line in block.replace("\\\n", " ").splitlines()
                  if line.startswith(".venv/bin/quickdraft bench")]
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.dataset is None
    assert all(not spec.kind.startswith("llamacpp") for spec in parse_methods(args.methods))
    setup = (Path(__file__).parent.parent / "scripts" / "setup.sh").read_text()
    assert "bench" not in re.search(r"install -e '\.\[([\w,-]+)\]'", setup).group(1).split(",")
    assert "`.venv/bin/pip install -e '.[bench]'`" in README


def test_the_readme_says_what_setup_installs():
    """Every extra scripts/setup.sh installs is named as installed by it (the `ray` extra was not)."""
    setup = (Path(__file__).parent.parent / "scripts" / "setup.sh").read_text()
    extras = re.search(r"install -e '\.\[([\w,-]+)\]'", setup).group(1).split(",")
    intro = README[README.index("## The two commands"):README.index("## How it is built")]
    assert "scripts/setup.sh" in intro
    for extra in extras:
        assert f"`{extra}` extra" in intro, extra


def test_the_gguf_block_types_the_readme_lists_are_the_kernels():
    """The types said to run on the quantized kernels are quant.SUPPORTED's, and none said to stay dense is."""
    from quickdraft.kernels import quant

    text = " ".join(README.split())
    on_kernels = re.search(r"format: ([\w, ]+) run on quickdraft's quantized kernels", text).group(1)
    assert set(re.findall(r"Q\w+", on_kernels)) == {quant.NAMES[t] for t in quant.SUPPORTED}
    dense = re.search(r"Other block types \(([^)]*)\) keep those matrices dense", text).group(1)
    assert not {t.strip() for t in dense.split(",")} & set(quant.NAMES.values())


def test_the_number_of_activation_schemes_is_the_number_listed():
    text = " ".join(README.split())
    word, listed = re.search(r"(\w+) schemes: (.*?) Which a model runs", text).groups()
    numbers = {"Two": 2, "Three": 3, "Four": 4}
    assert numbers[word] == len(re.findall(r"\*\*(int\w+)\*\* \(", listed))

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

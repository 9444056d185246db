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

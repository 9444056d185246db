"""Prompt files of `quickdraft check` and `quickdraft tune` (quickdraft/tools/prompts.py)."""

from __future__ import annotations

import json

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.tools.prompts import read_prompts


def test_load_prompts(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("Summarize this.\n\n  \n  Translate {that}.  \n")
    assert read_prompts(text) == ["Summarize this.", "Translate {that}."]
    records = tmp_path / "bench.jsonl"
    records.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "qa", "turns": ["First turn", "Second turn"]},
        {"prompt": "A plain prompt"},
        {"prompt_token_ids": [1, 2, 3]}]) + "\n")
    assert read_prompts(records) == ["First turn", "A plain prompt", {"prompt_token_ids": [1, 2, 3]}]
    # JSON objects one per line are records whatever the file is called.
    unnamed = tmp_path / "prompts"
    unnamed.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert read_prompts(unnamed) == ["x"]


@pytest.mark.parametrize("name, content, message", [
    ("missing.txt", None, "does not exist"),
    ("empty.txt", "", "holds no prompts"),
    ("blank.txt", "\n   \n\n", "holds no prompts"),
    ("bad.jsonl", '{"prompt": "x"}\n{"prompt": \n', "line 2: not valid JSON"),
    ("fields.jsonl", '{"question": "x"}\n', "none of 'turns', 'prompt' or 'prompt_token_ids'"),
    ("turns.jsonl", '{"turns": []}\n', "'turns' must be a non-empty list"),
    ("ids.jsonl", '{"prompt_token_ids": ["a"]}\n', "list of integers"),
])
def test_bad_prompts_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(QuickdraftError, match=message):
        read_prompts(path)

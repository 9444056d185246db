"""Spec-Bench datasets: loading and validating the JSONL file, and turning a conversation into prompt tokens.

A record is one JSON object per line: {"question_id": ..., "category": "...", "turns": ["...", ...]}.
DEFAULT_DATASET is the prompt set that ships with the package (bench/data/: written for quickdraft,
Apache-2.0, its README says what it holds), which `quickdraft bench` runs without --dataset.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from quickdraft.errors import QuickdraftError

DEFAULT_DATASET = Path(__file__).with_name("data") / "prompts.jsonl"


@dataclass(frozen=True)
class Record:
    question_id: Any
    category: str
    turns: tuple[str, ...]


def _parse_record(obj: Any, where: str) -> Record:
    if not isinstance(obj, dict):
        raise QuickdraftError(f"{where}: expected a JSON object with question_id, category and turns, "
                              f"got {type(obj).__name__}")
    missing = [key for key in ("question_id", "category", "turns") if key not in obj]
    if missing:
        raise QuickdraftError(f"{where}: record lacks {', '.join(repr(m) for m in missing)} "
                              "(a Spec-Bench record has question_id, category and turns)")
    category, turns = obj["category"], obj["turns"]
    if not isinstance(category, str) or not category:
        raise QuickdraftError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise QuickdraftError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    return Record(obj["question_id"], category, tuple(turns))


def load_records(path: str | Path) -> list[Record]:
    """All records of a Spec-Bench JSONL file, in file order; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise QuickdraftError(f"dataset file {path} does not exist; pass a Spec-Bench JSONL file with --dataset")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuickdraftError(f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno})") \
                    from None
            records.append(_parse_record(obj, f"{path} line {number}"))
    if not records:
        raise QuickdraftError(f"dataset file {path} holds no records")
    return records


def categories_of(records: Sequence[Record]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(r.category for r in records))


def select(records: Sequence[Record], categories: Sequence[str] | None = None,
           limit_per_category: int | None = None, shuffle: int | None = None) -> list[Record]:
    """The records of the given categories (all when None), at most `limit_per_category` of each (the first in the
    file), in file order, or with `shuffle` in a random order of that seed across categories: a mixed workload, where
    what adaptive K learns from the requests before a request is not from its own category (in file order, Spec-Bench
    runs each category as a block, which favours anything learned from the previous few requests)."""
    known = categories_of(records)
    if categories:
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise QuickdraftError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                                  f"the dataset has: {', '.join(known)}")
    if limit_per_category is not None and limit_per_category < 1:
        raise QuickdraftError(f"--limit-per-category must be >= 1, got {limit_per_category}")
    wanted = set(categories or known)
    taken: Counter[str] = Counter()
    selected = []
    for record in records:
        if record.category in wanted and (limit_per_category is None or taken[record.category] < limit_per_category):
            taken[record.category] += 1
            selected.append(record)
    if shuffle is not None:
        random.Random(shuffle).shuffle(selected)
    return selected


class PromptFormat:
    """Prompt tokens for turn i of a conversation, given the model's own answers to the earlier turns.

    With a chat template: the user turns and assistant answers as messages, through the template.
    Without one (a base model): the raw turn text; a later turn follows the previous prompt text and the
    model's answer, separated by blank lines.
    """

    SEPARATOR = "\n\n"

    def __init__(self, llm):
        if llm.tokenizer is None:
            raise QuickdraftError(f"model '{llm.model_name}' has no tokenizer; the benchmark needs one to build "
                                  "prompts from the dataset's text")
        self.llm = llm
        self.chat = bool(getattr(llm.tokenizer, "chat_template", None))

    @property
    def description(self) -> str:
        if self.chat:
            return "chat template (later turns follow the model's own earlier answers)"
        return ("raw turn text: the model has no chat template; a later turn follows the previous prompt and the "
                "model's own answer, separated by a blank line")

    def prompt_ids(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
        """Prompt for turn len(answers) (0-based): turns[:len(answers) + 1] with the answers in between."""
        current = len(answers)
        if self.chat:
            messages = []
            for i in range(current + 1):
                messages.append({"role": "user", "content": turns[i]})
                if i < current:
                    messages.append({"role": "assistant", "content": answers[i]})
            return self.llm.chat_prompt(messages)["prompt_token_ids"]
        parts = []
        for i in range(current + 1):
            parts.append(turns[i])
            if i < current:
                parts.append(answers[i])
        return self.llm.tokenizer(self.SEPARATOR.join(parts))["input_ids"]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.llm.tokenizer.decode(list(token_ids), skip_special_tokens=True)

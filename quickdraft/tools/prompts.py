"""The prompts of `quickdraft check` and `quickdraft tune`: a file of them, and one prompt's token ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from quickdraft.api import LLM

PromptInput = str | list[int] | dict[str, Any]


def _record_prompt(obj: Any, where: str) -> str | dict[str, Any]:
    """The prompt of one JSONL record: a Spec-Bench record's first turn, a "prompt" string, or
    "prompt_token_ids"."""
    if not isinstance(obj, dict):
        raise QuickdraftError(f"{where}: expected a JSON object with 'turns' (Spec-Bench) or 'prompt', "
                              f"got {type(obj).__name__}")
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise QuickdraftError(f"{where}: 'turns' must be a non-empty list whose first turn is a non-empty string")
        return turns[0]
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise QuickdraftError(f"{where}: 'prompt' must be a non-empty string")
        return obj["prompt"]
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in ids):
            raise QuickdraftError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
        return {"prompt_token_ids": ids}
    raise QuickdraftError(f"{where}: record has none of 'turns', 'prompt' or 'prompt_token_ids' (keys: "
                          f"{', '.join(sorted(obj)) or 'none'})")


def read_prompts(path: str | Path) -> list[str | dict[str, Any]]:
    """The prompts of a file: a text file of one prompt per line (blank lines skipped), or JSONL (a `.jsonl`
    file, or one whose every line is a JSON object): a Spec-Bench record gives its first turn, a record with
    "prompt" its prompt, one with "prompt_token_ids" those ids."""
    path = Path(path)
    if not path.is_file():
        raise QuickdraftError(f"prompts file {path} does not exist; pass --prompts a text file with one prompt per "
                              "line, or a Spec-Bench JSONL file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise QuickdraftError(f"prompts file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise QuickdraftError(f"prompts file {path} holds no prompts; write one prompt per line (or JSONL records)")
    parsed = []
    for number, line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if path.suffix.lower() == ".jsonl":
                raise QuickdraftError(f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno})") \
                    from None
            parsed = None
            break
    if parsed is not None and (path.suffix.lower() == ".jsonl" or all(isinstance(obj, dict) for obj in parsed)):
        return [_record_prompt(obj, f"{path} line {number}") for obj, (number, _) in zip(parsed, lines)]
    return [line.strip() for _, line in lines]


def prompt_token_ids(llm: "LLM", prompt: PromptInput, chat: bool = False) -> list[int]:
    """A prompt's token ids: a list of ids as it is, a string through the tokenizer (through the chat template
    with chat=True), a dict as LLM.generate takes it."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise QuickdraftError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)):
        if chat:
            raise QuickdraftError("chat=True (--chat) applies the chat template to text prompts; these prompts are "
                                  "token ids already: drop --chat, or give text prompts")
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise QuickdraftError("a token-id prompt must be a non-empty list of integers")
        return list(prompt)
    if not isinstance(prompt, str) or not prompt.strip():
        raise QuickdraftError(f"a prompt is a non-empty string, a list of token ids or a dict, got {prompt!r}")
    if llm.tokenizer is None:
        raise QuickdraftError(f"model '{llm.model_name}' has no tokenizer; give prompts as token ids "
                              "(JSONL records with 'prompt_token_ids')")
    if chat:
        return list(llm.chat_prompt([{"role": "user", "content": prompt}])["prompt_token_ids"])
    return list(llm.tokenizer(prompt)["input_ids"])

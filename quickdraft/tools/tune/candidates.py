"""The drafts `quickdraft tune` measures: each a Candidate (its label and its speculative_config at K = k_max)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from quickdraft.drafts import SpeculativeConfig, draft_help, draft_label, method_class, parse_draft
from quickdraft.errors import QuickdraftError


@dataclass(frozen=True)
class Candidate:
    """One draft to tune: its label and its speculative_config (K = k_max, fixed)."""

    label: str
    config: dict[str, Any]

    @property
    def method(self) -> str:
        return self.config["method"]

    @property
    def is_model(self) -> bool:
        """Whether it drafts with a model, as its proposer declares (Proposer.runs_a_model): it pays per draft
        token, where a lookup pays per step."""
        return method_class(self.method).runs_a_model


def _config_label(config: dict[str, Any]) -> str:
    """A draft config as the command line's --draft names it (the draft registry's label)."""
    return draft_label(config)


def _check_draft_model(model: Any, label: str) -> None:
    """A draft model given by name must resolve (alias, file, directory or hub id) before anything loads."""
    if not isinstance(model, str):
        return
    from quickdraft.models import loader

    try:
        loader.resolve(model)
    except QuickdraftError as exc:
        raise QuickdraftError(f"unknown draft {label!r}: not one of {draft_help(None, ', ')}, and not a draft "
                              f"model ({exc})") from None


def parse_candidates(drafts: str | Sequence[Any], k_max: int) -> list[Candidate]:
    """The drafts to tune, each as a Candidate at K = k_max (fixed): a comma list or a list of `--draft` strings
    (the draft registry's spellings, drafts.draft_help), speculative_config dicts, or SpeculativeConfigs.
    Checked before any model loads."""
    if not (isinstance(k_max, int) and not isinstance(k_max, bool) and k_max >= 1):
        raise QuickdraftError(f"k_max must be an integer >= 1, got {k_max!r}")
    if isinstance(drafts, str):
        drafts = [part.strip() for part in drafts.split(",")]
    if isinstance(drafts, (dict, SpeculativeConfig)):
        drafts = [drafts]
    if not isinstance(drafts, (list, tuple)) or not drafts:
        raise QuickdraftError("no drafts given: pass at least one, e.g. --drafts ngram,suffix")
    candidates: list[Candidate] = []
    for draft in drafts:
        if isinstance(draft, str):
            if not draft:
                raise QuickdraftError("--drafts has an empty entry; give a comma list such as ngram,suffix,layers:12")
            config = parse_draft(draft, k_max)
            label = draft
        elif isinstance(draft, SpeculativeConfig):
            config = draft.settings()
            label = None
        elif isinstance(draft, dict):
            config = dict(draft)
            label = None
        else:
            raise QuickdraftError(f"a draft is a --draft string or a speculative_config dict, got "
                                  f"{type(draft).__name__}")
        config.update(num_speculative_tokens=k_max, adaptive=False)
        config["method"] = SpeculativeConfig.from_dict(config).method  # checks it; infers draft_model from model
        if config["method"] == "none":
            raise QuickdraftError("draft 'none' is plain decoding, the baseline tune always measures; drop it from "
                                  "the drafts")
        label = label or _config_label(config)
        if method_class(config["method"]).loads_draft_model:
            _check_draft_model(config.get("model"), label)
        taken = [c.label for c in candidates]
        if label in taken:
            label = f"{label}#{taken.count(label) + sum(t.startswith(label + '#') for t in taken) + 1}"
        candidates.append(Candidate(label, config))
    return candidates

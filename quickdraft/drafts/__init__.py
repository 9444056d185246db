"""Draft methods behind one interface, one file each, and the configuration that picks one.

A new method is its own file (a Proposer subclass with a `name` and a `from_config`) plus one entry in
PROPOSERS below; the API, the CLI (`--draft`) and the bench find it there."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from quickdraft.drafts.base import DraftContext, LoadedDraft, Proposal, Proposer
from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.drafts.eagle import EagleProposer
from quickdraft.drafts.layer_skip import LayerSkipProposer
from quickdraft.drafts.model_lookup import ModelLookupProposer
from quickdraft.drafts.ngram import NgramProposer
from quickdraft.drafts.none import NoDraft
from quickdraft.drafts.quantized import QuantizedSelfProposer
from quickdraft.drafts.suffix import SuffixProposer
from quickdraft.errors import QuickdraftError
from quickdraft.models.base import QUANTIZATION_SCHEMES

PROPOSERS: dict[str, type[Proposer]] = {cls.name: cls for cls in (
    NoDraft, NgramProposer, DraftModelProposer, LayerSkipProposer, QuantizedSelfProposer, SuffixProposer,
    EagleProposer, ModelLookupProposer)}
METHODS = tuple(PROPOSERS)
QUANTIZATIONS = QUANTIZATION_SCHEMES  # what NativeRunner.quantized builds
ACCEPTANCES = ("exact", "relaxed")
DEFAULT_NUM_SPECULATIVE_TOKENS = 5


@dataclass
class SpeculativeConfig:
    """vLLM-style speculative configuration.

    method: none | ngram | draft_model | layer_skip | quantized | suffix | eagle | model_lookup (inferred as
        draft_model when only `model` is given). `model_lookup`: the suffix lookup's draft where it is confident,
        the draft `model`'s elsewhere (drafts/model_lookup.py). `quantized` drafts with the target's own weights
        quantized to `quantization`.
        `eagle` drafts with a head trained on the target's hidden states (`model`: the head's directory, written
        by `quickdraft distill`; default: the head shipped for the target, drafts/eagle.py).
    num_speculative_tokens: K, the draft length per step (the largest K when adaptive).
    adaptive: pick K per request and step from the measured acceptance and forward costs, down to plain
        decoding where speculation would lose (K=0). False: always propose num_speculative_tokens.
    model: the draft model for draft_model (alias, .gguf, directory, hub id or a loaded model). A draft with
        another tokenizer than the target's drafts over the two vocabularies' intersection (exact:
        drafts/cross_vocab.py).
    eagle_lookup: eagle takes the suffix lookup's draft instead of the head's where it confidently fills all K
        positions (the answer copies text), so it is not worse than lookups on copying; False: the head only.
    tokenizer: the draft model's tokenizer, when `model` is a model object (a loaded model has none of its own).
    num_layers: how many of the target's layers layer_skip keeps.
    quantization: weight-only quantization of the draft: int8 (the default for `quantized`) or q4 (4-bit codes,
        a scale and min per 32 inputs, on the quantized CPU kernels). The target is
        never quantized by this: the output stays exactly the target's.
    prompt_lookup_min / prompt_lookup_max: the n-gram sizes ngram tries, longest first.
    suffix_decoding_*: suffix (drafts/suffix.py): the suffix trees' depth (the longest context matched), the
        tokens of finished requests' text kept for later requests (least recently used evicted; 0: none), the
        draft length's cap per matched token, and the least probability a draft's continuation may have.
    acceptance: "exact" (the default: rejection sampling, the output is the target's) or "relaxed", a LOSSY mode
        that must be asked for by name: a draft token x is also accepted whenever p_target(x) >= threshold *
        q_draft(x) (q one-hot for deterministic drafts; greedy requests compare p_target(x) with threshold times
        the target's top probability). The output then no longer follows the target's law; every output's
        metrics say `lossy`. threshold in (0, 1]: the lower, the more drafts pass and the further the output
        strays from the target's (`quickdraft check` measures how far).
    """

    method: str | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    model: str | None = None
    num_layers: int | None = None
    quantization: str | None = None
    adaptive: bool = True
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_tokens: int = 1 << 18
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    eagle_lookup: bool = True
    tokenizer: Any = None
    acceptance: str = "exact"
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model else "none"
        if self.method not in METHODS:
            raise QuickdraftError(f"unknown speculative method {self.method!r}; use one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if self.method != "none" and not (isinstance(k, int) and k >= 1):
            raise QuickdraftError(f"num_speculative_tokens (K) must be an integer >= 1, got {k!r}")
        if self.method in ("draft_model", "model_lookup") and not self.model:
            raise QuickdraftError(f"method '{self.method}' needs a draft model: set speculative_config['model']")
        if self.method == "quantized" and self.quantization is None:
            self.quantization = "int8"
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise QuickdraftError(f"unknown quantization {self.quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
        if self.quantization is not None and self.method in ("none", "ngram", "suffix", "eagle"):
            raise QuickdraftError(f"quantization applies to model drafts; method {self.method!r} has no weights")
        if self.acceptance not in ACCEPTANCES:
            raise QuickdraftError(f"unknown acceptance {self.acceptance!r}; use 'exact' (lossless, the default) or "
                                  "'relaxed' (lossy, with a threshold)")
        if self.acceptance == "relaxed":
            t = self.threshold
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 < t <= 1.0):
                raise QuickdraftError(f"acceptance 'relaxed' needs a threshold in (0, 1], got {t!r}")
            self.threshold = float(t)
        elif self.threshold is not None:
            raise QuickdraftError("threshold applies to acceptance 'relaxed' only (a lossy mode); exact verification "
                                  "has no threshold")
        if not isinstance(self.eagle_lookup, bool):
            raise QuickdraftError(f"eagle_lookup must be true or false, got {self.eagle_lookup!r}")
        if not isinstance(self.adaptive, bool):
            raise QuickdraftError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "layer_skip" and not (isinstance(self.num_layers, int) and self.num_layers >= 1):
            raise QuickdraftError("method 'layer_skip' needs num_layers, an integer >= 1 "
                                  "(how many of the target's layers the draft keeps)")

    @classmethod
    def from_dict(cls, config: dict[str, Any] | "SpeculativeConfig" | None) -> "SpeculativeConfig":
        if config is None:
            return cls()
        if isinstance(config, SpeculativeConfig):
            return config
        if isinstance(config, (str, os.PathLike)):
            config = read_config(config)
        if not isinstance(config, dict):
            raise QuickdraftError(f"speculative_config must be a dict or a JSON file, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise QuickdraftError(f"unknown speculative_config keys {unknown}; known keys: {sorted(known)}")
        return cls(**config)

    @property
    def relaxed_threshold(self) -> float | None:
        """The LOSSY relaxed test's threshold, or None for exact verification (the default)."""
        return self.threshold if self.acceptance == "relaxed" and self.effective_k > 0 else None

    def to_dict(self) -> dict[str, Any]:
        """The settings that differ from the defaults, as JSON-able values (what `quickdraft tune` writes and
        speculative_config=FILE reads back); a model object or tokenizer cannot be written."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                if not isinstance(value, (str, int, float, bool)):
                    raise QuickdraftError(f"speculative_config[{f.name!r}] is a {type(value).__name__}, which cannot "
                                          "be written as JSON; give a path or an alias")
                out[f.name] = value
        out["method"] = self.method
        return out

    @property
    def effective_k(self) -> int:
        return 0 if self.method == "none" else self.num_speculative_tokens


def read_config(source: str | os.PathLike) -> dict[str, Any]:
    """A speculative_config from a JSON file (what `quickdraft tune --out` writes), or from JSON text."""
    text = str(source)
    if not text.lstrip().startswith("{"):
        if not Path(source).exists():
            hint = f' (for that method pass {{"method": "{text}"}})' if text in METHODS else ""
            raise QuickdraftError(f"speculative_config must be a dict or a JSON file; {text!r} is neither{hint}")
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise QuickdraftError(f"cannot read the speculative config file {str(source)!r}: {exc.strerror}; give a "
                                  "JSON file (e.g. written by `quickdraft tune --out`) or a JSON object") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuickdraftError(f"the speculative config {str(source)[:80]!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise QuickdraftError(f"the speculative config must be a JSON object, got {type(config).__name__}")
    return config


def build_proposer(config: SpeculativeConfig, context: DraftContext) -> Proposer:
    """The proposer `config` asks for, from the registry."""
    return PROPOSERS[config.method].from_config(config, context)


def draft_help(default: str | None = "ngram") -> str:
    """The --draft help string, from the registry's spellings (lookups first, a draft model last)."""
    spellings = [cls.spelling for cls in PROPOSERS.values() if cls.spelling and cls is not DraftModelProposer]
    text = " | ".join(spellings + [DraftModelProposer.spelling])
    return text + (f" (default: {default})" if default else "")


def parse_draft(draft: str, k: int) -> dict[str, Any]:
    """The command line's --draft: ngram | suffix | eagle[:HEAD_DIR] | layers:N | quantized[:int8|q4] | none |
    lookup+MODEL (model_lookup) | a draft MODEL -> a speculative_config."""
    if draft == "none":
        return {"method": "none"}
    if draft in ("ngram", "suffix", "quantized", "eagle"):
        return {"method": draft, "num_speculative_tokens": k}
    if draft.startswith("lookup+"):
        return {"method": "model_lookup", "model": draft.split("+", 1)[1], "num_speculative_tokens": k}
    if draft.startswith("eagle:"):
        return {"method": "eagle", "model": draft.split(":", 1)[1], "num_speculative_tokens": k}
    if draft.startswith("quantized:"):
        scheme = draft.split(":", 1)[1]
        if scheme not in QUANTIZATIONS:
            raise QuickdraftError(f"--draft {draft}: expected quantized:SCHEME with SCHEME one of {', '.join(QUANTIZATIONS)}")
        return {"method": "quantized", "quantization": scheme, "num_speculative_tokens": k}
    if draft.startswith("layers:"):
        value = draft.split(":", 1)[1]
        if not value.isdigit():
            raise QuickdraftError(f"--draft {draft}: expected layers:N with N a positive integer, e.g. layers:12")
        return {"method": "layer_skip", "num_layers": int(value), "num_speculative_tokens": k}
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


__all__ = ["METHODS", "PROPOSERS", "SpeculativeConfig", "DraftContext", "LoadedDraft", "Proposal", "Proposer", "NoDraft",
           "NgramProposer", "DraftModelProposer", "LayerSkipProposer", "QuantizedSelfProposer", "SuffixProposer",
           "EagleProposer", "ModelLookupProposer",
           "build_proposer", "draft_help", "parse_draft"]

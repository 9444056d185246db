"""Draft methods behind one interface, one file each, the registry that lists them, and the configuration that
picks one.

A new method is its own file (a Proposer subclass: its `name`, its `options` dataclass, its `--draft` spelling
and how it drafts; drafts/base.py) plus one entry in BUILT_IN below. The API (speculative_config), the command
lines (`--draft`, parsed by `parse_draft`; their help by `draft_help`), bench and tune find it here; `register`
adds one from outside the package."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from quickdraft.drafts.base import DraftContext, DraftOptions, LoadedDraft, Proposal, Proposer, TreeSettings
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

# The registry: one entry per method, in the order help strings list them (a catch-all spelling goes last).
BUILT_IN: tuple[type[Proposer], ...] = (
    NoDraft, NgramProposer, DraftModelProposer, LayerSkipProposer, QuantizedSelfProposer, SuffixProposer,
    EagleProposer, ModelLookupProposer)
PROPOSERS: dict[str, type[Proposer]] = {cls.name: cls for cls in BUILT_IN}
METHODS = tuple(PROPOSERS)  # the built-in methods' names
QUANTIZATIONS = QUANTIZATION_SCHEMES  # what a native runner's quantized() builds
ACCEPTANCES = ("exact", "relaxed")
DEFAULT_NUM_SPECULATIVE_TOKENS = 5


def register(proposer: type[Proposer]) -> type[Proposer]:
    """Add a draft method from outside the package (usable as a class decorator); its name must be new."""
    if proposer.name in PROPOSERS:
        raise QuickdraftError(f"a draft method named {proposer.name!r} is registered already; give yours another name")
    PROPOSERS[proposer.name] = proposer
    return proposer


def method_class(method: str) -> type[Proposer]:
    """The proposer class of a method name."""
    cls = PROPOSERS.get(method)
    if cls is None:
        raise QuickdraftError(f"unknown speculative method {method!r}; use one of {', '.join(PROPOSERS)}")
    return cls


def option_keys() -> dict[str, list[str]]:
    """Every method's own speculative_config key -> the methods that take it."""
    owners: dict[str, list[str]] = {}
    for name, cls in PROPOSERS.items():
        for key in cls.options.keys():
            owners.setdefault(key, []).append(name)
    return owners


@dataclass(init=False, repr=False, eq=False)
class SpeculativeConfig:
    """vLLM-style speculative configuration: the settings every method has, and the chosen method's own
    (`options`, its DraftOptions dataclass, given as flat keys like vLLM's: {"method": "suffix",
    "suffix_decoding_max_tree_depth": 24}; read back as attributes too).

    method: a registered method's name (METHODS: the built-in ones, in BUILT_IN's order; or one registered
        later), inferred as draft_model when only `model` is given; its options and what it does are in its
        file, drafts/<method>.py.
    num_speculative_tokens: K, the draft length per step (the largest K when adaptive).
    adaptive: pick K per request and step from the measured acceptance and forward costs, down to plain
        decoding where speculation would lose (K=0). False: always propose num_speculative_tokens.
    model: the draft model of a method that loads one (Proposer.loads_draft_model: an alias, .gguf, directory,
        hub id or a loaded model), or what another method's file says (eagle: its head's directory). A draft
        with another tokenizer than the target's drafts over the two vocabularies' intersection (exact:
        drafts/vocab_mapping.py).
    tokenizer: the draft model's tokenizer, when `model` is a model object (a loaded model has none of its own).
    acceptance: "exact" (the default: rejection sampling, the output is the target's) or "relaxed", a LOSSY mode
        that must be asked for by name: a draft token x is also accepted whenever p_target(x) >= threshold *
        q_draft(x) (q one-hot for deterministic drafts; greedy requests compare p_target(x) with threshold times
        the target's top probability). The output then no longer follows the target's law; every output's
        metrics say `lossy`. threshold in (0, 1]: the lower, the more drafts pass and the further the output
        strays from the target's (`quickdraft check` measures how far).
    tree: token trees instead of chains (issue 25): {"max_nodes": N, "max_depth": D}, at most N draft nodes
        and D levels per sequence and step, verified in one target forward (exact: every built-in tree's
        children are DETERMINISTIC, q one-hot); "auto": the engine sizes each step's tree, down to a chain;
        None (the default): chains. Read back as a drafts.base.TreeSettings; only methods whose proposer
        proposes trees take it (tree_methods()).
    The methods' own keys are their options' fields (option_keys(): each key and the methods that take it;
    their defaults and meaning in the options' docstrings, in the methods' files). A key of another method than
    the chosen one is refused unless it has its default value.
    """

    method: str | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    model: Any = None
    tokenizer: Any = None
    adaptive: bool = True
    acceptance: str = "exact"
    threshold: float | None = None
    tree: TreeSettings | None = None

    def __init__(self, method: str | None = None, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 model: Any = None, tokenizer: Any = None, adaptive: bool = True, acceptance: str = "exact",
                 threshold: float | None = None, tree: Any = None, **options: Any):
        self.method = method if method is not None else ("draft_model" if model else "none")
        self.num_speculative_tokens, self.model, self.tokenizer = num_speculative_tokens, model, tokenizer
        self.adaptive, self.acceptance, self.threshold = adaptive, acceptance, threshold
        cls = method_class(self.method)
        k = num_speculative_tokens
        if cls.speculates and not (isinstance(k, int) and k >= 1):
            raise QuickdraftError(f"num_speculative_tokens (K) must be an integer >= 1, got {k!r}")
        self.tree = TreeSettings.from_config(tree)
        if self.tree is not None and not cls.proposes_trees:
            raise QuickdraftError(f"method {self.method!r} proposes no token trees; drop speculative_config['tree'] "
                                  f"or choose one that does: {', '.join(tree_methods())}")
        self.options = cls.options(**self._own_options(cls, options))
        self.options.check(self)
        if acceptance not in ACCEPTANCES:
            raise QuickdraftError(f"unknown acceptance {acceptance!r}; use 'exact' (lossless, the default) or "
                                  "'relaxed' (lossy, with a threshold)")
        if acceptance == "relaxed":
            t = threshold
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 < t <= 1.0):
                raise QuickdraftError(f"acceptance 'relaxed' needs a threshold in (0, 1], got {t!r}")
            self.threshold = float(t)
        elif threshold is not None:
            raise QuickdraftError("threshold applies to acceptance 'relaxed' only (a lossy mode); exact verification "
                                  "has no threshold")
        if not isinstance(adaptive, bool):
            raise QuickdraftError(f"adaptive must be true or false, got {adaptive!r}")

    def _own_options(self, cls: type[Proposer], options: dict[str, Any]) -> dict[str, Any]:
        """The given method-specific keys that are the method's own; a key of another method is refused unless
        at its default, an unknown key always."""
        owners = option_keys()
        unknown = sorted(set(options) - set(owners))
        if unknown:
            raise QuickdraftError(f"unknown speculative_config keys {unknown}; known keys: {known_keys()}")
        own = set(cls.options.keys())
        for key, value in options.items():
            if key not in own and value != PROPOSERS[owners[key][0]].options.default(key):
                methods = f"method{'s' if len(owners[key]) > 1 else ''} {', '.join(owners[key])}"
                raise QuickdraftError(f"{key} applies to {methods}; method {self.method!r} does not take it: drop "
                                      f"{key} or choose {'one of those' if len(owners[key]) > 1 else 'that'} method")
        return {key: value for key, value in options.items() if key in own}

    def __getattr__(self, name: str) -> Any:
        # The chosen method's own settings read as flat attributes too (config.num_layers), as vLLM names them.
        options = self.__dict__.get("options")
        if options is not None and name in options.keys():
            return getattr(options, name)
        raise AttributeError(f"'SpeculativeConfig' has no setting {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpeculativeConfig) and self.settings() == other.settings()

    def __repr__(self) -> str:
        return f"SpeculativeConfig({', '.join(f'{k}={v!r}' for k, v in self.settings().items())})"

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
        return cls(**config)  # an unknown key is refused with the known ones

    @property
    def relaxed_threshold(self) -> float | None:
        """The LOSSY relaxed test's threshold, or None for exact verification (the default)."""
        return self.threshold if self.acceptance == "relaxed" and self.effective_k > 0 else None

    def settings(self) -> dict[str, Any]:
        """The method and every setting that differs from its default, flat (the common ones, then the method's
        own), values as given (a model object too)."""
        out: dict[str, Any] = {"method": self.method}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "method" and value != (None if f.default is MISSING else f.default):
                out[f.name] = value.to_config() if isinstance(value, TreeSettings) else value
        out.update(self.options.settings())
        return out

    def to_dict(self) -> dict[str, Any]:
        """The settings that differ from the defaults, as JSON-able values (what `quickdraft tune` writes and
        speculative_config=FILE reads back); a model object or tokenizer cannot be written."""
        out = self.settings()
        for key, value in out.items():
            if key != "tree" and not isinstance(value, (str, int, float, bool)):  # tree: to_config's JSON
                raise QuickdraftError(f"speculative_config[{key!r}] is a {type(value).__name__}, which cannot be "
                                      "written as JSON; give a path or an alias")
        return out

    @property
    def effective_k(self) -> int:
        return self.num_speculative_tokens if method_class(self.method).speculates else 0


def tree_methods() -> list[str]:
    """The registered methods whose proposer proposes token trees (the ones speculative_config's tree applies to)."""
    return [name for name, cls in PROPOSERS.items() if cls.proposes_trees]


def known_keys() -> list[str]:
    """Every speculative_config key, sorted: the common ones and every registered method's own."""
    return sorted({f.name for f in fields(SpeculativeConfig)} | set(option_keys()))


def read_config(source: str | os.PathLike) -> dict[str, Any]:
    """A speculative_config from a JSON file (what `quickdraft tune --out` writes), or from JSON text."""
    text = str(source)
    if not text.lstrip().startswith("{"):
        if not Path(source).exists():
            hint = f' (for that method pass {{"method": "{text}"}})' if text in PROPOSERS else ""
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
    return method_class(config.method).from_config(config, context)


def _by_spelling() -> list[type[Proposer]]:
    """The methods in the order their spellings are tried and listed: catch-all spellings (a draft MODEL) last."""
    return sorted(PROPOSERS.values(), key=lambda cls: cls.spelling_catches_all)


def draft_help(default: str | None = "ngram", separator: str = " | ", trees_only: bool = False) -> str:
    """The --draft help string, from the registry's spellings (lookups first, a draft model last); trees_only:
    only the methods whose proposer proposes token trees (tree_methods(): the --tree help's list)."""
    text = separator.join(cls.spelling for cls in _by_spelling()
                          if cls.spelling and (cls.proposes_trees or not trees_only))
    return text + (f" (default: {default})" if default else "")


def parse_draft(draft: str, k: int) -> dict[str, Any]:
    """A command line's --draft string (one of draft_help's spellings) and K -> a speculative_config, each
    method reading its own spelling (the only parser of --draft: generate, serve, batch, check, tune, bench)."""
    for cls in _by_spelling():
        settings = cls.parse_spelling(draft)
        if settings is not None:
            return {"method": cls.name, **settings, **({"num_speculative_tokens": k} if cls.speculates else {})}
    raise QuickdraftError(f"--draft {draft!r}: expected one of {draft_help(None)}")


def draft_label(config: dict[str, Any] | SpeculativeConfig) -> str:
    """A speculative_config as the command line's --draft names it (layers:12, a model's name, ...)."""
    config = SpeculativeConfig.from_dict(config)
    label = method_class(config.method).label(config)
    return label if config.tree is None else f"{label} --tree {config.tree.spelling}"


__all__ = ["BUILT_IN", "METHODS", "PROPOSERS", "SpeculativeConfig", "DraftContext", "DraftOptions", "LoadedDraft",
           "Proposal", "Proposer", "NoDraft", "NgramProposer", "DraftModelProposer", "LayerSkipProposer",
           "QuantizedSelfProposer", "SuffixProposer", "EagleProposer", "ModelLookupProposer",
           "build_proposer", "draft_help", "draft_label", "known_keys", "method_class", "parse_draft", "register",
           "tree_methods", "TreeSettings"]

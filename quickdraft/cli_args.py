"""Command-line arguments more than one command takes, the one chain that turns --draft, --k, --fixed-k,
--tree and --speculative-config into a checked speculative_config (generate, serve, batch, check and the Ray
Serve app call it), and the help formatter of every command (a leaf module: quickdraft/cli.py, the tools' own
command lines and server/ray_serve.py import it, and it imports nothing of theirs).

Building a parser here imports no torch (`quickdraft --help` answers at once): the draft registry
(quickdraft/drafts) imports torch, so help strings read the methods' spellings from DRAFT_SPELLINGS until the
registry is imported; the checks that need it run when a command runs."""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

from quickdraft.errors import QuickdraftError

# The draft registry's methods as --draft spells them, in the order its draft_help lists them (a draft MODEL, the
# catch-all spelling, last), and whether each proposes token trees: help text without importing the registry.
# tests/test_cli.py checks this against the registry (a method added there and not here fails it).
DRAFT_SPELLINGS: tuple[tuple[str, bool], ...] = (
    ("none", False), ("ngram", True), ("layers:N", True), ("quantized[:int8|q4]", True), ("suffix", True),
    ("eagle[:HEAD_DIR]", True), ("lookup+MODEL", False), ("a draft MODEL", True))


def draft_help(default: str | None = "ngram", separator: str = " | ", trees_only: bool = False) -> str:
    """quickdraft.drafts.draft_help where the registry is imported already (it may hold methods registered from
    outside the package), else the same text from DRAFT_SPELLINGS (without importing torch)."""
    registry = sys.modules.get("quickdraft.drafts")
    if registry is not None and hasattr(registry, "draft_help"):
        return registry.draft_help(default, separator, trees_only)
    text = separator.join(spelling for spelling, trees in DRAFT_SPELLINGS if trees or not trees_only)
    return text + (f" (default: {default})" if default else "")


def _shows_default(action: argparse.Action) -> bool:
    default = action.default  # by identity: 0 and 0.0 are defaults worth showing, though they equal False
    return bool(action.option_strings) and not any(default is v for v in (None, False, argparse.SUPPRESS)) and \
        default != ""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, with every option's default: "(default: X)" after the help of an option whose default is a
    value (not None or False), unless its help already speaks of its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if _shows_default(action) and "default" not in text.lower():
            text += (" " if text else "") + "(default: %(default)s)"
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):  # argparse prints no help line for an option without help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class CommandParser(argparse.ArgumentParser):
    """The parser of quickdraft and of each of its commands: HelpFormatter's defaults in --help."""

    def __init__(self, *args: Any, formatter_class: type = HelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def add_sampling_filter_arguments(p) -> None:
    """--top-p, --top-k, --min-p and the three penalties, SamplingParams' names and defaults (no filter, no
    penalty); --temperature and --seed each command words its own way."""
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens whose "
                                                            "probabilities sum to P (1: all)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least P times as likely as the most likely one (0: all)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already in the text by R (1: none)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract P from the logits of tokens already generated (0: none)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract F times its count from each generated token's logit (0: none)")


def add_progress_argument(p) -> None:
    """--progress / --no-progress: the progress of the long first steps (quickdraft/progress.py)."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show the progress of long steps (the kernel build, a model's first conversion, its load) "
                        "on stderr; default: where stderr is a terminal, or as QUICKDRAFT_PROGRESS=1|0 says")


def add_draft_argument(p, default: str = "ngram") -> None:
    """--draft, its help the registry's spellings (every method's own)."""
    p.add_argument("--draft", default=default, help=draft_help(default))


def checked_speculative_config(draft: str = "ngram", k: int = 5, *, adaptive: bool = True, tree: str | None = None,
                               config: str | None = None) -> dict[str, Any]:
    """The speculative_config a command line asks for, checked before any model loads: `config`
    (--speculative-config: JSON text or a file of it), else --draft and --k, adaptive K off where `adaptive` is
    False; --tree (`tree`) on top of either. A draft model it names must resolve (an alias, file, directory or
    hub id), so that a misspelt method fails at once, listing the methods, and not after the target has loaded."""
    from quickdraft.drafts import SpeculativeConfig, method_class, parse_draft, read_config

    if config:
        spec = read_config(config)
    else:
        spec = parse_draft(draft, k)
        if not adaptive and method_class(spec["method"]).speculates:
            spec["adaptive"] = False
    spec = with_tree_argument(spec, tree)
    checked = SpeculativeConfig.from_dict(dict(spec))  # its errors now
    _check_draft_model(checked, None if config else draft)
    return spec


def _check_draft_model(config, draft: str | None) -> None:
    """Raise if `config`'s method loads a draft model named by a string that names no model. `draft`: the
    --draft text it came from (None: from --speculative-config)."""
    from quickdraft.drafts import method_class
    from quickdraft.models.sources import resolve

    cls = method_class(config.method)
    if not cls.loads_draft_model or not isinstance(config.model, str):
        return
    try:
        resolve(config.model)
    except QuickdraftError as exc:
        if draft is None:
            raise QuickdraftError(f"speculative_config's draft model: {exc}") from None
        if cls.spelling_catches_all:  # no method's spelling: read as a model
            raise QuickdraftError(
                f"--draft {draft!r} is not a draft method ({draft_help(None)}) and names no draft model: {exc}. "
                "A draft MODEL is a model alias, a .gguf file, a model directory or a hub id (org/name), e.g. "
                "--draft smollm2-135m") from None
        raise QuickdraftError(f"--draft {draft!r}: its draft model: {exc}") from None


def add_tree_argument(p) -> None:
    """--tree N,D | auto: speculative_config's "tree" (token trees of at most N nodes and D levels per step, or
    sized by the engine); on top of --draft or --speculative-config. The drafts its help names are the registry's
    that propose trees (drafts.tree_methods, through draft_help above: no torch import for the parser)."""
    p.add_argument("--tree", default=None, metavar="N,D|auto",
                   help="draft token trees of at most N nodes and D levels per step instead of chains (auto: the "
                        "engine sizes them); for drafts that propose trees: "
                        f"{draft_help(None, ', ', trees_only=True)}")


def tree_setting(text: str | None) -> str | dict[str, int] | None:
    """--tree's value as speculative_config's "tree": None (not given), "auto", or {"max_nodes": N, "max_depth": D}
    (auto:N,D: auto within those bounds). A malformed value is a QuickdraftError saying what to give."""
    if text is None:
        return None
    spelled = text.strip().lower()
    auto = spelled == "auto" or spelled.startswith("auto:")
    if spelled == "auto":
        return "auto"
    bounds = spelled[len("auto:"):] if auto else spelled
    parts = [part.strip() for part in bounds.split(",")]
    if len(parts) != 2 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise QuickdraftError(f"--tree {text!r}: expected N,D (at most N nodes and D levels, e.g. 16,6), auto, or "
                              "auto:N,D")
    setting: dict = {"max_nodes": int(parts[0]), "max_depth": int(parts[1])}
    return {**setting, "auto": True} if auto else setting


def with_tree_argument(spec: dict, text: str | None) -> dict:
    """`spec` (a speculative_config) with --tree's setting, where it was given."""
    tree = tree_setting(text)
    return spec if tree is None else {**spec, "tree": tree}

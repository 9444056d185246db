"""Command-line arguments more than one command takes (a leaf module: quickdraft/cli.py and the tools' own
command lines import it, and it imports nothing of theirs)."""

from __future__ import annotations

from quickdraft.errors import QuickdraftError


def add_sampling_filter_arguments(p) -> None:
    """--top-p, --top-k, --min-p and the three penalties, SamplingParams' names and defaults (no filter, no
    penalty); --temperature and --seed each command words its own way."""
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)


def add_tree_argument(p) -> None:
    """--tree N,D | auto: speculative_config's "tree" (token trees of at most N nodes and D levels per step, or
    sized by the engine); on top of --draft or --speculative-config. The drafts its help names are the registry's
    that propose trees (drafts.tree_methods; importing the registry imports torch, as --draft's help does)."""
    from quickdraft.drafts import draft_help

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

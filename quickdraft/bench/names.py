"""The bench's method names: its default methods, the baselines and the --methods help (a leaf module, so that
the package's face and its modules import it without a circle)."""

from quickdraft.cli_args import draft_help

DEFAULT_METHODS = "none,ngram,hf,hf-lookup"
BASELINE_HELP = "hf, hf-lookup, hf-assist:MODEL, llamacpp, llamacpp-lookup"


def method_help() -> str:
    """The draft registry's spellings (cli_args.draft_help: without importing the registry, and torch, where it is
    not imported yet), then the baselines."""
    return f"{draft_help(None, ', ')}, {BASELINE_HELP}"

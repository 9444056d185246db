"""The bench's method names: its default methods, the baselines and the --methods help (a leaf module, so that
the package's face and its modules import it without a circle)."""

DEFAULT_METHODS = "none,ngram,hf,hf-lookup"
BASELINE_HELP = "hf, hf-lookup, hf-assist:MODEL, llamacpp, llamacpp-lookup"


def method_help() -> str:
    """The draft registry's spellings (importing it imports torch), then the baselines."""
    from quickdraft.drafts import draft_help

    return f"{draft_help(None, ', ')}, {BASELINE_HELP}"

"""`quickdraft bench`: speed, acceptance and exactness of the draft methods and baselines on Spec-Bench.

Modules: dataset (Spec-Bench JSONL and prompts), methods (one runner per method), costs (measured forward
costs and the analytic speedup model), greedy (the exactness check), report (statistics, JSON, table,
plots), run (the orchestration: `run_bench`), cli (the command line). Importing this package stays light (no torch;
METHOD_HELP, read from the draft registry, imports it).
"""

DEFAULT_METHODS = "none,ngram,hf,hf-lookup"
BASELINE_HELP = "hf, hf-lookup, hf-assist:MODEL, llamacpp, llamacpp-lookup"

__all__ = ["BenchConfig", "run_bench", "METHOD_HELP"]


def __getattr__(name):
    if name == "METHOD_HELP":  # the draft registry's spellings (importing it imports torch), then the baselines
        from quickdraft.drafts import draft_help

        return f"{draft_help(None, ', ')}, {BASELINE_HELP}"
    if name in ("BenchConfig", "run_bench"):
        from quickdraft.bench import run

        return getattr(run, name)
    raise AttributeError(f"module 'quickdraft.bench' has no attribute {name!r}")

"""`quickdraft bench`: speed, acceptance and exactness of the draft methods and baselines on Spec-Bench.

Modules: dataset (Spec-Bench JSONL and prompts), methods (one runner per method), costs (measured forward
costs and the analytic speedup model), greedy (the exactness check), report (statistics, JSON, table,
plots), run (the orchestration: `run_bench`), cli (the command line). Importing this package stays light (no torch),
so that building the command line parser costs nothing.
"""

DEFAULT_METHODS = "none,ngram,hf,hf-lookup"
METHOD_HELP = "none, ngram, suffix, eagle[:HEAD_DIR], layers:N, quantized[:int8|q4], a draft MODEL, hf, hf-lookup, hf-assist:MODEL, llamacpp, llamacpp-lookup"

__all__ = ["BenchConfig", "run_bench", "METHOD_HELP"]


def __getattr__(name):
    if name in ("BenchConfig", "run_bench"):
        from quickdraft.bench import run

        return getattr(run, name)
    raise AttributeError(f"module 'quickdraft.bench' has no attribute {name!r}")

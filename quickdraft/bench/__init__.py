"""`quickdraft bench`: speed, acceptance and exactness of the draft methods and baselines on Spec-Bench.

Modules: dataset (Spec-Bench JSONL and prompts), methods (one runner per method), costs (measured forward
costs and the analytic speedup model), greedy (the exactness check), report (statistics, JSON, table,
plots), run (the orchestration: `run_bench`), cli (the command line). Importing this package, and cli, stays light (no
torch: `quickdraft bench --help`; names.method_help reads the methods through cli_args.draft_help).
"""

from quickdraft.bench.names import BASELINE_HELP, DEFAULT_METHODS, method_help

__all__ = ["BASELINE_HELP", "DEFAULT_METHODS", "METHOD_HELP", "BenchConfig", "run_bench"]


def __getattr__(name):
    if name == "METHOD_HELP":
        return method_help()
    if name in ("BenchConfig", "run_bench"):
        from quickdraft.bench import run

        return getattr(run, name)
    raise AttributeError(f"module 'quickdraft.bench' has no attribute {name!r}")

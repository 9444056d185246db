"""Command-line arguments more than one command takes (a leaf module: quickdraft/cli.py and the tools' own
command lines import it, and it imports nothing of theirs)."""

from __future__ import annotations


def add_sampling_filter_arguments(p) -> None:
    """--top-p, --top-k, --min-p and the three penalties, SamplingParams' names and defaults (no filter, no
    penalty); --temperature and --seed each command words its own way."""
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)

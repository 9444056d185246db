"""`quickdraft distill` on the command line: its arguments and their defaults, checked before anything loads. The
training (tools/distill.py) imports torch, so it is imported when the command runs: `quickdraft distill --help`
and a refused argument import no torch."""

from __future__ import annotations

import argparse

from quickdraft.cli_args import add_progress_argument
from quickdraft.errors import QuickdraftError

DEFAULT_TOKENS = 200_000
DEFAULT_VOCAB = 16_384
DEFAULT_EPOCHS = 4
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_TEMPERATURES = (0.0, 0.8)


def add_parser(sub) -> None:
    summary = "train an EAGLE draft head for a model by self-distillation (then: --draft eagle:HEAD_DIR)"
    p = sub.add_parser("distill", help=summary, description=summary)
    p.add_argument("--model", default=None, help="alias (smollm2-135m, gemma3-270m), .gguf, directory or hub id")
    p.add_argument("--out", required=True, help="the head's directory (also holds the resumable work/)")
    p.add_argument("--prompts", default=None, help="prompts to answer (text, or JSONL as `check` reads); default: "
                                                   "the model writes its own")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"training tokens to generate: the budget (default {DEFAULT_TOKENS})")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                   help=f"tokens the head scores (default {DEFAULT_VOCAB}, the most frequent in the data)")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="passes over the generated training data")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate at its peak (after a linear warm-up, "
                                                          "then a cosine decay)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded positions per training batch")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="answer length cap")
    p.add_argument("--temperatures", default=",".join(str(t) for t in DEFAULT_TEMPERATURES),
                   help="answers' temperatures, used in turn (default 0,0.8)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="the target's dtype while generating (default auto)")
    p.add_argument("--seed", type=int, default=0, help="the head's initialisation and the batches' order (the data "
                                                       "is sampled unseeded)")
    p.add_argument("--checkpoint-every", type=int, default=200, help="training steps between checkpoints")
    add_progress_argument(p)
    p.set_defaults(func=run_distill)


def read_temperatures(text: str) -> tuple[float, ...]:
    """--temperatures: numbers >= 0 separated by commas."""
    try:
        temperatures = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise QuickdraftError(f"--temperatures must be numbers separated by commas, got {text!r}") from None
    if any(not t >= 0 for t in temperatures):
        raise QuickdraftError(f"--temperatures must be >= 0, got {text!r}")
    return temperatures


def run_distill(args: argparse.Namespace) -> int:
    """Checks the arguments, then trains (tools/distill.py, which imports torch: imported only now, so that a bad
    argument fails at once)."""
    for option, value, least in (("--tokens", args.tokens, 100), ("--vocab-size", args.vocab_size, 2),
                                 ("--epochs", args.epochs, 1), ("--checkpoint-every", args.checkpoint_every, 1)):
        if value < least:
            raise QuickdraftError(f"{option} must be at least {least}, got {value}")
    temperatures = read_temperatures(args.temperatures)
    from quickdraft.tools import distill

    return distill.run(args, temperatures)

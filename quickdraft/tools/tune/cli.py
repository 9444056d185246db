"""`quickdraft tune` on the command line: its arguments, checked before the model loads, and the report printed.

Importing this module (and building the parser: `quickdraft tune --help`) imports no torch: the arguments' defaults
come from tools/tune/defaults.py and --drafts' methods from cli_args.draft_help; the modules that measure are
imported by run_tune."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from quickdraft.cli_args import add_progress_argument, add_tree_argument, draft_help, with_tree_argument
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.tools.prompts import read_prompts
from quickdraft.tools.tune.defaults import DEFAULT_DRAFTS, DEFAULT_K_MAX, DEFAULT_MAX_TOKENS


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure drafts and K on your prompts and write the best speculative_config",
                       description="Measure each draft's acceptance by position, its KL/TV to the target (model "
                                   "drafts), the step costs and the predicted and measured speedups on your prompts; "
                                   "print a ranked table and write the recommended speculative_config as JSON.")
    p.add_argument("--model", default=None, help="alias (smollm2-135m, gemma3-270m), .gguf, directory or hub id")
    p.add_argument("--prompts", required=True,
                   help="a text file of one prompt per line, or JSONL: Spec-Bench records (first turn) or "
                        "{\"prompt\": ...} / {\"prompt_token_ids\": [...]} records")
    p.add_argument("--drafts", default=DEFAULT_DRAFTS,
                   help=f"comma list of drafts as --draft takes them: {draft_help(DEFAULT_DRAFTS)}")
    add_tree_argument(p)
    p.add_argument("--k-max", type=int, default=DEFAULT_K_MAX, help=f"largest K tried (default {DEFAULT_K_MAX})")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens generated per prompt (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None,
                   help="with a temperature: the seed each prompt's own seed derives from (default 0)")
    p.add_argument("--out", default=None, help="write the recommended speculative_config here as JSON")
    p.add_argument("--sweep", action="store_true",
                   help="also measure every draft at every K in 1..k-max and report the pick's speed as a fraction "
                        "of the fastest")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "hf"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    add_progress_argument(p)
    p.set_defaults(func=run_tune)


def _check_out_path(out: str | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.is_dir():
        raise QuickdraftError(f"--out {out} is a directory; give a file name such as {path / 'speculative.json'}")
    if not path.parent.is_dir():
        raise QuickdraftError(f"--out {out}: directory {path.parent} does not exist; create it or write elsewhere")
    return path


def tree_candidates(drafts: str, k_max: int, tree: str | None) -> str | list[dict]:
    """--drafts, checked, with --tree's setting on every draft (a draft that proposes no trees is refused by
    name) where it is given."""
    from quickdraft.tools.tune.candidates import parse_candidates

    candidates = parse_candidates(drafts, k_max)
    if tree is None:
        return drafts
    treed = [with_tree_argument(c.config, tree) for c in candidates]
    parse_candidates(treed, k_max)  # the tree's errors before the model loads
    return treed


def load_llm(args: argparse.Namespace):
    """The target for `quickdraft tune` (plain: each draft is attached to it in turn)."""
    from quickdraft import LLM
    from quickdraft.models.loader import DEFAULT_MODEL

    return LLM(args.model or DEFAULT_MODEL, speculative_config={"method": "none"}, dtype=args.dtype,
               device=args.device, runner=args.runner, trust_remote_code=args.trust_remote_code)


def run_tune(args: argparse.Namespace) -> int:
    import torch

    from quickdraft.models.loader import quiet_transformers
    from quickdraft.tools.tune.tuning import tune

    # Everything that can be checked is checked before the model loads.
    prompts = read_prompts(args.prompts)
    drafts = tree_candidates(args.drafts, args.k_max, args.tree)
    out = _check_out_path(args.out)
    if args.threads is not None and args.threads < 1:
        raise QuickdraftError(f"--threads must be >= 1, got {args.threads}")
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    except QuickdraftError as exc:
        raise QuickdraftError(f"--{str(exc).split(' ', 1)[0].replace('_', '-')}: {exc}") from None
    if args.max_tokens < 2:
        raise QuickdraftError(f"--max-tokens must be >= 2 (speeds are measured after the first token), "
                              f"got {args.max_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)

    def progress(message: str) -> None:
        print(f"[tune] {message}", file=sys.stderr, flush=True)

    quiet_transformers()
    progress(f"loading {args.model or 'the default model'} ...")
    llm = load_llm(args)
    report = tune(llm, prompts, drafts, args.k_max, params, chat=args.chat, sweep=args.sweep, progress=progress)
    print(report.render())
    if out is not None:
        out.write_text(report.recommended_json + "\n", encoding="utf-8")
        print(f"wrote the recommended speculative_config to {out}")
    print(f"[tune] done in {report.elapsed_s:.0f} s", file=sys.stderr)
    return 0

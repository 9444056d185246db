"""The app under a real uvicorn on a loopback port (in a thread): a client that drops mid-stream (or gives up
waiting for a whole response) has its request aborted and its KV blocks freed, a full queue answers 503 with
Retry-After, a shutdown drains (new requests 503, in-flight ones finish, then the server exits), a body nested
5,000 deep is a 400 the server survives, and a bounded burst of concurrent requests all get exactly
LLM.generate's greedy text. Steps are held with a StepGate where a test needs requests in flight; no timing
assertions."""

from __future__ import annotations

import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from quickdraft import SamplingParams
from tiny_server import (MODEL_NAME, TIMEOUT_S, StepGate, config, live_server, metric, sse_events, tiny_llm,
                         wait_until, words)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

LONG = {"prompt": words(1, 2, 3, 1, 2, 3), "max_tokens": 100, "temperature": 0, "ignore_eos": True}


def stream_completion(base: str, body: dict) -> tuple[int, list]:
    response = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT_S)
    return response.status_code, sse_events(response.text.splitlines())


def test_client_disconnect_mid_stream_aborts_and_frees_kv():
    llm = tiny_llm(kv_cache_memory=64 * 16 * 256)  # 64 blocks of 16 positions at 256 bytes per token
    with live_server(llm, config()) as (base, server):
        engine = server.state.engine
        gate = StepGate(engine.scheduler)
        with httpx.Client(timeout=TIMEOUT_S) as client:
            with client.stream("POST", f"{base}/v1/completions", json={**LONG, "stream": True}) as response:
                assert response.status_code == 200
                gate.allow(2)
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert '"text"' in first
                assert (engine.stats.kv_usage or {}).get("used_blocks", 0) > 0
            # the response is closed here: the client is gone after 2 of its 100 tokens' steps
        wait_until(lambda: engine.num_unfinished == 0, what="the server to abort the dropped stream")
        gate.open()
        wait_until(lambda: engine.stats.num_running == 0 and engine.stats.num_waiting == 0
                   and engine.stats.kv_usage["used_blocks"] == 0, what="the KV blocks to be freed")
        assert not engine.scheduler.has_unfinished()
        text = httpx.get(f"{base}/metrics").text
        assert metric(text, "vllm:request_success_total", finished_reason="abort", model_name=MODEL_NAME) == 1
        assert metric(text, "vllm:generation_tokens_total", model_name=MODEL_NAME) < 100
        # and the server goes on serving
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "w1", "max_tokens": 3},
                          timeout=TIMEOUT_S).status_code == 200


def test_client_that_gives_up_on_a_whole_response_is_aborted():
    llm = tiny_llm()
    with live_server(llm, config()) as (base, server):
        engine = server.state.engine
        gate = StepGate(engine.scheduler)  # no step runs: the response cannot come before the client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=LONG, timeout=httpx.Timeout(TIMEOUT_S, read=1.0))
        wait_until(lambda: engine.num_unfinished == 0, what="the server to abort the abandoned request")
        gate.open()
        wait_until(lambda: engine.stats.num_running == 0 and engine.stats.num_waiting == 0,
                   what="the scheduler to drop it")
        # the abort is counted when the server's request handler sees it, which may come after the scheduler drops it
        wait_until(lambda: metric(httpx.get(f"{base}/metrics").text, "vllm:request_success_total",
                                  finished_reason="abort", model_name=MODEL_NAME) == 1, what="the abort to be counted")


def test_full_queue_answers_503_with_retry_after():
    llm = tiny_llm()
    with live_server(llm, config(max_queue=2)) as (base, server):
        engine = server.state.engine
        gate = StepGate(engine.scheduler)
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream_completion, base, {**LONG, "max_tokens": 8}) for _ in range(2)]
            wait_until(lambda: engine.num_unfinished == 2, what="two requests in flight")
            response = httpx.post(f"{base}/v1/completions", json={"prompt": "w1", "max_tokens": 2},
                                  timeout=TIMEOUT_S)
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "ServiceUnavailableError"
            gate.open()
            for future in streams:
                status, events = future.result(TIMEOUT_S)
                assert status == 200 and events[-1] == "[DONE]"
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "w1", "max_tokens": 2},
                          timeout=TIMEOUT_S).status_code == 200


def test_shutdown_drains_then_exits():
    llm = tiny_llm()
    reference = llm.generate(LONG["prompt"], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    with live_server(llm, config(drain_grace_s=TIMEOUT_S)) as (base, server):
        state = server.state
        gate = StepGate(state.engine.scheduler)
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(stream_completion, base, {**LONG, "max_tokens": 40})
            wait_until(lambda: state.engine.num_unfinished == 1, what="a request in flight")
            server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
            wait_until(lambda: state.draining, what="the drain to start")
            response = httpx.post(f"{base}/v1/completions", json={"prompt": "w1", "max_tokens": 2},
                                  timeout=TIMEOUT_S)
            assert response.status_code == 503
            assert httpx.get(f"{base}/health", timeout=TIMEOUT_S).status_code == 503
            assert not server.should_exit  # still waiting for the request in flight
            gate.open()
            status, events = in_flight.result(TIMEOUT_S)
        assert status == 200 and events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == reference
        wait_until(lambda: server.should_exit, what="the server to exit after the drain")


def test_body_nested_5000_deep_is_400_and_the_server_stays_up():
    deep = "[" * 5000 + "]" * 5000
    with live_server(tiny_llm(), config()) as (base, _):
        with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client:
            response = client.post("/v1/chat/completions", content=('{"messages": %s}' % deep).encode(),
                                   headers={"content-type": "application/json"})
            assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"
            assert "nested too deeply" in response.json()["error"]["message"]
            assert client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2}).status_code == 200
            assert client.get("/health").status_code == 200


def test_concurrent_burst_gets_exact_greedy_text():
    llm = tiny_llm()
    prompts = [words(i % 50, (i * 7) % 50, (i * 3) % 50, i % 50) for i in range(32)]
    references = [out.outputs[0].text for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))]

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": prompts[i], "max_tokens": 12, "temperature": 0}
        if i % 2:
            response = await client.post("/v1/completions", json={**body, "stream": True})
            events = sse_events(response.text.splitlines())
            assert events[-1] == "[DONE]"
            return "".join(e["choices"][0]["text"] for e in events[:-1])
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    async def burst(base: str) -> list[str]:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT_S, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(len(prompts)))),
                                          TIMEOUT_S)

    with live_server(llm, config()) as (base, server):
        assert asyncio.run(burst(base)) == references
        assert server.state.engine.num_unfinished == 0

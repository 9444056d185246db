"""`quickdraft serve --replicas 2` (Ray Serve) stopped by SIGTERM to its own process id while 4 streams run: the
application's replicas drain before Ray Serve's proxy, which carries the streams to their clients, is shut down, so
every stream ends whole (LLM.generate's text, its final chunk, then [DONE]); the process exits 0 and none of the
processes it started is left running. A module of its own: the server starts its own local Ray (RAY_ADDRESS=local),
and test_ray_serve's module-scoped instance is gone by the time this one runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import psutil
import pytest

from quickdraft import LLM, SamplingParams
from tiny_server import TIMEOUT_S, free_port, needs_ray, sse_events, tiny_model, tiny_tokenizer, wait_serving, words

pytestmark = [pytest.mark.usefixtures("one_thread"),  # tiny models: see conftest.one_thread
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]

STREAMS = 4
MAX_TOKENS = 600  # one token a step (no drafts): long enough that the streams are mid-way when the signal lands
PROMPT = words(1, 2, 3)
# Ray, its proxy and two replicas take a loaded 2-core machine minutes to start; the wait ends as soon as the server
# announces it serves (or exits), this only bounds a server that never does.
START_S = 900


def _marking_first(lines: Iterator[str], first: threading.Event) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            first.set()
        yield line


def _stop_tree(process: subprocess.Popen) -> None:
    """A test that failed midway: its server and the Ray processes under it, by their own ids."""
    if process.poll() is None:
        children = psutil.Process(process.pid).children(recursive=True)
        process.kill()
        process.wait(TIMEOUT_S)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


@needs_ray
def test_sigterm_behind_ray_finishes_every_stream_then_exits(tmp_path):
    model_dir = tmp_path / "tiny-model"
    tiny_model(max_len=1024).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", speculative_config={"method": "none"})
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))[0].outputs[0].text

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "quickdraft.cli", "serve", "--model", str(model_dir), "--dtype", "float32",
               "--device", "cpu", "--draft", "none", "--port", str(port), "--served-model-name", "tiny",
               "--replicas", "2", "--grace-period", str(TIMEOUT_S), "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ADDRESS": "local"}  # a Ray of its own, never one another process started
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_serving(base, process, log_path, announcement="[quickdraft] serving on", timeout_s=START_S)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        first_chunks = [threading.Event() for _ in range(STREAMS)]

        def stream(index: int) -> tuple[int, list]:
            try:
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
                    return response.status_code, sse_events(_marking_first(response.iter_lines(), first_chunks[index]))
            finally:
                first_chunks[index].set()  # a failed stream does not hold the test up

        with ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(stream, index) for index in range(STREAMS)]
            assert all(first.wait(TIMEOUT_S) for first in first_chunks)
            started = psutil.Process(process.pid).children(recursive=True)  # Ray's processes, workers included
            os.kill(process.pid, signal.SIGTERM)
            results = [future.result() for future in futures]

        for status, events in results:
            assert status == 200 and events[-1] == "[DONE]", (status, events[-3:])
            chunks = events[:-1]
            assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == expected
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert process.wait(TIMEOUT_S) == 0, log_path.read_text()
        _, alive = psutil.wait_procs(started, timeout=TIMEOUT_S)
        assert not alive, [(p.pid, p.name()) for p in alive]
        assert "Traceback" not in log_path.read_text(), log_path.read_text()
    finally:
        _stop_tree(process)

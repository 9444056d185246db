"""Shared pieces of the server tests: a tiny random Llama with a word-level tokenizer and chat template, a
uvicorn server on a free loopback port in a thread, and an SSE reader. (Not a conftest: tests import
`from conftest import ...` for the top-level one, and a second conftest module would shadow it.)"""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from conftest import tiny_llama
from quickdraft import LLM
from quickdraft.server.app import ServerConfig
from quickdraft.server.launch import GracefulServer, make_server

WORDS = ["<unk>", "<s>", "</s>", "<user>", "<assistant>", "<system>"] + [f"w{i}" for i in range(58)]  # 64 tokens
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
MODEL_NAME = "tiny"
TIMEOUT_S = 120  # generous: the machine is small and shared
RAY_MISSING = importlib.util.find_spec("ray") is None
needs_ray = pytest.mark.skipif(RAY_MISSING, reason="ray is not installed: pip install 'quickdraft[ray]' to run the "
                                                   "Ray Serve tests")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(max_len: int = 128):
    return tiny_llama(vocab_size=len(WORDS), layers=2, max_len=max_len)


def tiny_llm(draft: dict | None = None, max_len: int = 128, **kwargs) -> LLM:
    """A tiny LLM (n-gram drafts, K = 4, by default) with the word-level tokenizer. K is fixed: adaptive K
    picks drafts from measured times, and in float32 a different number of rows could round a near-tie
    differently, which would make greedy comparisons depend on the machine's noise."""
    spec = draft or {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    return LLM(tiny_model(max_len), tokenizer=tiny_tokenizer(), speculative_config=spec, dtype="float32",
               device="cpu", **kwargs)


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def config(**overrides) -> ServerConfig:
    return ServerConfig(served_model_name=MODEL_NAME, **overrides)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, timeout_s: float = TIMEOUT_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_serving(base: str, process: subprocess.Popen, log_path: Path, announcement: str | None = None,
                 timeout_s: float = TIMEOUT_S) -> None:
    """Until the server `process` (its output in log_path) has printed `announcement` (when given) and answers
    /health with 200; fails with its log if it exits first, or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited early:\n{log_path.read_text()}"
        if announcement is None or announcement in log_path.read_text():
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"the server did not start serving within {timeout_s} s:\n{log_path.read_text()}")


class ErrorRecords(logging.Handler):
    """Collects the ERROR records of the server's loggers: an exception in the app is a failed test."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def live_server(llm: LLM, server_config: ServerConfig) -> Iterator[tuple[str, GracefulServer]]:
    """uvicorn on a free loopback port in a thread: (base url, server); server.state is the app's state. Fails
    if the app logged an error."""
    server = make_server(llm, server_config, "127.0.0.1", free_port(), log_level="warning")
    errors = ErrorRecords()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "quickdraft.server")]
    for logger in loggers:
        logger.addHandler(errors)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), what="uvicorn to start")
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{server.config.port}", server
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)
        for logger in loggers:
            logger.removeHandler(errors)
        assert not thread.is_alive(), "uvicorn did not stop"
    assert not errors.records, [errors.format(record) for record in errors.records]


def sse_events(lines: Iterator[str]) -> list[dict | str]:
    """The `data:` payloads of an SSE body, parsed (the final "[DONE]" kept as a string)."""
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the Prometheus samples called `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


class StepGate:
    """Holds a scheduler's steps on the engine thread until the test allows them (`allow(n)` lets n through,
    `open()` all): requests stay in flight as long as a test needs, with no timing."""

    def __init__(self, scheduler):
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        step = scheduler.step

        def gated_step():
            while not self._open.is_set() and not self._permits.acquire(timeout=0.02):
                pass
            return step()

        scheduler.step = gated_step

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def open(self) -> None:
        self._open.set()

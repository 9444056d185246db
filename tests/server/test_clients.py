"""The official `openai` client, sync and async, streaming and not, against `quickdraft serve` run as a user
runs it: a subprocess on a free loopback port, stopped by SIGTERM to its own process id (it must exit 0).

Two servers: a tiny random Llama saved to a directory (fast), and the packaged SmolLM2-135M-Instruct (slow:
`-m slow` selects it, `-m "not slow"` leaves it out). Over each: greedy text over HTTP equals offline
`LLM.generate` / `LLM.chat` with the same model, dtype and draft settings (built in this process); streamed
deltas concatenate to the non-streamed text (stop strings included); usage counts are the tokens
(prompt_tokens: the prompt's ids, completion_tokens: the output's ids, both also returned with vLLM's
`return_token_ids`). Greedy comparisons under concurrency need a batch-invariant forward: the tiny model's
outputs are far from ties; SmolLM2's requests run concurrently only where its runner is rows_invariant
(bf16 on quickdraft's CPU kernels), else one at a time. No timing assertions; generous timeouts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from quickdraft import LLM, SamplingParams
from tiny_server import TIMEOUT_S, free_port, tiny_model, tiny_tokenizer, words

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

STARTUP_TIMEOUT_S = 600  # SmolLM2's first load converts its GGUF (tens of seconds, minutes on a busy machine)
SMOLLM2_K = 5


@dataclass
class Served:
    """A `quickdraft serve` subprocess and the offline LLM it must agree with."""

    name: str  # the served model name clients send
    base: str
    process: subprocess.Popen
    log_path: Path
    llm: LLM  # offline, in this process: same model, dtype and draft settings
    prompts: list[str]
    chats: list[list[dict[str, str]]]
    max_tokens: int
    concurrent: bool  # whether greedy text is exact under concurrent requests (see the module docstring)
    references: dict = field(default_factory=dict)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    def greedy(self, **kwargs) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=self.max_tokens, **kwargs)

    def completion(self, prompt: str, stop: list[str] | None = None):
        """Offline LLM.generate's output (cached)."""
        key = ("completion", prompt, tuple(stop or ()))
        if key not in self.references:
            self.references[key] = self.llm.generate(prompt, self.greedy(stop=stop))[0]
        return self.references[key]

    def chat(self, messages: list[dict[str, str]]):
        key = ("chat", repr(messages))
        if key not in self.references:
            self.references[key] = self.llm.chat(messages, self.greedy())[0]
        return self.references[key]

    def stop_for(self, prompt: str) -> str:
        """A word from the middle of the prompt's greedy completion: a stop string that cuts it."""
        text = self.completion(prompt).outputs[0].text
        parts = text.split()
        assert len(parts) >= 4, f"the completion is too short to cut: {text!r}"
        return parts[len(parts) // 2]


def start_server(args: list[str], log_path: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "quickdraft.cli", "serve", *args, "--port", str(port), "--log-level", "warning",
               "--grace-period", str(TIMEOUT_S)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, f"the server exited early:\n{log_path.read_text()}"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    return base, process
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not become healthy:\n{log_path.read_text()}"
            time.sleep(0.25)
    except BaseException:
        stop_server(process)
        raise


def stop_server(process: subprocess.Popen) -> int:
    """SIGTERM to the server's own pid; its exit status (killed, and AssertionError, if it does not exit)."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
    try:
        return process.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(TIMEOUT_S)
        raise AssertionError("the server did not exit within the timeout after SIGTERM") from None


def serve_tiny(tmp_path: Path) -> Served:
    model_dir = tmp_path / "tiny-model"
    tiny_model().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    llm = LLM(str(model_dir), dtype="float32", device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    base, process = start_server(["--model", str(model_dir), "--served-model-name", "tiny", "--dtype", "float32",
                                  "--device", "cpu", "--draft", "ngram", "--k", "4", "--fixed-k"],
                                 tmp_path / "server.log")
    prompts = [words(1, 2, 3, 4, 1, 2, 3, 4, 1), words(7, 30, 12), words(40, 41, 40, 41, 40), words(9)]
    chats = [[{"role": "user", "content": words(8, 9, 10, 8, 9)}],
             [{"role": "system", "content": words(5, 6)}, {"role": "user", "content": words(20, 21, 22)}],
             [{"role": "user", "content": words(3)}, {"role": "assistant", "content": words(4, 5)},
              {"role": "user", "content": words(33, 34, 33)}]]
    return Served("tiny", base, process, tmp_path / "server.log", llm, prompts, chats, max_tokens=24,
                  concurrent=True)


def serve_smollm2(tmp_path: Path) -> Served:
    from quickdraft.kernels import cpu_has_bf16

    dtype = "bfloat16" if cpu_has_bf16() else "float32"  # what "auto" picks; stated on both sides
    llm = LLM("smollm2-135m", dtype=dtype, device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": SMOLLM2_K, "adaptive": False})
    base, process = start_server(["--model", "smollm2-135m", "--dtype", dtype, "--device", "cpu", "--draft", "ngram",
                                  "--k", str(SMOLLM2_K), "--fixed-k"], tmp_path / "server.log")
    prompts = ["Once upon a time, in a small village by the sea,",
               "The three primary colors are",
               "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
    chats = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
             [{"role": "user", "content": "Repeat this sentence exactly twice: The quick brown fox jumps over "
                                          "the lazy dog."}],
             [{"role": "system", "content": "You are a concise assistant."},
              {"role": "user", "content": "Name three fruits that are red."}]]
    return Served("smollm2-135m", base, process, tmp_path / "server.log", llm, prompts, chats, max_tokens=40,
                  concurrent=llm.target.rows_invariant)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def served(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(request.param)
    server = (serve_tiny if request.param == "tiny" else serve_smollm2)(tmp_path)
    try:
        yield server
    finally:
        if server.process.poll() is None:  # test_sigterm_stops_the_server did not run (a -k selection)
            try:
                stop_server(server.process)
            except AssertionError:
                pass


def check_usage(usage, output) -> None:
    """OpenAI usage against an offline RequestOutput: the prompt's and the output's token counts."""
    assert usage.prompt_tokens == len(output.prompt_token_ids)
    assert usage.completion_tokens == len(output.outputs[0].token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# --- the sync client ----------------------------------------------------------------------------------------------
def test_models_lists_the_served_name(served):
    assert [m.id for m in served.client().models.list()] == [served.name]


def test_sync_completions_equal_generate(served):
    client = served.client()
    for prompt in served.prompts:
        expected = served.completion(prompt)
        out = client.completions.create(model=served.name, prompt=prompt, max_tokens=served.max_tokens,
                                        temperature=0, extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.text == expected.outputs[0].text, prompt
        assert choice.finish_reason == expected.outputs[0].finish_reason
        assert choice.model_extra["token_ids"] == expected.outputs[0].token_ids
        assert choice.model_extra["prompt_token_ids"] == expected.prompt_token_ids
        check_usage(out.usage, expected)
        assert out.model_extra["spec_decode"]["draft_tokens"] >= out.model_extra["spec_decode"]["accepted_tokens"]

        chunks = list(client.completions.create(model=served.name, prompt=prompt, max_tokens=served.max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        assert not chunks[-1].choices and chunks[-1].usage == out.usage


def test_speculation_per_request_through_extra_body(served):
    """quickdraft's num_speculative_tokens in the OpenAI client's extra_body: 0 turns speculation off for that
    request, 1 caps its drafts at one a step (the server's K is 4); the text is the same."""
    client = served.client()
    prompt = served.prompts[0]
    expected = served.completion(prompt).outputs[0].text
    spec = {}
    for k in (0, 1, None):
        out = client.completions.create(model=served.name, prompt=prompt, max_tokens=served.max_tokens,
                                        temperature=0, extra_body={} if k is None else {"num_speculative_tokens": k})
        assert out.choices[0].text == expected
        spec[k] = out.model_extra["spec_decode"]
    assert spec[0]["draft_tokens"] == 0
    assert 0 < spec[1]["draft_tokens"] == spec[1]["num_drafts"]  # one token a draft
    assert spec[None]["draft_tokens"] > 0  # the server's own K otherwise


def test_sync_chat_equals_llm_chat(served):
    client = served.client()
    for messages in served.chats:
        expected = served.chat(messages)
        out = client.chat.completions.create(model=served.name, messages=messages, max_tokens=served.max_tokens,
                                             temperature=0, extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == expected.outputs[0].text, messages
        assert choice.finish_reason == expected.outputs[0].finish_reason
        assert choice.model_extra["token_ids"] == expected.outputs[0].token_ids
        assert out.model_extra["prompt_token_ids"] == expected.prompt_token_ids
        check_usage(out.usage, expected)

        chunks = list(client.chat.completions.create(model=served.name, messages=messages,
                                                     max_tokens=served.max_tokens, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        assert not chunks[-1].choices and chunks[-1].usage == out.usage


def test_logprobs_echo_and_logit_bias_through_the_client(served):
    """logprobs / top_logprobs (chat), logprobs + echo (completions) and logit_bias as the openai client sends
    them: the server's log-probabilities are offline LLM.generate's (raw, from the verification forward)."""
    client = served.client()
    prompt, messages = served.prompts[0], served.chats[0]
    expected = served.llm.generate(prompt, served.greedy(logprobs=2, prompt_logprobs=2))[0]
    want = [e[t].logprob for e, t in zip(expected.outputs[0].logprobs, expected.outputs[0].token_ids)]
    out = client.completions.create(model=served.name, prompt=prompt, max_tokens=served.max_tokens, temperature=0,
                                    logprobs=2, echo=True)
    logprobs = out.choices[0].logprobs
    n_prompt = len(expected.prompt_token_ids)
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == n_prompt + len(want)
    assert logprobs.token_logprobs[n_prompt:] == pytest.approx(want, abs=1e-4)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert out.choices[0].text.endswith(expected.outputs[0].text)

    chat_expected = served.llm.chat(messages, served.greedy(logprobs=3))[0].outputs[0]
    chat = client.chat.completions.create(model=served.name, messages=messages, max_tokens=served.max_tokens,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [e[t].logprob for e, t in zip(chat_expected.logprobs, chat_expected.token_ids)], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 for c in content)

    banned = expected.outputs[0].token_ids[0]  # the greedy first token, made impossible
    biased = client.completions.create(model=served.name, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(banned): -100}, extra_body={"return_token_ids": True})
    assert biased.choices[0].model_extra["token_ids"][0] != banned
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=served.name, prompt=prompt, max_tokens=4, logit_bias={"1": 500})


def test_structured_outputs_response_format_and_tools_through_the_client(served):
    """vLLM's structured_outputs (extra_body), OpenAI's response_format (json_schema, where the model's tokens
    can spell JSON) and tools (refused with a 400 naming the field: neither template renders tools)."""
    import json
    import re

    client = served.client()
    messages = served.chats[0]
    regex = "(w1|w2)*" if served.name == "tiny" else "[0-9]{3}-[a-z]{3}"
    out = client.chat.completions.create(model=served.name, messages=messages, max_tokens=served.max_tokens,
                                         temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    text = out.choices[0].message.content
    assert re.fullmatch(regex, text.replace(" ", "") if served.name == "tiny" else text), text
    if served.name != "tiny":  # the tiny model's tokens are words: it cannot write JSON
        schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                  "additionalProperties": False}
        out = client.chat.completions.create(
            model=served.name, messages=messages, max_tokens=served.max_tokens, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        assert set(json.loads(out.choices[0].message.content)) == {"answer"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        client.chat.completions.create(model=served.name, messages=messages, max_tokens=4, tools=[tool])


def test_sync_stop_string_streamed_and_whole(served):
    client = served.client()
    prompt = served.prompts[0]
    stop = served.stop_for(prompt)
    expected = served.completion(prompt, stop=[stop])
    assert expected.outputs[0].finish_reason == "stop"
    out = client.completions.create(model=served.name, prompt=prompt, max_tokens=served.max_tokens, temperature=0,
                                    stop=[stop], extra_body={"return_token_ids": True})
    assert out.choices[0].text == expected.outputs[0].text and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["token_ids"] == expected.outputs[0].token_ids
    check_usage(out.usage, expected)
    chunks = list(client.completions.create(model=served.name, prompt=prompt, max_tokens=served.max_tokens,
                                            temperature=0, stop=[stop], stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage == out.usage  # the tokens a stop string cut are not counted


# --- the async client ---------------------------------------------------------------------------------------------
async def _async_completion(client: openai.AsyncOpenAI, served: Served, prompt: str, stream: bool):
    """(text, finish reason, usage) of one completion through AsyncOpenAI."""
    kwargs = dict(model=served.name, prompt=prompt, max_tokens=served.max_tokens, temperature=0)
    if not stream:
        out = await client.completions.create(**kwargs)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage
    text, reason, usage = "", None, None
    async for chunk in await client.completions.create(**kwargs, stream=True,
                                                       stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            usage = chunk.usage
    return text, reason, usage


async def _async_chat(client: openai.AsyncOpenAI, served: Served, messages: list[dict[str, str]], stream: bool):
    kwargs = dict(model=served.name, messages=messages, max_tokens=served.max_tokens, temperature=0)
    if not stream:
        out = await client.chat.completions.create(**kwargs)
        return out.choices[0].message.content, out.choices[0].finish_reason, out.usage
    text, reason, usage = "", None, None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True,
                                                            stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            usage = chunk.usage
    return text, reason, usage


def test_async_client_concurrent_streams_and_whole_responses(served):
    """Every prompt and chat, streamed and whole, all at once (one at a time where greedy text is not exact
    under batching): each gets offline greedy's text, finish reason and token counts."""
    jobs = [("completion", prompt, stream) for prompt in served.prompts for stream in (False, True)]
    jobs += [("chat", messages, stream) for messages in served.chats for stream in (False, True)]
    expected = [served.completion(item) if kind == "completion" else served.chat(item) for kind, item, _ in jobs]

    async def run_all():
        async with served.async_client() as client:
            coroutines = [(_async_completion if kind == "completion" else _async_chat)(client, served, item, stream)
                          for kind, item, stream in jobs]
            if served.concurrent:
                return await asyncio.wait_for(asyncio.gather(*coroutines), TIMEOUT_S)
            return [await asyncio.wait_for(coroutine, TIMEOUT_S) for coroutine in coroutines]

    results = asyncio.run(run_all())
    for (kind, item, stream), want, (text, reason, usage) in zip(jobs, expected, results):
        assert text == want.outputs[0].text, (kind, item, stream)
        assert reason == want.outputs[0].finish_reason, (kind, item, stream)
        check_usage(usage, want)


def test_async_client_errors(served):
    async def run():
        async with served.async_client() as client:
            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(model=served.name, prompt=served.prompts[0], temperature=-1)
            assert "temperature" in str(bad.value)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="gpt-4", messages=served.chats[0])

    asyncio.run(run())


# --- last: the stop -----------------------------------------------------------------------------------------------
def test_sigterm_stops_the_server(served):
    """SIGTERM to the server's own pid: it drains (nothing is in flight) and exits 0, with no traceback."""
    assert httpx.get(f"{served.base}/health", timeout=TIMEOUT_S).status_code == 200
    assert stop_server(served.process) == 0
    log = served.log_path.read_text()
    assert "Traceback" not in log, log

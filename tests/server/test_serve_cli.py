"""`quickdraft serve` as a user runs it: a subprocess on a free loopback port over a tiny model saved to a
directory, driven by the official `openai` client (models, completions, chat, streaming, errors), with greedy
text equal to LLM.generate's, then stopped by SIGTERM to its own process id while a stream is in flight (the
stream finishes, the process exits 0). And the command's argument checks, in process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.cli import build_parser, main, serve_settings
from tiny_server import TIMEOUT_S, free_port, tiny_model, tiny_tokenizer, wait_serving, words

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

PROMPT = words(1, 2, 3, 4, 1, 2, 3, 4, 1)
MESSAGES = [{"role": "user", "content": words(8, 9, 10, 8, 9)}]
API_KEY = "test-key"


def test_serve_subprocess_with_the_openai_client(tmp_path):
    model_dir = tmp_path / "tiny-model"
    tiny_model().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    llm = LLM(str(model_dir), dtype="float32", device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    greedy = SamplingParams(temperature=0, max_tokens=20)
    completion_text = llm.generate(PROMPT, greedy)[0].outputs[0].text
    chat_text = llm.chat(MESSAGES, greedy)[0].outputs[0].text
    long_text = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=100))[0].outputs[0].text

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "quickdraft.cli", "serve", "--model", str(model_dir), "--dtype", "float32",
               "--device", "cpu", "--k", "4", "--fixed-k", "--port", str(port), "--served-model-name", "tiny",
               "--api-key", API_KEY, "--log-level", "warning", "--grace-period", str(TIMEOUT_S)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_serving(base, process, log_path)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)
        assert [m.id for m in client.models.list()] == ["tiny"]

        completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
        assert completion.choices[0].text == completion_text and completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 20
        assert completion.model_extra["spec_decode"]["draft_tokens"] > 0

        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
        assert chat.choices[0].message.content == chat_text and chat.choices[0].message.role == "assistant"

        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == completion_text
        assert chunks[-1].usage.completion_tokens == 20

        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == chat_text

        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="tiny", prompt=PROMPT, temperature=-1)
        assert "temperature" in str(bad.value)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt=PROMPT)
        stranger = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT_S)
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model="tiny", prompt=PROMPT)

        # SIGTERM while a stream is in flight: it finishes whole, then the process exits 0
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100, temperature=0, stream=True)
        chunks = iter(stream)
        texts = [next(chunks).choices[0].text]
        os.kill(process.pid, signal.SIGTERM)
        texts += [c.choices[0].text for c in chunks]
        assert "".join(texts) == long_text
        assert process.wait(TIMEOUT_S) == 0
        assert "Traceback" not in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT_S)


def test_serve_defaults_are_safe(monkeypatch):
    monkeypatch.delenv("QUICKDRAFT_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", "--model", "some/model"])
    llm_kwargs, server_config = serve_settings(args)
    assert args.host == "127.0.0.1" and llm_kwargs["trust_remote_code"] is False
    assert server_config.api_key is None and server_config.served_model_name == "some/model"
    assert llm_kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 5}
    assert llm_kwargs["enable_prefix_caching"] is None  # the LLM decides: on where reuse is exact
    for flag, value in (("--enable-prefix-caching", True), ("--no-enable-prefix-caching", False)):
        assert serve_settings(build_parser().parse_args(["serve", flag]))[0]["enable_prefix_caching"] is value

    monkeypatch.setenv("QUICKDRAFT_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--trust-remote-code", "--kv-cache-memory", "512MiB", "--fixed-k"])
    llm_kwargs, server_config = serve_settings(args)
    assert llm_kwargs["trust_remote_code"] is True and llm_kwargs["kv_cache_memory"] == 512 << 20
    assert server_config.api_key == "from-env" and llm_kwargs["speculative_config"]["adaptive"] is False


@pytest.mark.parametrize("args, word", [
    (["--kv-cache-memory", "lots"], "kv-cache-memory"),
    (["--port", "70000"], "--port"),
    (["--max-queue", "0"], "--max-queue"),
    (["--draft", "layers:x"], "layers:N"),
    (["--k", "0"], "num_speculative_tokens"),
])
def test_serve_bad_arguments_exit_2_before_loading(args, word, capsys):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert word in err and "Traceback" not in err

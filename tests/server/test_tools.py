"""Tool calling (quickdraft/server/tools.py): the Hermes call format Qwen2.5's template asks for parsed into
OpenAI's tool_calls; a forced call (tool_choice "required" or a named function) through structured outputs,
so that even a random tiny model's reply is a valid call; streamed calls never leak their markup as content;
a template that does not render tools is a 400."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_llama
from quickdraft import LLM
from quickdraft.token_bytes import _bytes_to_unicode
from quickdraft.server import create_app
from quickdraft.server.tools import held_back, parse_tool_calls
from tiny_server import config, sse_events, tiny_llm

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                           "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def byte_level_llm() -> LLM:
    """A tiny random Llama over a byte-level vocabulary (every byte a token, and the two chat markers), with a
    Qwen-like chat template that renders tools: it can write any text, so a grammar can force any call."""
    vocab = {char: i for i, char in enumerate(_bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TEMPLATE
    return LLM(tiny_llama(seed=0, vocab_size=len(tokenizer), max_len=1024), tokenizer=tokenizer, dtype="float32", device="cpu",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(byte_level_llm(), config())) as test_client:
        yield test_client


@pytest.mark.parametrize("tools, choice, names", [
    ([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ([WEATHER, TIME], "required", {"get_weather", "get_time"}),
])
def test_a_forced_call_is_a_valid_tool_call_whole_and_streamed(client, tools, choice, names):
    body = {"messages": MESSAGES, "tools": tools, "tool_choice": choice, "max_tokens": 200, "temperature": 0}
    data = client.post("/v1/chat/completions", json=body).json()
    (out,) = data["choices"]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None, out
    (call,) = out["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] in names and call["id"].startswith("call_")
    arguments = json.loads(call["function"]["arguments"])
    assert arguments in ({"city": "Paris"}, {"city": "Rome"}, {"zone": "UTC"}, {"zone": "CET"})

    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines())
    chunks = [e for e in events[:-1] if e["choices"]]
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)  # no markup leaked
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert [c["function"] for c in last["delta"]["tool_calls"]] == [call["function"]]


def test_auto_and_none_leave_the_reply_text(client):
    for choice in ("auto", "none", None):
        body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 12, "temperature": 0,
                **({"tool_choice": choice} if choice else {})}
        out = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert out["finish_reason"] == "length" and "tool_calls" not in out["message"], out


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, body, param):
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_template_that_ignores_tools_is_a_400():
    with TestClient(create_app(tiny_llm(), config())) as plain:
        response = plain.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}],
                                                              "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    assert "does not render tools" in response.json()["error"]["message"]


def test_the_hermes_parser_and_the_streamed_hold_back():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check." and calls[0]["function"] == {"name": "get_weather",
                                                                   "arguments": '{"city": "Rome"}'}
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert held_back("abc <tool") == 4 and held_back("abc <tool_call>{") == 4 and held_back("abc") == 3

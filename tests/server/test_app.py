"""The OpenAI-compatible app in process (FastAPI's TestClient) over a tiny random Llama: greedy output through
the server equals LLM.generate's, OpenAI's shapes (whole and streamed), sampling options, the other endpoints,
the metrics, and each failure: 400 naming the parameter, 401, 404, 413, 500 for an engine failure (the server
goes on), 503 while draining. No timing assertions."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from quickdraft import SamplingParams
from quickdraft.server import create_app
from quickdraft.server.protocol import CHAT_ROLES
from tiny_server import MODEL_NAME, WORDS, config, metric, sse_events, tiny_llm, words

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

REPEATING = words(1, 2, 3, 4, 1, 2, 3, 4, 1, 2)  # n-gram drafts find continuations in it
OTHER = words(7, 20, 33, 7, 20)


@pytest.fixture
def llm():
    return tiny_llm()


def client_for(llm, **overrides) -> TestClient:
    return TestClient(create_app(llm, config(**overrides)))


def greedy(llm, prompt, max_tokens, **params):
    """(text, token ids) of LLM.generate, computed while no server drives this LLM."""
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params))[0].outputs[0]
    return out.text, out.token_ids


def test_completions_greedy_equal_generate_whole_and_streamed(llm):
    references = {p: greedy(llm, p, 24) for p in (REPEATING, OTHER)}
    ids_prompt = [9, 10, 11, 9, 10, 11]
    ids_reference = llm.generate({"prompt_token_ids": ids_prompt},
                                 SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].token_ids
    with client_for(llm) as client:
        body = {"model": MODEL_NAME, "prompt": REPEATING, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["object"] == "text_completion" and data["model"] == MODEL_NAME and data["id"].startswith("cmpl-")
        (choice,) = data["choices"]
        text, ids = references[REPEATING]
        assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (text, ids, "length")
        prompt_len = len(choice["prompt_token_ids"])
        assert data["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 24, "total_tokens": prompt_len + 24}
        spec = data["spec_decode"]
        assert spec["draft_tokens"] > 0 and spec["num_drafts"] > 0  # n-gram drafts on a repeating prompt
        assert spec["accepted_tokens"] == sum(spec["accepted_per_position"]) <= spec["draft_tokens"]

        # a list of prompts: choice i is prompt i's completion
        response = client.post("/v1/completions", json={"prompt": [REPEATING, OTHER], "max_tokens": 24,
                                                        "temperature": 0})
        assert [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])] == \
            [references[REPEATING][0], references[OTHER][0]]
        # token ids as the prompt
        response = client.post("/v1/completions", json={"prompt": ids_prompt, "max_tokens": 24, "temperature": 0,
                                                        "return_token_ids": True})
        assert response.json()["choices"][0]["token_ids"] == ids_reference

        # streamed: the deltas add up to the same text; usage and spec_decode on the last chunk
        response = client.post("/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.text.splitlines())
        assert events[-1] == "[DONE]"
        chunks, final = events[:-2], events[-2]
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 24
        assert final["spec_decode"]["draft_tokens"] > 0


def test_chat_greedy_equals_llm_chat_whole_and_streamed(llm):
    messages = [{"role": "system", "content": words(5)}, {"role": "user", "content": REPEATING}]
    reference = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0]
    text = reference.outputs[0].text
    with client_for(llm) as client:
        body = {"model": MODEL_NAME, "messages": messages, "max_completion_tokens": 16, "temperature": 0}
        data = client.post("/v1/chat/completions", json=body).json()
        assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
        assert data["choices"][0]["message"] == {"role": "assistant", "content": text}
        assert data["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
        assert data["usage"]["completion_tokens"] == 16 and "spec_decode" in data
        # content given as text parts is the same message
        parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
        data = client.post("/v1/chat/completions", json={**body, "messages": parts, "max_tokens": 16}).json()
        assert data["choices"][0]["message"]["content"] == text

        events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "spec_decode" in chunks[-1]


def test_sampling_options_match_generate(llm):
    seeded = dict(temperature=0.9, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.3,
                  frequency_penalty=0.2, seed=7, n=3, max_tokens=12)
    expected = [c.text for c in llm.generate(OTHER, SamplingParams(**seeded))[0].outputs]
    full, _ = greedy(llm, REPEATING, 24)
    stop_word = full.split()[4]
    stopped = llm.generate(REPEATING, SamplingParams(temperature=0, max_tokens=24, stop=[stop_word]))[0].outputs[0]
    with client_for(llm) as client:
        data = client.post("/v1/completions", json={"prompt": OTHER, "user": "someone", **seeded}).json()
        assert [c["index"] for c in data["choices"]] == [0, 1, 2]
        assert [c["text"] for c in data["choices"]] == expected
        assert data["usage"]["completion_tokens"] == 36

        data = client.post("/v1/completions", json={"prompt": REPEATING, "temperature": 0, "max_tokens": 24,
                                                    "stop": stop_word}).json()
        assert data["choices"][0]["text"] == stopped.text and stop_word not in stopped.text
        assert data["choices"][0]["finish_reason"] == "stop"
        assert data["usage"]["completion_tokens"] == len(stopped.token_ids)

        # speculation off for one request: same text, no drafts
        data = client.post("/v1/completions", json={"prompt": REPEATING, "temperature": 0, "max_tokens": 24,
                                                    "num_speculative_tokens": 0, "ignore_eos": True}).json()
        assert data["choices"][0]["text"] == full
        assert data["spec_decode"]["draft_tokens"] == 0 and data["spec_decode"]["acceptance_rate"] is None
        # completions default to 16 tokens, as OpenAI's
        data = client.post("/v1/completions", json={"prompt": REPEATING, "temperature": 0}).json()
        assert data["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "w1", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "w1", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "w1", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "w1", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "w1", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "w1", "seed": 2 ** 70}, "seed"),
    ("/v1/completions", {"prompt": "w1", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "w1", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "w1", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ("/v1/completions", {"prompt": "w1", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "w1", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "w1", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"3": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"999": 1}}, "logit_bias"),  # outside the vocabulary
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "logprobs": True,
                              "top_logprobs": 30}, "top_logprobs"),
    ("/v1/completions", {"prompt": "w1", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [70, 80]}, "prompt"),  # token ids outside the vocabulary
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w1"}]}, "messages.0.role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "w1"}, {"role": "wizard", "content": "w2"}]},
     "messages.1.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "frequency_penalty": -9},
     "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "tools": [{"type": "function"}]},
     "tools"),
])
def test_invalid_parameters_are_400_naming_the_parameter(llm, path, body, param):
    with client_for(llm) as client:
        response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["code"] == 400
    assert error["message"]


def test_malformed_json_is_400(llm):
    with client_for(llm) as client:
        response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"


def test_unknown_chat_role_is_400_naming_the_roles(llm):
    with client_for(llm) as client:
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "w1"}]})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert all(f"'{role}'" in message for role in CHAT_ROLES), message
        # every role OpenAI's API takes is served; a template that does not name "developer" (as the tiny one
        # does not) reads a developer message as a system message
        for role in CHAT_ROLES:
            body = {"messages": [{"role": "user", "content": "w1"}, {"role": role, "content": "w2"}],
                    "max_tokens": 2}
            assert client.post("/v1/chat/completions", json=body).status_code == 200, role
        tokens = {role: client.post("/tokenize", json={"messages": [{"role": role, "content": "w1"}]}).json()["tokens"]
                  for role in ("developer", "system", "user")}
        assert tokens["developer"] == tokens["system"] != tokens["user"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_body_nested_too_deeply_is_400_with_the_error_body(llm, path):
    """5,000 levels: Python's JSON reader raises RecursionError, which FastAPI answers with a bare 400 unless the
    app gives it OpenAI's body; the server goes on serving."""
    deep = "[" * 5000 + "]" * 5000
    with client_for(llm) as client:
        for body in (deep, '{"prompt": %s}' % deep, '{"messages": [{"role": "user", "content": %s}]}' % deep):
            response = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "BadRequestError" and error["code"] == 400
            assert "nested too deeply" in error["message"]
        not_utf8 = client.post(path, content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"})
        assert not_utf8.status_code == 400 and "not valid JSON" in not_utf8.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2}).status_code == 200
        unknown = client.get("/v1/nowhere")
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"


def test_prompt_over_the_context_is_400(llm):
    too_long = words(*([1, 2, 3] * 50))  # 150 tokens, the context holds 128
    with client_for(llm) as client:
        response = client.post("/v1/completions", json={"prompt": too_long})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert "context" in response.json()["error"]["message"]
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": too_long}]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        response = client.post("/v1/completions", json={"prompt": words(1, 2), "max_tokens": 500})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        # what is left of the context is allowed
        assert client.post("/v1/completions", json={"prompt": words(1, 2), "max_tokens": 126}).status_code == 200


def test_unknown_model_is_404(llm):
    with client_for(llm) as client:
        for path, body in (("/v1/completions", {"prompt": "w1"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]}),
                           ("/tokenize", {"prompt": "w1"})):
            response = client.post(path, json={**body, "model": "gpt-5"})
            assert response.status_code == 404
            assert response.json()["error"]["param"] == "model" and response.json()["error"]["code"] == 404


def test_api_key_is_required_when_set(llm):
    body = {"prompt": "w1", "max_tokens": 2}
    with client_for(llm, api_key="sesame") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            response = client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == 401
        assert client.get("/v1/models").status_code == 401
        ok = {"Authorization": "Bearer sesame"}
        assert client.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_body_over_the_limit_is_413(llm):
    with client_for(llm, max_body_bytes=4096) as client:
        response = client.post("/v1/completions", json={"prompt": words(*([5] * 2000))})
        assert response.status_code == 413 and response.json()["error"]["code"] == 413

        def chunked():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"w5 " * 20
            yield b'"}'

        response = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200


def test_models_health_tokenize_detokenize(llm):
    with client_for(llm) as client:
        assert client.get("/health").status_code == 200
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL_NAME]
        assert models["data"][0]["max_model_len"] == 128
        data = client.post("/tokenize", json={"prompt": words(3, 4, 5)}).json()
        assert data == {"count": 3, "max_model_len": 128, "tokens": [WORDS.index(f"w{i}") for i in (3, 4, 5)]}
        chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "w3"}]}).json()
        assert chat["tokens"] == [WORDS.index(w) for w in ("<user>", "w3", "<assistant>")]
        assert client.post("/detokenize", json={"tokens": data["tokens"]}).json() == {"prompt": words(3, 4, 5)}
        assert client.post("/detokenize", json={"tokens": [999]}).status_code == 400
        assert client.post("/tokenize", json={}).status_code == 400


def test_metrics_count_what_was_served(llm):
    with client_for(llm) as client:
        responses = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 10, "temperature": 0}).json()
                     for p in (REPEATING, OTHER)]
        responses.append(client.post("/v1/completions", json={"prompt": REPEATING, "max_tokens": 30,
                                                               "temperature": 0, "stop": "w30"}).json())
        text = client.get("/metrics").text
    labels = {"model_name": MODEL_NAME}
    usage = [r["usage"] for r in responses]
    assert metric(text, "vllm:prompt_tokens_total", **labels) == sum(u["prompt_tokens"] for u in usage)
    assert metric(text, "vllm:generation_tokens_total", **labels) == sum(u["completion_tokens"] for u in usage)
    reasons = [r["choices"][0]["finish_reason"] for r in responses]
    for reason in set(reasons):
        assert metric(text, "vllm:request_success_total", finished_reason=reason, **labels) == reasons.count(reason)
    spec = [r["spec_decode"] for r in responses]
    assert metric(text, "vllm:spec_decode_num_drafts_total", **labels) == sum(s["num_drafts"] for s in spec)
    assert metric(text, "vllm:spec_decode_num_draft_tokens_total", **labels) == sum(s["draft_tokens"] for s in spec)
    accepted = sum(s["accepted_tokens"] for s in spec)
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_total", **labels) == accepted
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", **labels) == accepted
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0", **labels) >= 0
    assert metric(text, "vllm:time_to_first_token_seconds_count", **labels) == 3
    assert metric(text, "vllm:e2e_request_latency_seconds_count", **labels) == 3
    assert metric(text, "vllm:inter_token_latency_seconds_count", **labels) > 0
    assert metric(text, "vllm:num_requests_running", **labels) == 0
    assert metric(text, "vllm:num_requests_waiting", **labels) == 0
    assert metric(text, "vllm:kv_cache_usage_perc", **labels) == 0


def test_engine_failure_fails_only_that_request(llm, monkeypatch):
    reference, _ = greedy(llm, REPEATING, 12)
    poison = WORDS.index("w57")
    step_batch = llm.engine.step_batch

    def failing_step_batch(seqs):
        if any(poison in seq.prompt_ids for seq in seqs):
            raise RuntimeError("simulated engine failure")
        return step_batch(seqs)

    monkeypatch.setattr(llm.engine, "step_batch", failing_step_batch)
    body = {"max_tokens": 12, "temperature": 0}
    with client_for(llm) as client:
        response = client.post("/v1/completions", json={"prompt": words(57, 1), **body})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == 500 and "simulated engine failure" in error["message"]

        events = sse_events(client.post("/v1/completions", json={"prompt": words(57, 2), "stream": True, **body})
                            .text.splitlines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500

        # the server goes on: the next request is served, exactly
        response = client.post("/v1/completions", json={"prompt": REPEATING, **body})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == reference
        assert client.get("/health").status_code == 200
        text = client.get("/metrics").text
        assert metric(text, "vllm:request_success_total", finished_reason="error", model_name=MODEL_NAME) == 2
        state = client.app.state.server
        assert state.engine.num_unfinished == 0 and not state.engine.scheduler.has_unfinished()


def test_n_times_prompts_over_the_queue_limit_is_400(llm):
    with client_for(llm, max_queue=4) as client:
        response = client.post("/v1/completions", json={"prompt": ["w1", "w2", "w3"], "n": 2, "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
        assert client.post("/v1/completions", json={"prompt": ["w1", "w2"], "n": 2, "max_tokens": 2}).status_code == 200


def test_draining_server_answers_503(llm):
    with client_for(llm) as client:
        client.app.state.server.draining = True
        response = client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2})
        assert response.status_code == 503 and response.json()["error"]["code"] == 503
        assert client.get("/health").status_code == 503


def _table(entries):
    return [{t: round(lp.logprob, 5) for t, lp in entry.items()} for entry in entries]


def test_logprobs_and_echo_through_the_server_equal_generate(llm):
    """Completions (whole and streamed, with echo) and chat (whole and streamed) give the log-probabilities
    LLM.generate gives, for the tokens of the text they return; logit_bias steers the text."""
    tokenizer = llm.tokenizer
    out = llm.generate(REPEATING, SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=2))[0]
    want = [round(e[t].logprob, 5) for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    # each token's text after the one before it (" w57"), the first decoded alone, as the choice's text is
    want_top = [{(" " if i else "") + tokenizer.decode([t]): round(lp.logprob, 5) for t, lp in e.items() if lp.rank <= 2}
                for i, e in enumerate(out.outputs[0].logprobs)]
    prompt_want = [None] + [round(e[t].logprob, 5) for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    body = {"prompt": REPEATING, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    with client_for(llm) as client:
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        got = choice["logprobs"]
        assert [round(x, 5) for x in got["token_logprobs"]] == want
        assert [{k: round(v, 5) for k, v in top.items()} for top in got["top_logprobs"]] == want_top
        assert "".join(got["tokens"]) == choice["text"] and got["text_offset"][0] == 0
        assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:i]) for i in range(len(got["tokens"]))]

        echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
        prompt_text = tokenizer.decode(out.prompt_token_ids)
        assert echoed["text"] == prompt_text + choice["text"]
        n_prompt = len(out.prompt_token_ids)
        assert [None if x is None else round(x, 5) for x in echoed["logprobs"]["token_logprobs"]] == prompt_want + want
        assert echoed["logprobs"]["top_logprobs"][0] is None
        assert echoed["logprobs"]["text_offset"][n_prompt] == len(prompt_text)

        events = sse_events(client.post("/v1/completions", json={**body, "echo": True, "stream": True}).text.splitlines())
        chunks = [e for e in events[:-1] if e["choices"]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["text"]
        streamed = [x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
        assert [None if x is None else round(x, 5) for x in streamed] == prompt_want + want

        chat_body = {"messages": [{"role": "user", "content": REPEATING}], "max_tokens": 10, "temperature": 0,
                     "logprobs": True, "top_logprobs": 3}
        chat_out = llm.chat([{"role": "user", "content": REPEATING}],
                            SamplingParams(temperature=0, max_tokens=10, logprobs=3))[0].outputs[0]
        chat_want = [round(e[t].logprob, 5) for e, t in zip(chat_out.logprobs, chat_out.token_ids)]
        data = client.post("/v1/chat/completions", json=chat_body).json()["choices"][0]
        content = data["logprobs"]["content"]
        assert [round(c["logprob"], 5) for c in content] == chat_want
        assert all(len(c["top_logprobs"]) == 3 and c["bytes"] == list(c["token"].encode()) for c in content)
        events = sse_events(client.post("/v1/chat/completions", json={**chat_body, "stream": True}).text.splitlines())
        streamed = [c["logprob"] for e in events[:-1] for ch in e["choices"] if ch.get("logprobs")
                    for c in ch["logprobs"]["content"]]
        assert [round(x, 5) for x in streamed] == chat_want

        plain = client.post("/v1/completions", json={"prompt": REPEATING, "max_tokens": 6, "temperature": 0}).json()
        assert plain["choices"][0]["logprobs"] is None
        forced = WORDS.index("w57")
        biased = client.post("/v1/completions", json={"prompt": REPEATING, "max_tokens": 6, "temperature": 0,
                                                      "logit_bias": {str(forced): 100}}).json()
        assert biased["choices"][0]["text"].split() == ["w57"] * 6


def test_structured_outputs_and_response_format(llm):
    """vLLM's structured_outputs and OpenAI's response_format through the server: the text follows the
    constraint (the tiny model's tokens are words: regexes over them), greedy text equals
    LLM.generate's, and a constraint that cannot be met or compiled is a 400 naming the field."""
    want = llm.generate(REPEATING, SamplingParams(temperature=0, max_tokens=10,
                                                  structured_outputs={"regex": "(w1|w2)*"}))[0].outputs[0].text
    with client_for(llm) as client:
        data = client.post("/v1/completions", json={"prompt": REPEATING, "max_tokens": 10, "temperature": 0,
                                                    "structured_outputs": {"regex": "(w1|w2)*"}}).json()
        text = data["choices"][0]["text"]
        assert text == want and set(text.split()) <= {"w1", "w2"}
        data = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": OTHER}], "max_tokens": 10, "temperature": 0.9, "seed": 3,
            "structured_outputs": {"regex": "w5(w7)*"}}).json()
        words_out = data["choices"][0]["message"]["content"].split()
        assert words_out[0] == "w5" and set(words_out[1:]) <= {"w7"}
        for body, param in [({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
                            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                            ({"response_format": {"type": "json_object"}}, "structured_outputs"),  # no JSON tokens
                            ({"response_format": {"type": "yaml"}}, "response_format"),
                            ({"response_format": {"type": "json_schema"}}, "response_format")]:
            response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}],
                                                                 **body})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)


def test_metrics_count_token_trees(llm):
    """With token trees (a draft model's EAGLE-2 trees: layer_skip keeping every layer, the target itself as its
    own draft, so paths are accepted), each response's spec_decode and /metrics count the tree steps and their
    accepted path lengths."""
    tree_llm = llm.with_speculative_config({"method": "layer_skip", "num_layers": llm.target.num_layers,
                                            "num_speculative_tokens": 3, "adaptive": False,
                                            "tree": {"max_nodes": 6, "max_depth": 3}})
    with client_for(tree_llm) as client:
        responses = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0}).json()
                     for p in (REPEATING, OTHER)]
        text = client.get("/metrics").text
    labels = {"model_name": MODEL_NAME}
    spec = [r["spec_decode"] for r in responses]
    steps = sum(s["tree_steps"] for s in spec)
    assert steps > 0 and all(sum(s["accepted_path_lengths"]) == s["tree_steps"] for s in spec)
    assert metric(text, "quickdraft:spec_decode_num_tree_steps_total", **labels) == steps
    for length in range(4):
        want = sum(s["accepted_path_lengths"][length] for s in spec if len(s["accepted_path_lengths"]) > length)
        if want:
            assert metric(text, "quickdraft:spec_decode_tree_path_length_total", length=str(length), **labels) == want

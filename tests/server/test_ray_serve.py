"""Scale-out on Ray Serve (quickdraft/server/ray_serve.py): the `serve run` builder deployed with 2 replicas of a
tiny model saved to disk, on a local Ray instance (2 CPUs), behind Ray Serve's HTTP proxy on a free loopback port;
greedy completions, chats and streams equal LLM.generate's, both replicas answer (their ids come back in a
header), the API key holds. And, without a cluster: the builder's arguments and environment, the autoscaling config
passed through, the command's checks, and the message when Ray is missing."""

from __future__ import annotations

import importlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.cli import main
from quickdraft.errors import QuickdraftError
from quickdraft.server.ray_serve import REPLICA_HEADER, app_settings, deployment_app
from tiny_server import (RAY_MISSING, TIMEOUT_S, free_port, needs_ray, sse_events, tiny_model, tiny_tokenizer,
                         words)

pytestmark = [pytest.mark.usefixtures("one_thread"),  # tiny models: see conftest.one_thread
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]  # Ray's own (pydantic v1-style fields)

PROMPT = words(1, 2, 3, 4, 1, 2, 3, 4, 1)
MESSAGES = [{"role": "user", "content": words(8, 9, 10, 8, 9)}]
API_KEY = "ray-key"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ray_app(model_dir):
    """The application from the `serve run` builder, 2 replicas, on a local Ray: (base url, offline LLM)."""
    if RAY_MISSING:
        pytest.skip("ray is not installed: pip install 'quickdraft[ray]' to run the Ray Serve tests")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from quickdraft.server.ray_serve import build_app, start_serve

    application = build_app({"model": str(model_dir), "dtype": "float32", "device": "cpu", "k": "4",
                             "fixed_k": "true", "served_model_name": "tiny", "replicas": "2", "api_key": API_KEY,
                             "grace_period": "5"})
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        # start_serve waits on the proxy's readiness, which a loaded machine delays past serve.start's own limits
        start_serve("127.0.0.1", port)
        serve.run(application, name="quickdraft-test", route_prefix="/")
        yield f"http://127.0.0.1:{port}", LLM(str(model_dir), dtype="float32", device="cpu", speculative_config=SPEC)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@needs_ray
def test_two_replicas_serve_what_llm_generate_gives(ray_app):
    base, llm = ray_app
    greedy = SamplingParams(temperature=0, max_tokens=20)
    completion_text = llm.generate(PROMPT, greedy)[0].outputs[0].text
    chat_text = llm.chat(MESSAGES, greedy)[0].outputs[0].text
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)
    assert [m.id for m in client.models.list()] == ["tiny"]

    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    assert completion.choices[0].text == completion_text and completion.usage.completion_tokens == 20
    assert completion.model_extra["spec_decode"]["draft_tokens"] > 0
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == chat_text

    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion_text
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].model_extra["spec_decode"] is not None

    # Every response names its replica; Ray Serve spreads concurrent requests over both (its router sends each to
    # the less busy of two replicas).
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    replicas = set()
    with httpx.Client(base_url=base, headers=headers, timeout=TIMEOUT_S) as http:

        def complete(_):
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == completion_text
            return response.headers[REPLICA_HEADER]

        with ThreadPoolExecutor(8) as pool:
            for _ in range(10):
                replicas.update(pool.map(complete, range(8)))
                if len(replicas) == 2:
                    break
        assert len(replicas) == 2, replicas

        chat_body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 20, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=chat_body) as response:
            assert response.status_code == 200 and response.headers[REPLICA_HEADER] in replicas
            events = sse_events(response.iter_lines())
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == chat_text


@needs_ray
def test_the_app_checks_hold_behind_ray(ray_app):
    base, _ = ray_app
    with httpx.Client(base_url=base, timeout=TIMEOUT_S) as http:
        assert http.get("/health").status_code == 200  # open, as in one process
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == 401
        bad = http.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": "tiny", "prompt": PROMPT, "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        metrics = http.get("/metrics")  # the replica's that answered
        assert metrics.status_code == 200 and 'vllm:request_success_total' in metrics.text


# --- without a cluster --------------------------------------------------------------------------------------
def test_builder_arguments_and_environment():
    llm_kwargs, config, deploy = app_settings(
        {"model": "some/model", "k": "3", "fixed-k": "yes", "num_replicas": "2", "kv_cache_memory": "0.5",
         "max_num_seqs": 8, "autoscaling_config": '{"min_replicas": 1, "max_replicas": 3}'}, environ={})
    assert llm_kwargs["model"] == "some/model" and llm_kwargs["max_num_seqs"] == 8
    assert llm_kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    assert llm_kwargs["kv_cache_memory"] == 0.5 and llm_kwargs["trust_remote_code"] is False
    assert deploy == {"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
                      "ray_actor_options": None}
    assert config.served_model_name == "some/model" and config.api_key is None

    environ = {"QUICKDRAFT_MODEL": "env/model", "QUICKDRAFT_REPLICAS": "4", "QUICKDRAFT_API_KEY": "k",
               "QUICKDRAFT_DRAFT": "none", "QUICKDRAFT_NUM_CPUS": "2"}
    llm_kwargs, config, deploy = app_settings({"served_model_name": "m"}, environ=environ)
    assert llm_kwargs["model"] == "env/model" and llm_kwargs["speculative_config"] == {"method": "none"}
    assert deploy["num_replicas"] == 4 and deploy["ray_actor_options"]["num_cpus"] == 2
    assert config.api_key == "k" and config.served_model_name == "m"
    assert app_settings({"replicas": 1}, environ=environ)[2]["num_replicas"] == 1  # arguments win


@pytest.mark.parametrize("args, message", [
    ({"modle": "x"}, "unknown option 'modle'"),
    ({"k": "five"}, "k='five'"),
    ({"fixed_k": "maybe"}, "expected true or false"),
    ({"replicas": "0"}, "replicas must be >= 1"),
    ({"autoscaling_config": "[1]"}, "expected a JSON object"),
    ({"autoscaling_config": "{nope"}, "autoscaling_config="),
    ({"draft": "layers:x"}, "layers:N"),
    ({"max_queue": "0"}, "max_queue must be >= 1"),
])
def test_builder_refuses_bad_arguments(args, message):
    with pytest.raises(QuickdraftError, match=message):
        app_settings(args, environ={})


@needs_ray
def test_deployment_options_pass_through():
    llm_kwargs, config, _ = app_settings({"model": "some/model", "device": "cpu", "max_num_seqs": "8"}, environ={})
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}
    # Ray's Application keeps its deployment in _bound_deployment (no public accessor)
    deployment = deployment_app(llm_kwargs, config, num_replicas=2, autoscaling_config=autoscaling)._bound_deployment
    scaling = deployment._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.initial_replicas) == (1, 3, 2)
    assert scaling.target_ongoing_requests == 4 and deployment.max_ongoing_requests == 8
    assert deployment.ray_actor_options["num_cpus"] == 1 and not deployment.ray_actor_options.get("num_gpus")

    fixed = deployment_app(llm_kwargs, config, num_replicas=3, ray_actor_options={"num_cpus": 0.5})._bound_deployment
    assert fixed.num_replicas == 3 and fixed.ray_actor_options["num_cpus"] == 0.5
    with pytest.raises(QuickdraftError, match="--autoscaling-config: Ray Serve refused it"):
        deployment_app(llm_kwargs, config, autoscaling_config={"min_replicas": 3, "max_replicas": 1})


@needs_ray
def test_module_app_reads_the_environment(monkeypatch):
    """`serve run quickdraft.server.ray_serve:app`: Ray imports the module and takes the attribute, which is built
    from QUICKDRAFT_* then."""
    monkeypatch.setenv("QUICKDRAFT_MODEL", "env/model")
    monkeypatch.setenv("QUICKDRAFT_DEVICE", "cpu")
    monkeypatch.setenv("QUICKDRAFT_REPLICAS", "3")
    deployment = importlib.import_module("quickdraft.server.ray_serve").app._bound_deployment
    llm_kwargs, config = deployment.init_args
    assert llm_kwargs["model"] == "env/model" and config.served_model_name == "env/model"
    assert deployment.num_replicas == 3


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--autoscaling-config", "{nope"], "--autoscaling-config is not valid JSON"),
    (["--autoscaling-config", "[1, 2]"], "--autoscaling-config must be a JSON object"),
])
def test_serve_scale_out_bad_arguments_exit_2(args, message, capsys):
    assert main(["serve", "--model", "no/such-model", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_serve_replicas_without_ray_says_install_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", "--model", "no/such-model", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "install quickdraft[ray]" in err and "Traceback" not in err, err

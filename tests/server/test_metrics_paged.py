"""/metrics of a server on a paged runner (the CUDA runner's paged pool, run on the CPU): the pool's blocks by
state (total, used, cached, free) and how its forwards ran (graph replays, eager and unbucketed steps); every
block free once the requests are done, with the prompts' full blocks kept as cached. The metric functions alone
too, from an iteration's stats."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from quickdraft.models import factory
from quickdraft.models.cuda_runner import CudaRunner
from quickdraft.server import create_app
from quickdraft.server.async_engine import EngineStats
from quickdraft.server.metrics import ServerMetrics
from tiny_server import MODEL_NAME, config, metric, tiny_llm, words

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def test_an_iterations_pool_and_step_counts_become_metrics():
    from prometheus_client import generate_latest

    metrics = ServerMetrics("m")
    usage = {"total_blocks": 10, "used_blocks": 3, "request_blocks": 3, "cached_blocks": 2, "free_blocks": 7,
             "usage": 0.3}
    metrics.on_iteration(EngineStats(1, 0, usage, 0, {"graph_replays": 4, "eager_steps": 2, "unbucketed_steps": 1}))
    metrics.on_iteration(EngineStats(1, 0, usage, 0, {"graph_replays": 9, "eager_steps": 2, "unbucketed_steps": 1}))
    text = generate_latest(metrics.registry).decode()
    assert [metric(text, "quickdraft:kv_blocks", model_name="m", state=s) for s in ("total", "used", "cached", "free")] \
        == [10, 3, 2, 7]
    assert metric(text, "quickdraft:graph_replays_total", model_name="m") == 9  # counters follow the runner's
    assert metric(text, "quickdraft:eager_steps_total", model_name="m") == 2
    assert metric(text, "quickdraft:unbucketed_steps_total", model_name="m") == 1
    assert metric(text, "vllm:kv_cache_usage_perc", model_name="m") == 0.3


def test_a_paged_server_reports_its_pool_and_frees_every_block(monkeypatch):
    monkeypatch.setattr(factory, "backend_for", lambda weights: CudaRunner)
    llm = tiny_llm(enable_prefix_caching=True)
    assert isinstance(llm.target, CudaRunner)
    pool = llm.target.kv_pool
    prompt = words(*range(1, 40))  # two full blocks of 16 tokens and more
    with TestClient(create_app(llm, config())) as client:
        for max_tokens in (12, 20):
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0})
            assert response.status_code == 200, response.text
        text = client.get("/metrics").text
    labels = {"model_name": MODEL_NAME}
    blocks = {s: metric(text, "quickdraft:kv_blocks", state=s, **labels) for s in ("total", "used", "cached", "free")}
    assert blocks["total"] == pool.total_blocks > 0 and blocks["used"] == 0  # nothing left held
    assert blocks["free"] == blocks["total"] and blocks["cached"] >= 2  # the prompt's blocks, kept
    assert metric(text, "quickdraft:eager_steps_total", **labels) == llm.target.eager_steps > 0  # no graphs on CPU
    assert metric(text, "quickdraft:graph_replays_total", **labels) == 0
    assert pool.hit_tokens >= 32  # the second request shared the first's prompt blocks

"""The engine thread on its own: events and results equal LLM.generate's, an idle thread blocks (no spin),
refused requests free their reservation, the queue limit holds, and an abort frees the KV blocks at once.
Steps are held back with a gate where a test needs requests to stay in flight: no timing assertions."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from quickdraft import SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.scheduler import SequenceUpdate
from quickdraft.server.async_engine import AsyncEngine, QueueFullError, RequestDone
from tiny_server import TIMEOUT_S, StepGate, tiny_llm

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

PROMPTS = [[7, 8, 9, 7, 8, 9, 7], [20, 21, 22], [30, 31, 30, 31, 30]]


async def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def follow(sink: asyncio.Queue, count: int) -> tuple[dict[str, list], dict[str, RequestDone]]:
    """Events from `sink` until `count` requests are done: (updates by request id, RequestDone by id)."""
    updates: dict[str, list] = {}
    done: dict[str, RequestDone] = {}
    while len(done) < count:
        for event in await asyncio.wait_for(sink.get(), TIMEOUT_S):
            if isinstance(event, SequenceUpdate):
                updates.setdefault(event.request_id, []).append(event)
            elif isinstance(event, RequestDone):
                done[event.request_id] = event
            else:
                raise AssertionError(f"unexpected {event}")
    return updates, done


def test_results_equal_generate_and_updates_add_up():
    llm = tiny_llm()
    params = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0.8, seed=3, max_tokens=15, n=2),
              SamplingParams(temperature=0, max_tokens=9, num_speculative_tokens=0)]
    expected = [[c.token_ids for c in llm.generate({"prompt_token_ids": p}, sp)[0].outputs]
                for p, sp in zip(PROMPTS, params)]

    async def run():
        engine = AsyncEngine(llm.new_scheduler(), max_queue=8)
        engine.start()
        try:
            sink: asyncio.Queue = asyncio.Queue()
            await engine.submit([(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))], sink)
            assert engine.num_unfinished <= 4
            result = await follow(sink, len(PROMPTS))
            assert engine.num_unfinished == 0
            return result
        finally:
            await engine.stop()

    updates, done = asyncio.run(run())
    for i, want in enumerate(expected):
        assert done[f"r{i}"].output_token_ids == want
        for index, ids in enumerate(want):
            mine = [u for u in updates[f"r{i}"] if u.index == index]
            assert [t for u in mine for t in u.new_token_ids] == ids  # no stop strings: nothing cut
            assert [u.finished for u in mine] == [False] * (len(mine) - 1) + [True]
    assert done["r0"].metrics.num_generated_tokens == 20 and done["r0"].finish_reasons == ["length"]
    assert done["r2"].metrics.proposed_tokens == 0  # num_speculative_tokens=0: no drafts for it


def test_idle_engine_thread_blocks_instead_of_spinning():
    llm = tiny_llm()

    async def run():
        engine = AsyncEngine(llm.new_scheduler())
        engine.start()
        try:
            sink: asyncio.Queue = asyncio.Queue()
            await engine.submit([("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))], sink)
            await follow(sink, 1)
            native_id = engine._thread.native_id
            thread_cpu = lambda: next(t.user_time + t.system_time for t in psutil.Process().threads()
                                      if t.id == native_id)
            before = thread_cpu()
            await asyncio.sleep(1.0)
            return thread_cpu() - before
        finally:
            await engine.stop()

    assert asyncio.run(run()) < 0.25  # a spinning thread would burn about a second


def test_refused_request_frees_its_reservation():
    llm = tiny_llm()

    async def run():
        engine = AsyncEngine(llm.new_scheduler(), max_queue=4)
        engine.start()
        try:
            sink: asyncio.Queue = asyncio.Queue()
            good = ("ok", PROMPTS[0], SamplingParams(max_tokens=3))
            bad = ("bad", [1, 999], SamplingParams(max_tokens=3, n=2))  # 999 is outside the vocabulary
            with pytest.raises(QuickdraftError, match="prompt token ids"):
                await engine.submit([good, bad], sink)  # all or nothing
            assert engine.num_unfinished == 0 and sink.empty()
            with pytest.raises(QuickdraftError, match="max_queue"):
                await engine.submit([("big", PROMPTS[0], SamplingParams(max_tokens=3, n=5))], sink)
            await engine.submit([good], sink)
            await follow(sink, 1)
        finally:
            await engine.stop()

    asyncio.run(run())


def test_queue_limit_counts_unfinished_sequences():
    llm = tiny_llm()

    async def run():
        scheduler = llm.new_scheduler()
        gate = StepGate(scheduler)
        engine = AsyncEngine(scheduler, max_queue=3)
        engine.start()
        try:
            sink: asyncio.Queue = asyncio.Queue()
            await engine.submit([("a", PROMPTS[0], SamplingParams(max_tokens=5, n=2))], sink)
            second = asyncio.ensure_future(engine.submit([("b", PROMPTS[1], SamplingParams(max_tokens=5))], sink))
            await asyncio.sleep(0)  # reserved at once, accepted once the gated step returns
            assert engine.num_unfinished == 3
            with pytest.raises(QueueFullError):
                await engine.submit([("c", PROMPTS[2], SamplingParams(max_tokens=5))], sink)
            gate.open()
            await second
            await follow(sink, 2)
            assert engine.num_unfinished == 0
            await engine.submit([("c", PROMPTS[2], SamplingParams(max_tokens=5))], sink)  # room again
            await follow(sink, 1)
        finally:
            gate.open()
            await engine.stop()

    asyncio.run(run())


def test_abort_frees_kv_blocks_at_once():
    llm = tiny_llm(kv_cache_memory=64 * 16 * 256)  # 64 blocks of 16 positions at 256 bytes per token

    async def run():
        scheduler = llm.new_scheduler()
        gate = StepGate(scheduler)
        engine = AsyncEngine(scheduler, max_queue=8)
        engine.start()
        try:
            sink: asyncio.Queue = asyncio.Queue()
            await engine.submit([("long", PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))], sink)
            gate.allow(2)  # two steps of at most 5 tokens: it holds blocks and is far from done
            await wait_for(lambda: (engine.stats.kv_usage or {}).get("used_blocks", 0) > 0, "blocks in use")
            assert engine.stats.num_running == 1
            engine.abort(["long"])
            assert engine.num_unfinished == 0
            gate.open()  # the engine thread finishes the step it waits in, then takes the abort
            await wait_for(lambda: engine.stats.num_running == 0 and engine.stats.kv_usage["used_blocks"] == 0,
                           "the aborted request's blocks to be freed")
            assert not scheduler.requests
        finally:
            gate.open()
            await engine.stop()

    asyncio.run(run())


def test_stop_fails_what_is_in_flight():
    llm = tiny_llm()

    async def run():
        scheduler = llm.new_scheduler()
        gate = StepGate(scheduler)
        engine = AsyncEngine(scheduler)
        engine.start()
        sink: asyncio.Queue = asyncio.Queue()
        await engine.submit([("a", PROMPTS[0], SamplingParams(max_tokens=50))], sink)
        stopping = asyncio.ensure_future(engine.stop("going away"))
        await asyncio.sleep(0.05)
        gate.open()
        await stopping
        events = []
        while not sink.empty():
            events.extend(sink.get_nowait())
        assert events[-1].message == "going away" and not engine.alive
        with pytest.raises(Exception, match="not running"):
            await engine.submit([("b", PROMPTS[0], SamplingParams(max_tokens=5))], sink)

    asyncio.run(run())

"""The scheduler on its own thread, driven from an asyncio event loop.

The Scheduler is not thread-safe, and a step is a model forward that must not block the event loop. So one
engine thread owns the scheduler: the loop sends it commands (add, abort, stop) through a thread-safe queue;
the thread steps while there is work, and blocks on the queue when there is none (no busy spin). After each
step it hands every request's events to that request's `asyncio.Queue` with `loop.call_soon_threadsafe`, one
list of events per step (so a consumer sees a step's updates and a request's end together).

Events: the scheduler's `SequenceUpdate`s; `RequestDone` once all of a request's completions have finished
(their final token ids, finish reasons and pooled metrics: a stop string can cut tokens a step had reported);
`RequestFailed` when a step raised (only the requests in that step fail, the others go on) or the engine
stopped.

The queue limit is counted on the loop side, in sequences not yet finished (what running + waiting counts),
reserved synchronously when a request is submitted: concurrent submissions cannot overshoot it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.scheduler import Request, Scheduler, SequenceUpdate
from quickdraft.sequence import PositionLogprobs, RequestMetrics

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The engine holds max_queue unfinished sequences already; try again later."""


class EngineStoppedError(Exception):
    """The engine thread is stopping or has died; it takes no new requests."""


@dataclass(frozen=True)
class EngineStats:
    """What the scheduler holds after an iteration of the engine thread (published for any thread to read)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: dict[str, int] | None = None  # the scheduler's, with a KV budget; else None
    num_preemptions: int = 0
    runner_metrics: dict[str, int] | None = None  # a paged runner's forwards: graph replays, eager steps


@dataclass
class RequestDone:
    """All completions of a request have finished."""

    request_id: str
    output_token_ids: list[list[int]]  # per completion: its final tokens (after stop-string truncation)
    finish_reasons: list[str | None]
    metrics: RequestMetrics  # the completions pooled (RequestMetrics.combine, concurrent)
    logprobs: list[list[PositionLogprobs] | None] | None = None  # per completion, with SamplingParams.logprobs
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # with SamplingParams.prompt_logprobs


@dataclass
class RequestFailed:
    request_id: str
    message: str


Event = SequenceUpdate | RequestDone | RequestFailed
PromptRequest = tuple[str, list[int], SamplingParams]  # (request id, prompt token ids, params)


class EngineObserver(Protocol):
    """What the engine thread reports as it goes (the server's Prometheus metrics); called on that thread."""

    def on_iteration(self, stats: EngineStats) -> None: ...

    def on_token_latency(self, seconds: float, first: bool) -> None: ...

    def on_request_finished(self, request: Request, e2e_latency_s: float) -> None: ...


@dataclass
class _Add:
    requests: list[PromptRequest]
    sink: asyncio.Queue
    accepted: asyncio.Future  # resolved on the loop: None, or the QuickdraftError that refused the requests


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Stop:
    reason: str


@dataclass
class _Tracked:
    """A request the engine thread is running, and where its events go."""

    request: Request
    sink: asyncio.Queue
    last_token_time: list[float | None]  # per completion: when its last tokens came


class AsyncEngine:
    """An engine thread over `scheduler`; its methods are called on the event loop (start inside it)."""

    def __init__(self, scheduler: Scheduler, max_queue: int = 256, observer: EngineObserver | None = None,
                 idle_poll_s: float = 0.05):
        if not (isinstance(max_queue, int) and max_queue >= 1):
            raise QuickdraftError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        self.scheduler = scheduler
        self.max_queue = max_queue
        self.observer = observer
        self.idle_poll_s = idle_poll_s
        self.stats = EngineStats()  # replaced (never mutated) by the engine thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._live: dict[str, int] = {}  # loop side: request id -> completions not yet finished
        self._tracked: dict[str, _Tracked] = {}  # engine thread side

    # --- the event loop's side ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="quickdraft-engine", daemon=True)
        self._thread.start()

    async def stop(self, reason: str = "the server is shutting down") -> None:
        """Fail what is still running with `reason`, and end the thread."""
        self._stopping = True
        if self._thread is not None:
            self._commands.put(_Stop(reason))
            await asyncio.to_thread(self._thread.join)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_unfinished(self) -> int:
        """Sequences submitted and not finished (the loop's count of what the scheduler holds). Read through a
        copy, which CPython makes without switching threads: tests and the drain may read it from elsewhere."""
        return sum(list(self._live.values()))

    async def submit(self, requests: list[PromptRequest], sink: asyncio.Queue) -> None:
        """Queue requests whose events go to `sink`; returns once the scheduler took them all. Raises
        QueueFullError, EngineStoppedError, or what the scheduler refused one with (a QuickdraftError for bad
        input; then none of them runs)."""
        if not self.alive:
            raise EngineStoppedError("the engine is not running")
        need = sum(params.n for _, _, params in requests)
        if need > self.max_queue:
            raise QuickdraftError(f"n x prompts = {need} completions, more than this server runs at once "
                                  f"(max_queue {self.max_queue}): ask for fewer")
        if self.num_unfinished + need > self.max_queue:
            raise QueueFullError(f"the server holds {self.num_unfinished} unfinished sequences and takes at most "
                                 f"{self.max_queue}")
        for request_id, _, params in requests:
            self._live[request_id] = params.n  # reserved now: no await between the check and this
        accepted = self._loop.create_future()
        self._commands.put(_Add(requests, sink, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client went away while the engine was busy: drop it at once
            self.abort([request_id for request_id, _, _ in requests])
            raise
        except BaseException:  # refused (a QuickdraftError: bad input) or failed: nothing of it runs
            for request_id, _, _ in requests:
                self._live.pop(request_id, None)
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their caches (at the engine thread's next command check)."""
        ids = [request_id for request_id in request_ids if self._live.pop(request_id, None) is not None]
        if ids:
            self._commands.put(_Abort(ids))

    def _deliver(self, sink: asyncio.Queue, events: list[Event]) -> None:
        """On the loop: count finished sequences, then hand the step's events to the request's consumer."""
        for event in events:
            request_id = event.request_id
            if request_id not in self._live:
                continue  # aborted: nobody reads these any more
            if isinstance(event, SequenceUpdate):
                if event.finished:
                    self._live[request_id] -= 1
            else:
                del self._live[request_id]
        sink.put_nowait(events)

    # --- the engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug here must not leave clients waiting forever
            log.exception("the engine thread died")
            self._stopping = True
            self._fail_all(f"the engine stopped: {type(exc).__name__}: {exc}")
        finally:
            self._refuse_pending()

    def _serve(self) -> None:
        scheduler = self.scheduler
        stalled = False  # the last step ran nothing (work waits for KV blocks): wait a little for a command
        while True:
            if not scheduler.has_unfinished():
                commands = self._take_commands(timeout_s=None)  # idle: sleep until a command comes
            else:
                commands = self._take_commands(timeout_s=self.idle_poll_s if stalled else 0)
            for command in commands:
                if isinstance(command, _Stop):
                    self._fail_all(command.reason)
                    self._publish_stats()
                    return
                self._handle(command)
            if not scheduler.has_unfinished():
                self._publish_stats()
                continue
            try:
                updates = scheduler.step()
            except Exception as exc:
                log.exception("an engine step failed")
                self._fail_step(f"the engine failed on this request: {type(exc).__name__}: {exc}")
                self._publish_stats()
                continue
            self._publish_stats()  # first: a client that sees this step's tokens sees its stats too
            self._dispatch(updates)
            stalled = not updates and not scheduler.num_running

    def _take_commands(self, timeout_s: float | None) -> list[_Add | _Abort | _Stop]:
        """The commands queued now; with timeout_s != 0 wait that long (None: forever) for the first."""
        commands = []
        if timeout_s != 0:
            try:
                commands.append(self._commands.get(timeout=timeout_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _refuse_pending(self) -> None:
        """Once the thread ends: answer the submissions still queued, which no step will take."""
        for command in self._take_commands(timeout_s=0):
            if isinstance(command, _Add):
                self._call_soon(_resolve, command.accepted, EngineStoppedError("the engine has stopped"))

    def _handle(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            for request_id in command.request_ids:
                tracked = self._tracked.pop(request_id, None)
                if self.scheduler.abort_request(request_id) and tracked is not None:
                    self._observe_finished(tracked.request)
            return
        added: list[str] = []
        try:
            for request_id, prompt_ids, params in command.requests:
                request = self.scheduler.add_request(request_id, prompt_ids, params)
                added.append(request_id)
                self._tracked[request_id] = _Tracked(request, command.sink, [None] * len(request.sequences))
        except Exception as exc:
            for request_id in added:  # all or nothing
                self._tracked.pop(request_id, None)
                self.scheduler.abort_request(request_id)
            if not isinstance(exc, QuickdraftError):
                log.exception("the scheduler failed to add a request")
            self._call_soon(_resolve, command.accepted, exc)
            return
        self._call_soon(_resolve, command.accepted, None)

    def _dispatch(self, updates: list[SequenceUpdate]) -> None:
        now = time.perf_counter()
        batches: dict[int, tuple[asyncio.Queue, list[Event]]] = {}
        finished: dict[str, _Tracked] = {}  # requests whose last completion finished in this step
        for update in updates:
            tracked = self._tracked.get(update.request_id)
            if tracked is None:
                continue
            if update.new_token_ids and self.observer is not None:
                last = tracked.last_token_time[update.index]
                if last is None:
                    ttft = tracked.request.sequences[update.index].metrics.first_token_time_s
                    self.observer.on_token_latency(ttft if ttft is not None else now - tracked.request.arrival_time,
                                                   first=True)
                else:
                    self.observer.on_token_latency(now - last, first=False)
            tracked.last_token_time[update.index] = now
            batches.setdefault(id(tracked.sink), (tracked.sink, []))[1].append(update)
            if update.finished and tracked.request.finished:
                finished[update.request_id] = tracked
        for tracked in finished.values():
            request = tracked.request
            del self._tracked[request.request_id]
            done = RequestDone(request.request_id, [list(seq.output_ids) for seq in request.sequences],
                               [seq.finish_reason for seq in request.sequences],
                               RequestMetrics.combine([seq.metrics for seq in request.sequences], concurrent=True),
                               [seq.logprobs for seq in request.sequences], request.sequences[0].prompt_logprobs)
            batches.setdefault(id(tracked.sink), (tracked.sink, []))[1].append(done)
            self._observe_finished(request)
        for sink, events in batches.values():
            self._call_soon(self._deliver, sink, events)

    def _fail_step(self, message: str) -> None:
        """After a step raised: the scheduler ended that step's sequences with finish_reason "error"; fail
        their requests whole (their other completions too). When no request shows it (the step failed before
        the forward), the scheduler's state is unknown: fail everything in flight."""
        failed = [rid for rid, t in self._tracked.items()
                  if any(seq.finish_reason == "error" for seq in t.request.sequences)]
        self._fail(failed or list(self._tracked), message)

    def _fail_all(self, message: str) -> None:
        self._fail(list(self._tracked), message)

    def _fail(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id)
            self.scheduler.abort_request(request_id)  # frees what the failure left; False if already gone
            for seq in tracked.request.sequences:
                if seq.finish_reason in (None, "abort"):
                    seq.finish_reason = "error"
            self._observe_finished(tracked.request)
            self._call_soon(self._deliver, tracked.sink, [RequestFailed(request_id, message)])

    def _observe_finished(self, request: Request) -> None:
        if self.observer is not None:
            self.observer.on_request_finished(request, time.perf_counter() - request.arrival_time)

    def _publish_stats(self) -> None:
        scheduler = self.scheduler
        self.stats = EngineStats(scheduler.num_running, scheduler.num_waiting, scheduler.kv_usage,
                                 scheduler.num_preemptions, scheduler.runner_metrics)
        if self.observer is not None:
            self.observer.on_iteration(self.stats)

    def _call_soon(self, callback, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed (the server exited around us): nobody is waiting
            pass


def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # cancelled: its submitter went away
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)

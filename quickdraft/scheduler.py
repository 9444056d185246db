"""Continuous batching: requests join and leave at step boundaries; each step is one batched engine step.

A request is its n completions (one Sequence each, with its own detokenizer). `add_request` queues it;
`step()` admits waiting sequences while the limits allow (at most `max_num_seqs` running, at most
`max_num_batched_tokens` new target rows in a step, a prompt counting its length and a decoding sequence
1 + K), runs one `Engine.step_batch` over the running sequences, detokenizes what each committed, frees the
caches of sequences that finished, and returns one `SequenceUpdate` per sequence that produced tokens.
`abort_request` drops a request's sequences at once, waiting or running. This is the interface the API's
`generate` drives, and the one a server drives.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from quickdraft.detokenize import Detokenizer
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.sequence import Sequence


@dataclass
class SequenceUpdate:
    """What one step produced for one completion of a request."""

    request_id: str
    index: int  # which of the request's n completions
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None


@dataclass
class Request:
    request_id: str
    sequences: list[Sequence]
    detokenizers: list[Detokenizer]
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return self.aborted or all(seq.finished for seq in self.sequences)


class Scheduler:
    def __init__(self, engine: Engine, tokenizer: Any = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096,
                 make_sequences: Callable[[list[int], SamplingParams], list[Sequence]] | None = None):
        if not (isinstance(max_num_seqs, int) and max_num_seqs >= 1):
            raise QuickdraftError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        if not (isinstance(max_num_batched_tokens, int) and max_num_batched_tokens >= 1):
            raise QuickdraftError(f"max_num_batched_tokens must be an integer >= 1, got {max_num_batched_tokens!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        # A request's n completions (the LLM's: it derives their noise keys and generator from the seeds).
        self.make_sequences = make_sequences or (
            lambda ids, params: [engine.new_sequence(ids, params) for _ in range(params.n)])
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[tuple[Request, int]] = deque()  # (request, completion index), in arrival order
        self.running: list[tuple[Request, int]] = []

    # --- the interface ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request: its n completions start at a later step boundary."""
        if request_id in self.requests:
            raise QuickdraftError(f"request id {request_id!r} is already in use; give each request its own id")
        if not isinstance(params, SamplingParams):
            raise QuickdraftError(f"params must be a SamplingParams, got {type(params).__name__}")
        detokenizers = [Detokenizer(self.tokenizer, params)]  # refuses stop strings without a tokenizer, first
        sequences = self.make_sequences(prompt_ids, params)
        detokenizers = [Detokenizer(self.tokenizer, seq.params) for seq in sequences]
        request = Request(request_id, sequences, detokenizers)
        self.requests[request_id] = request
        self.waiting.extend((request, index) for index in range(len(sequences)))
        return request

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its caches; False when it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.aborted = True
        for seq in request.sequences:
            if not seq.finished:
                seq.finish_reason = "abort"
            self._free(seq)
        self.waiting = deque(item for item in self.waiting if item[0] is not request)
        self.running = [item for item in self.running if item[0] is not request]
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def step(self) -> list[SequenceUpdate]:
        """Admit, run one batched step, detokenize, retire. Returns the updates of this step."""
        self._admit()
        if not self.running:
            return []
        batch = list(self.running)
        committed = self.engine.step_batch([request.sequences[index] for request, index in batch])
        now = time.perf_counter()
        updates = []
        for (request, index), tokens in zip(batch, committed):
            seq = request.sequences[index]
            delta = request.detokenizers[index].update(seq, len(tokens))  # may cut at a stop string
            if request.first_token_time is None:
                request.first_token_time = now
            metrics = seq.metrics
            if metrics.first_token_time_s is None:
                metrics.first_token_time_s = now - request.arrival_time
            metrics.wall_time_s = now - request.arrival_time
            updates.append(SequenceUpdate(request.request_id, index, tokens, delta, seq.finished, seq.finish_reason))
            if seq.finished:
                self._free(seq)
        self.running = [item for item in self.running if not item[0].sequences[item[1]].finished]
        for request in {id(r): r for r, _ in batch}.values():
            if request.finished:
                self.requests.pop(request.request_id, None)
        return updates

    # --- policy -------------------------------------------------------------------------------------------
    def _rows(self, seq: Sequence) -> int:
        """The target rows a sequence may add to the next step: what its cache lacks, plus K drafts."""
        return max(1, len(seq.token_ids) - len(seq.target_cache)) + self.engine.k

    def _admit(self) -> None:
        budget = self.max_num_batched_tokens - sum(self._rows(r.sequences[i]) for r, i in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request, index = self.waiting[0]
            rows = self._rows(request.sequences[index])
            if rows > budget and self.running:  # a prompt larger than the budget still runs, alone
                break
            self.waiting.popleft()
            self.running.append((request, index))
            budget -= rows

    def _free(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's KV memory (target and draft)."""
        seq.target_cache = self.engine.target.new_cache()
        seq.draft_state = None

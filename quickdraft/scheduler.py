"""Continuous batching: requests join and leave at step boundaries; each step is one batched engine step.

A request is its n completions (one Sequence each, with its own detokenizer). The scheduler owns each
sequence's life: `add_request` makes the sequences (the engine checks the request and readies each sequence,
Engine.attach) and queues them;
`step()` admits waiting sequences while the limits allow (at most `max_num_seqs` running, at most
`max_num_batched_tokens` new target rows in a step, a prompt counting its length and a decoding sequence
1 + K), runs one `Engine.step_batch` over the running sequences, detokenizes what each committed, frees the
caches of sequences that finished (the KV memory takes their blocks back, the engine its caches and draft
state: Engine.detach), and returns one `SequenceUpdate` per sequence that produced tokens.
`abort_request` drops a request's sequences at once, waiting or running. This is the interface the API's
`generate` drives, and the one a server drives.

With a KV pool (quickdraft.kv: a memory budget in blocks of 16 positions over the target's and a draft
model's caches; or a runner's paged pool, the CUDA runner's, whose blocks sequences' block tables share:
KVMemory budgets both), before each step every running sequence must be able to grow to len(token_ids) + K + 1
positions (target and draft caches); when the pool cannot grant it, the most recently admitted running
sequence is preempted: its caches and blocks are freed and it goes back to the FRONT of the waiting queue as a
recompute (its Sequence keeps prompt and output; with empty caches its next step reads the whole history as a
prompt, k = 0, which gives the same numbers). A waiting sequence is admitted only when the pool can hold its
history plus K + 1 positions. A request one sequence of which could not fit even alone (prompt + max_tokens +
K over the pool's capacity) is refused at add_request with a QuickdraftError, rather than cut short.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from quickdraft.detokenize import Detokenizer, TextDelta
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.kv import KVMemory
from quickdraft.params import SamplingParams
from quickdraft.sequence import PositionLogprobs, Sequence
from quickdraft.structured import GrammarState


@dataclass(frozen=True)
class SequenceSetup:
    """What makes one completion's draws its own: the generator its unseeded sampling draws from, its noise key
    (seeded sampling draws from position-keyed noise: Sequence.noise_key), and its grammar's state (structured
    outputs). The LLM derives them from the request's seed or its own seed stream, and compiles the grammar."""

    generator: torch.Generator | None = None
    noise_key: int | None = None
    grammar: GrammarState | None = None


@dataclass(slots=True)
class SequenceUpdate:
    """What one step produced for one completion of a request. Its text (text_delta) is decoded when first read
    where the request has no stop strings (detokenize.TextDelta): a consumer on another thread (a server's event
    loop) decodes it there, off the engine's step."""

    request_id: str
    index: int  # which of the request's n completions
    new_token_ids: list[int]
    delta: TextDelta | str
    finished: bool
    finish_reason: str | None
    # SamplingParams.logprobs: the log-probabilities of the tokens this step kept (after a stop string's cut)
    new_logprobs: list[PositionLogprobs] | None = None
    # SamplingParams.prompt_logprobs: on a completion's first update, its prompt's (None for the first token)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def text_delta(self) -> str:
        """The text this step added (decoded now if it was deferred)."""
        return self.delta if isinstance(self.delta, str) else self.delta.text


@dataclass
class Request:
    request_id: str
    sequences: list[Sequence]
    detokenizers: list[Detokenizer]
    arrival_time: float = field(default_factory=time.perf_counter)
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return self.aborted or all(seq.finished for seq in self.sequences)


class Scheduler:
    def __init__(self, engine: Engine, tokenizer: Any = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096,
                 sequence_setup: Callable[[SamplingParams], list[SequenceSetup]] | None = None,
                 kv_budget_bytes: int | None = None, enable_prefix_caching: bool = False,
                 memory: KVMemory | None = None):
        if not (isinstance(max_num_seqs, int) and max_num_seqs >= 1):
            raise QuickdraftError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        if not (isinstance(max_num_batched_tokens, int) and max_num_batched_tokens >= 1):
            raise QuickdraftError(f"max_num_batched_tokens must be an integer >= 1, got {max_num_batched_tokens!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        # Each of a request's n completions' generator, noise key and grammar (the LLM's: it derives them from the
        # seeds and compiles the grammar); by default the global generator, no noise key and no grammar.
        self.sequence_setup = sequence_setup or (lambda params: [SequenceSetup()] * params.n)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[tuple[Request, int]] = deque()  # (request, completion index), in arrival order
        self.running: list[tuple[Request, int]] = []  # in admission order: the last was admitted last
        # The KV memory (an LLM passes its own, shared by its schedulers): the caches that count, the budget's pool
        # (None: unbounded) and the prefix caches.
        self.memory = memory or KVMemory(engine.kv_caches(), kv_budget_bytes, enable_prefix_caching)
        self.pool = self.memory.pool
        self.num_preemptions = 0
        # The most bytes the live sequences' cache tensors took after a step (measured under a budget).
        self.peak_kv_bytes = 0

    # --- the interface ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request: its n completions start at a later step boundary."""
        if request_id in self.requests:
            raise QuickdraftError(f"request id {request_id!r} is already in use; give each request its own id")
        if not isinstance(params, SamplingParams):
            raise QuickdraftError(f"params must be a SamplingParams, got {type(params).__name__}")
        # One detokenizer per completion (they share params); built first: it refuses stop strings without a
        # tokenizer before anything is allocated.
        detokenizers = [Detokenizer(self.tokenizer, params) for _ in range(params.n)]
        self.engine.check_request(prompt_ids, params)
        if self.memory.bounded:  # before the sequences: a refused request draws nothing from the seed stream
            self._check_fits(prompt_ids, params)
        sequences = [self._new_sequence(prompt_ids, params, setup) for setup in self.sequence_setup(params)]
        request = Request(request_id, sequences, detokenizers)
        self.requests[request_id] = request
        self.waiting.extend((request, index) for index in range(len(sequences)))
        return request

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams, setup: SequenceSetup) -> Sequence:
        engine = self.engine
        seq = Sequence(prompt_ids, params, setup.generator, engine.device, engine.vocab_size, setup.noise_key)
        seq.grammar = setup.grammar
        engine.attach(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its caches; False when it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.aborted = True
        for seq in request.sequences:
            if not seq.finished:  # a finished one was freed when it finished
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
        if self.memory.bounded:
            self._grow_running()
        self._admit()
        if not self.running:
            if self.waiting:  # nothing runs and the first in line cannot start: no later step would change that
                self._fail_unschedulable()
            return []
        batch = list(self.running)
        seqs = [request.sequences[index] for request, index in batch]
        try:
            committed = self.engine.step_batch(seqs)
        except BaseException:
            # The step's sequences are in an unknown state: end them (finish_reason "error") and free their
            # blocks, so that nothing leaks, then let the caller see the exception.
            for request, index in batch:
                seq = request.sequences[index]
                if not seq.finished:
                    seq.finish_reason = "error"
                self._free(seq)
            stepped = {(id(r), i) for r, i in batch}
            self.running = [(r, i) for r, i in self.running if (id(r), i) not in stepped]
            for request in {id(r): r for r, _ in batch}.values():
                if request.finished:
                    self.requests.pop(request.request_id, None)
            raise
        if self.memory.bounded:  # what the budget's accounting is checked against (tests, leak runs)
            self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_measured_bytes())
        if self.memory.prefix_caching:
            self.memory.store_prefixes(seqs)
        now = time.perf_counter()
        updates = []
        finished = False
        for (request, index), seq, tokens in zip(batch, seqs, committed):
            first = len(seq.output_ids) - len(tokens)
            detokenizer = request.detokenizers[index]
            # Stop strings end a sequence by its text: decoded now (it may cut the step's tokens); else later.
            if detokenizer.eager:
                delta = detokenizer.update(seq, len(tokens))
            else:
                delta = detokenizer.defer(tokens, seq.finish_reason is not None)
            metrics = seq.metrics
            elapsed = now - request.arrival_time
            if metrics.first_token_time_s is None:
                metrics.first_token_time_s = elapsed
            metrics.wall_time_s = elapsed
            reason = seq.finish_reason
            logprobs, prompt_logprobs = seq.logprobs, seq.prompt_logprobs  # what a stop string left of the step's
            updates.append(SequenceUpdate(request.request_id, index, tokens, delta, reason is not None, reason,
                                          logprobs[first:] if logprobs is not None else None,
                                          prompt_logprobs if first == 0 else None))
            if reason is not None:
                finished = True
                self._free(seq)
        if finished:  # the running list and the requests change only where a sequence finished
            self.running = [item for item in self.running if not item[0].sequences[item[1]].finished]
            for request in {id(r): r for r, _ in batch}.values():
                if request.finished:
                    self.requests.pop(request.request_id, None)
        return updates

    # --- policy -------------------------------------------------------------------------------------------
    def _rows(self, seq: Sequence) -> int:
        """The target rows a sequence may add to the next step: what its cache lacks, plus K drafts (a token
        tree's nodes)."""
        return max(1, len(seq.token_ids) - len(seq.target_cache)) + self.engine.max_step_drafts

    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return
        budget = self.max_num_batched_tokens - sum(self._rows(r.sequences[i]) for r, i in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request, index = self.waiting[0]
            seq = request.sequences[index]
            if not self._load_prefix(seq):
                self.memory.release(seq)
                break
            rows = self._rows(seq)
            if rows > budget and self.running:  # a prompt larger than the budget still runs, alone
                self.memory.release(seq)  # a waiting sequence holds no memory (its prefix loads again next time)
                break
            if self.memory.bounded and not self._reserve(seq):
                self.memory.release(seq)  # whatever part it got; it waits, first in line
                break
            self.waiting.popleft()
            self.running.append((request, index))
            budget -= rows

    def _free(self, seq: Sequence) -> None:
        """Release a finished, aborted or failed sequence's KV memory (target and draft) and end its draft state
        (the proposer's release: a suffix draft's text enters its cache then)."""
        self.memory.release(seq)
        self.engine.detach(seq)

    # --- the KV budget ------------------------------------------------------------------------------------
    @property
    def kv_usage(self) -> dict[str, int | float] | None:
        """{"used_blocks", "cached_blocks", "free_blocks", "total_blocks", "block_size", "used_bytes",
        "budget_bytes", "prefix_cached_bytes", "prefix_cached_blocks", "request_bytes", "usage"}: the byte
        budget's and the paged pools' (KVMemory.usage); None when unbounded. used_* count the blocks kept for
        prefix caching too where they sit in the byte budget; request_bytes and usage (its fraction of the budget,
        vLLM's kv_cache_usage_perc) count only what requests hold: kept prefix blocks are evictable, so they are
        free memory."""
        return self.memory.usage()

    @property
    def runner_metrics(self) -> dict[str, int]:
        """How paged runners ran their forwards (graph replays, eager and unbucketed steps); empty without one."""
        return self.memory.runner_metrics()

    # --- prefix caching -------------------------------------------------------------------------------------
    def _load_prefix(self, seq: Sequence) -> bool:
        """Before a sequence first runs (or reruns after preemption): copy the kept blocks of its longest
        known prefix into its empty caches. False when the pool could not hold them (it waits). A sequence
        that asked for prompt_logprobs loads none: its first forward scores every prompt row."""
        if seq.wants_prompt_logprobs or not self.memory.prefix_caching:
            return True
        if not self.memory.load_prefix(seq):
            return False
        # A waiting sequence's caches are empty (new, released, or preempted): what they hold now was loaded.
        seq.metrics.num_cached_tokens = max(seq.metrics.num_cached_tokens, len(seq.target_cache))
        return True

    def kv_measured_bytes(self) -> int:
        """The bytes the live sequences' cache tensors actually take now (native caches; with or without a
        budget)."""
        total = 0
        for request, index in self.running:
            seq = request.sequences[index]
            total += seq.target_cache.nbytes + (seq.draft_state.nbytes if seq.draft_state is not None else 0)
        return total

    def _next_step_lengths(self, seq: Sequence) -> list[int]:
        """The positions each counted cache needs for `seq`'s next step: its history + K + 1 (K: a token tree's
        nodes where trees are on; the draft's history is the target's unless the draft has another tokenizer)."""
        return self.memory.next_step_lengths(seq, self.engine.max_step_drafts + 1)

    def _reserve(self, seq: Sequence) -> bool:
        """Make every counted cache of `seq` able to hold what its next step may write."""
        return self.memory.reserve(seq, self.engine.max_step_drafts + 1)

    def _grow_running(self) -> None:
        """Before a step: every running sequence must be able to grow to what the step may write; where the
        pool cannot grant it, preempt the most recently admitted running sequence and try again."""
        i = 0
        while i < len(self.running):
            request, index = self.running[i]
            if self._reserve(request.sequences[index]):
                i += 1
                continue
            self._preempt(self.running.pop())  # the most recently admitted (maybe this one)

    def _preempt(self, item: tuple[Request, int]) -> None:
        """Free a running sequence's caches and blocks and put it first in the waiting queue: it recomputes its
        whole history (prompt and output) as a prompt when it is admitted again."""
        request, index = item
        seq = request.sequences[index]
        self.memory.release(seq)
        self.engine.detach(seq, preempted=True)  # a fresh draft state; a suffix doc goes on
        self.waiting.appendleft(item)
        self.num_preemptions += 1

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request one sequence of which could not run even alone in the pool: each counted runner's
        cache is sized by what that runner reads (a draft with another tokenizer reads the prompt translated
        into its own tokens, often more of them), through the last step, which starts with prompt + max_tokens
        - 1 tokens and reserves K + 1 more positions. A draft's generated part is counted one draft token per
        target token; where it translates into more, the no-progress guard of step() ends the request."""
        grown = params.max_tokens - 1
        histories = self.memory.prompt_lengths(prompt_ids)
        extra = self.engine.max_step_drafts + 1
        lengths = [min(length + grown, self.engine.max_len - 1) + extra for length in histories]
        short = self.memory.paged_shortfall(lengths)
        if short is not None:
            raise QuickdraftError(
                f"this request cannot fit in the KV cache: prompt ({histories[0]} tokens) + max_tokens "
                f"({params.max_tokens}) + {extra} positions of speculation need {short}; lower max_tokens, shorten "
                "the prompt or raise kv_cache_memory")
        if self.pool is None:
            return
        need = self.memory.bytes_for(lengths)
        if need > self.pool.budget_bytes:
            drafted = f", the draft reading it as {histories[1]} of its own tokens" \
                if len(histories) > 1 and histories[1] != histories[0] else ""
            raise QuickdraftError(
                f"this request cannot fit in the KV cache budget: prompt ({histories[0]} tokens{drafted}) + "
                f"max_tokens ({params.max_tokens}) + {self.engine.max_step_drafts + 1} positions of speculation need "
                f"{-(-need // self.pool.block_bytes)} blocks of 16 positions, but kv_cache_memory holds "
                f"{self.pool.total_blocks} ({self.pool.max_tokens} tokens); lower max_tokens, shorten the prompt "
                "or raise kv_cache_memory")

    def _fail_unschedulable(self) -> None:
        """The no-progress guard: nothing is running, so the first waiting sequence had the whole pool (less
        what other schedulers of this LLM hold; kept prefixes are reclaimed) and could still not start. It
        never will: end its request (finish_reason "error", caches freed) and raise, instead of stepping
        forever with the request holding its place."""
        request, index = self.waiting[0]
        seq = request.sequences[index]
        lengths = self._next_step_lengths(seq)
        usage = self.memory.usage() or {}
        held_elsewhere = usage.get("request_bytes", 0)  # the sequence itself holds nothing: it waits
        self.abort_request(request.request_id)
        for other in request.sequences:
            if other.finish_reason in (None, "abort"):
                other.finish_reason = "error"
        budget = f"{usage.get('budget_bytes', 0)} bytes ({usage.get('total_blocks', 0)} blocks)"
        where = (f"{held_elsewhere} of the KV budget's {budget} are held by requests of another scheduler of this "
                 "LLM (an unfinished generate or stream)" if held_elsewhere > 0 else f"the KV budget holds {budget}")
        raise QuickdraftError(
            f"request {request.request_id!r} can make no progress: its next step needs KV cache for "
            f"{', '.join(map(str, lengths))} positions by runner and {where}; raise kv_cache_memory, lower "
            "max_tokens or shorten the prompt")

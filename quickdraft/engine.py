"""The propose-verify-accept loop.

One step for one sequence: the proposer drafts k tokens; the target runs once on the tokens its cache
lacks (the last committed token; on the first step the whole prompt, alone) followed by the k drafts; the
k+1 last rows of its logits are processed with the request's sampling parameters and verified against the
draft; the accepted prefix plus one target token (the correction or the bonus) is committed; the target's
cache rolls back to exactly the committed positions. All per-request state lives on the Sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from quickdraft import adaptive, sampling, verify
from quickdraft.cache import SequenceCache
from quickdraft.drafts.base import Proposal, Proposer
from quickdraft.errors import QuickdraftError
from quickdraft.models.runner import HFRunner
from quickdraft.params import SamplingParams


@dataclass
class RequestMetrics:
    """What one request cost and how well the draft did."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_speculative_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # steps in which draft position i was accepted
    proposed_per_position: list[int] = field(default_factory=list)  # steps in which position i was proposed
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0
    wall_time_s: float = 0.0
    first_token_time_s: float | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens committed per target forward (1 for plain decoding; up to K+1)."""
        return self.num_generated_tokens / self.target_forwards if self.target_forwards else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else None

    @staticmethod
    def combine(parts: "list[RequestMetrics]") -> "RequestMetrics":
        """The pooled metrics of several generations (the n completions of a request, a benchmark's
        prompts): counts, times and per-position counts summed."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return RequestMetrics()
        total = RequestMetrics(num_prompt_tokens=parts[0].num_prompt_tokens,
                               num_speculative_tokens=parts[0].num_speculative_tokens,
                               first_token_time_s=parts[0].first_token_time_s)
        for m in parts:
            for name in ("num_generated_tokens", "target_forwards", "draft_forwards", "proposed_tokens",
                         "accepted_tokens", "draft_time_s", "target_time_s", "verify_time_s", "wall_time_s"):
                setattr(total, name, getattr(total, name) + getattr(m, name))
            for name in ("accepted_per_position", "proposed_per_position"):
                mine, theirs = getattr(total, name), getattr(m, name)
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
        return total

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items()}
        out.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                   tokens_per_s=self.tokens_per_s)
        return out


class Sequence:
    """One request being generated: its tokens, sampling state, caches and metrics."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None,
                 device: torch.device, vocab_size: int, noise_key: int | None = None):
        self.prompt_ids = list(prompt_ids)
        # Seeded sampling: each output position draws from noise keyed by (noise_key, position), so the text
        # is the same with speculation on or off and whatever K (see verify). None: rejection sampling.
        self.noise_key = None if params.greedy else noise_key
        self.output_ids: list[int] = []
        self.params = params
        self.generator = generator
        self.device = device
        self.penalties = sampling.PenaltyHistory(prompt_ids, vocab_size, device) if params.uses_penalties else None
        self.target_cache = SequenceCache()
        self.draft_state: Any = None
        self.acceptance = adaptive.AcceptanceStats()
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(num_prompt_tokens=len(prompt_ids))
        self._token_ids = list(prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the committed output (do not mutate)."""
        return self._token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, logits: torch.Tensor, pending: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Apply the request's sampling parameters to `logits` [n, V] whose row j is the position after
        token_ids + pending[:first_row + j]."""
        seen = counts = None
        if self.penalties is not None:
            seen, counts = self.penalties.rows(pending, first_row + logits.shape[0])
            seen, counts = seen[first_row:], counts[first_row:]
        return sampling.process(logits, self.params, seen, counts)

    def commit(self, tokens: list[int], eos_token_ids: set[int], max_len: int) -> list[int]:
        """Append tokens up to the first that ends the request; returns those appended."""
        params = self.params
        taken = []
        for token in tokens:
            taken.append(token)
            if token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos):
                self.finish_reason = "stop"
            elif len(self.output_ids) + len(taken) >= params.max_tokens or len(self._token_ids) + len(taken) >= max_len:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        self.output_ids.extend(taken)
        self._token_ids.extend(taken)
        if self.penalties is not None:
            self.penalties.append(taken)
        self.metrics.num_generated_tokens = len(self.output_ids)
        return taken

    def truncate_output(self, length: int, reason: str) -> None:
        """Keep the first `length` output tokens and finish (a stop string ended inside a step)."""
        drop = len(self.output_ids) - length
        if drop > 0:
            del self.output_ids[length:]
            del self._token_ids[len(self._token_ids) - drop:]
        self.metrics.num_generated_tokens = len(self.output_ids)
        self.finish_reason = reason


class Engine:
    """Speculative decoding of sequences with one target runner and one proposer."""

    def __init__(self, target: HFRunner, proposer: Proposer, num_speculative_tokens: int,
                 eos_token_ids: set[int] | None = None, max_len: int | None = None, adaptive_k: bool = False):
        if num_speculative_tokens < 0:
            raise QuickdraftError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.target = target
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.adaptive_k = adaptive_k and num_speculative_tokens > 0
        self.step_costs = adaptive.StepCosts(num_speculative_tokens)
        self.eos_token_ids = set(eos_token_ids or ())
        self.max_len = min(max_len or target.max_len, target.max_len)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def with_k(self, num_speculative_tokens: int, adaptive_k: bool | None = None) -> "Engine":
        """The same target, proposer and limits with another draft length (proposers keep no per-K state),
        adaptive or fixed (default: as this engine)."""
        adaptive_k = self.adaptive_k if adaptive_k is None else adaptive_k
        return Engine(self.target, self.proposer, num_speculative_tokens, self.eos_token_ids, self.max_len,
                      adaptive_k)

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams,
                     generator: torch.Generator | None = None, noise_key: int | None = None) -> Sequence:
        if not prompt_ids:
            raise QuickdraftError("the prompt is empty; give at least one token of prompt")
        vocab = self.target.vocab_size
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise QuickdraftError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(prompt_ids) >= self.max_len:
            raise QuickdraftError(f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_len}; "
                                  "shorten the prompt so that at least one token can be generated")
        seq = Sequence(prompt_ids, params, generator, self.device, vocab, noise_key)
        seq.target_cache = self.target.new_cache()
        seq.metrics.num_speculative_tokens = self.k
        seq.draft_state = self.proposer.new_state(seq)
        return seq

    def step(self, seq: Sequence) -> list[int]:
        """One propose-verify-accept step; returns the tokens committed (at least one)."""
        metrics = seq.metrics
        history = seq.token_ids
        remaining = seq.params.max_tokens - len(seq.output_ids)
        k = adaptive.choose_k(seq.acceptance, self.step_costs, self.k) if self.adaptive_k else self.k
        k = max(0, min(k, remaining - 1, self.max_len - len(history)))
        if len(history) - len(seq.target_cache) > 1:
            # The prompt goes through the target alone, as in plain decoding: kernels may pick their method
            # by the number of rows, and the prompt's cached keys must not depend on whether drafts followed.
            k = 0

        t0 = time.perf_counter()
        draft_forwards = self.proposer.forwards
        proposal = self.proposer.propose(seq, k) if k > 0 else Proposal.empty(self.device)
        draft = proposal.tokens[:k]
        k = int(draft.numel())
        metrics.draft_forwards += self.proposer.forwards - draft_forwards
        t1 = time.perf_counter()

        cache = seq.target_cache
        start = cache.sync(history)
        if start == len(history):  # the last token's logits are needed again (only after a cache reset)
            start -= 1
            cache.rollback(start)
        feed = torch.cat([torch.tensor(history[start:], dtype=torch.long, device=self.device), draft])
        logits = self.target.forward(cache, feed, num_logits=k + 1)
        metrics.target_forwards += 1
        t2 = time.perf_counter()

        processed = seq.process(logits, draft)
        if seq.params.greedy:
            num_accepted, next_token = verify.greedy_accept(processed[None], draft[None])
        elif seq.noise_key is not None:
            noise = sampling.position_noise(seq.noise_key, len(seq.output_ids), k + 1, processed.shape[-1],
                                            processed.device)
            num_accepted, next_token = verify.greedy_accept((processed / noise)[None], draft[None])
        else:
            q = None if proposal.probs is None else proposal.probs[:k][None]
            num_accepted, next_token = verify.rejection_sample(processed[None], q, draft[None], seq.generator)
        n, token = torch.stack([num_accepted[0], next_token[0]]).tolist()  # the step's one host sync
        new_tokens = draft[:n].tolist() + [token]
        cache.rollback(len(history) + n)  # keep the committed drafts, drop the rejected ones
        t3 = time.perf_counter()

        if self.adaptive_k:
            seq.acceptance.update(k, n)
            if feed.numel() == k + 1 and not proposal.catch_up:  # a step like every later one: no prefill
                self.step_costs.record(k, t3 - t0)
        metrics.proposed_tokens += k
        metrics.accepted_tokens += n
        for i in range(k):
            if i >= len(metrics.proposed_per_position):
                metrics.proposed_per_position.append(0)
                metrics.accepted_per_position.append(0)
            metrics.proposed_per_position[i] += 1
            metrics.accepted_per_position[i] += int(i < n)
        metrics.draft_time_s += t1 - t0
        metrics.target_time_s += t2 - t1
        metrics.verify_time_s += t3 - t2
        return seq.commit(new_tokens, self.eos_token_ids, self.max_len)

    def run(self, seq: Sequence) -> Iterator[list[int]]:
        """Step until the sequence finishes, yielding each step's committed tokens."""
        start = time.perf_counter()
        try:
            while not seq.finished:
                tokens = self.step(seq)
                if seq.metrics.first_token_time_s is None:
                    seq.metrics.first_token_time_s = time.perf_counter() - start
                seq.metrics.wall_time_s = time.perf_counter() - start
                yield tokens
        finally:
            seq.metrics.wall_time_s = time.perf_counter() - start
            seq.target_cache = self.target.new_cache()  # free the KV memory of finished or abandoned requests
            seq.draft_state = None

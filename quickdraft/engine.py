"""The propose-verify-accept loop.

One step for one sequence: the proposer drafts k tokens; the target runs once on the tokens its cache
lacks (the last committed token; on the first step the whole prompt, alone) followed by the k drafts; the
k+1 last rows of its logits are processed with the request's sampling parameters and verified against the
draft; the accepted prefix plus one target token (the correction or the bonus) is committed; the target's
cache rolls back to exactly the committed positions. All per-request state lives on the Sequence.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from quickdraft import adaptive, sampling, verify
from quickdraft.drafts.base import Proposal, Proposer
from quickdraft.errors import QuickdraftError
from quickdraft.models.runner import HFRunner
from quickdraft.params import SamplingParams
from quickdraft.sequence import RequestMetrics, Sequence

__all__ = ["Engine", "RequestMetrics", "Sequence"]


class Engine:
    """Speculative decoding of sequences with one target runner and one proposer."""

    def __init__(self, target: HFRunner, proposer: Proposer, num_speculative_tokens: int,
                 eos_token_ids: set[int] | None = None, max_len: int | None = None, adaptive_k: bool = False):
        if num_speculative_tokens < 0:
            raise QuickdraftError(f"num_speculative_tokens must be >= 0 (0: plain decoding), got {num_speculative_tokens}")
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
        k = max(0, min(k, remaining - 1, self.max_len - len(history), self.proposer.max_draft_tokens(seq)))
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
            num_accepted, next_token = verify.greedy_accept(sampling.noisy_scores(processed, noise)[None],
                                                            draft[None])
        else:
            q = None if proposal.probs is None else proposal.probs[:k][None]
            num_accepted, next_token = verify.rejection_sample(processed[None], q, draft[None], seq.generator)
        n, token = torch.stack([num_accepted[0], next_token[0]]).tolist()  # the step's one host sync
        drafts = draft[:n].tolist()
        cache.rollback(len(history) + n)  # keep the committed drafts, drop the rejected ones
        t3 = time.perf_counter()

        if self.adaptive_k:
            seq.acceptance.update(k, n)
            if feed.numel() == k + 1 and not proposal.catch_up:  # a step like every later one: no prefill
                self.step_costs.record(k, t3 - t0)
        metrics.count_proposed(k)
        metrics.draft_time_s += t1 - t0
        metrics.target_time_s += t2 - t1
        metrics.verify_time_s += t3 - t2
        return seq.commit(drafts, k, token, self.eos_token_ids, self.max_len)

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

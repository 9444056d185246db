"""The step: propose, one target forward, verify, commit, for a batch of sequences.

One step for a batch of sequences: the proposer drafts k_i tokens for each (the policy, step/policy.py, chooses
k_i); the target runs once on every sequence's new tokens (its last committed token, or on its first step its
whole prompt with no drafts) followed by its k_i drafts; the rows are processed with each sequence's sampling
parameters and verified over the whole batch (step/verification.py); the accepted prefix plus one target token
(the correction or the bonus) is committed; each target cache rolls back to exactly the committed positions.
Per-request state lives on the Sequence, whose life the scheduler owns: it makes a sequence and tells the engine
(`attach`: the target's cache, the proposer's draft state, the penalty row), and tells it again when the sequence
ends or is preempted (`detach`).
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from quickdraft import sampling
from quickdraft.drafts.base import Proposal, Proposer, TreeSettings
from quickdraft.errors import QuickdraftError
from quickdraft.kv import CountedCaches
from quickdraft.models.base import Runner, TreeAttention
from quickdraft.params import SamplingParams
from quickdraft.sequence import Logprob, PositionLogprobs, RequestMetrics, Sequence
from quickdraft.step.policy import SpeculationPolicy, StepTiming
from quickdraft.step.verification import Verdict, process_rows, reads_argmax_only, verify_batch
from quickdraft.step_batch import StepBatch

__all__ = ["Engine", "RequestMetrics", "Sequence"]


def _as_logprobs(entries: list[dict[int, tuple[float, int]]]) -> list[PositionLogprobs]:
    """sampling.token_logprobs' (log-probability, rank) pairs as the Logprob entries requests keep."""
    return [{t: Logprob(lp, rank) for t, (lp, rank) in entry.items()} for entry in entries]


def _target_cache(seq: Sequence):
    return seq.target_cache


def _draft_cache(seq: Sequence):
    return seq.draft_state.kv_cache if seq.draft_state is not None else None


def _history(seq: Sequence) -> list[int]:
    return seq.token_ids


class Engine:
    """Speculative decoding of sequences with one target runner and one proposer."""

    def __init__(self, target: Runner, proposer: Proposer, num_speculative_tokens: int,
                 eos_token_ids: set[int] | None = None, max_len: int | None = None, adaptive_k: bool = False,
                 relaxed_threshold: float | None = None, tree: TreeSettings | None = None):
        if num_speculative_tokens < 0:
            raise QuickdraftError("num_speculative_tokens must be >= 0 (0: plain decoding), "
                                  f"got {num_speculative_tokens}")
        self.target = target
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.eos_token_ids = set(eos_token_ids or ())
        self.max_len = min(max_len or target.max_len, target.max_len)
        # LOSSY relaxed acceptance (SpeculativeConfig acceptance="relaxed"): None, the default, is exact.
        self.relaxed_threshold = relaxed_threshold
        # Token trees (speculative_config "tree"): None, the default, drafts chains; "auto" sizes them (the policy).
        self.tree = tree if num_speculative_tokens > 0 else None
        if self.tree is not None and relaxed_threshold is not None:
            raise QuickdraftError("token trees are verified exactly; the LOSSY relaxed acceptance takes chains only: "
                                  "drop speculative_config['tree'] or the relaxed acceptance")
        self.policy = SpeculationPolicy(proposer, num_speculative_tokens, adaptive_k, self.tree, self.max_len)
        self._penalty_table: sampling.PenaltyTable | None = None  # the rows of every sequence with penalties
        self._no_drafts = Proposal.empty(target.device)  # every sequence's proposal in a plain step

    @property
    def adaptive_k(self) -> bool:
        return self.policy.adaptive_k

    @property
    def max_step_drafts(self) -> int:
        """The most draft tokens one sequence verifies in a step (K, or a token tree's max_nodes): the target
        rows and the cache slots past its history that a step may write."""
        return self.k if self.tree is None else max(self.k, self.tree.max_nodes)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def with_k(self, num_speculative_tokens: int, adaptive_k: bool | None = None) -> "Engine":
        """The same target, proposer and limits with another draft length (proposers keep no per-K state),
        adaptive or fixed (default: as this engine)."""
        adaptive_k = self.adaptive_k if adaptive_k is None else adaptive_k
        return Engine(self.target, self.proposer, num_speculative_tokens, self.eos_token_ids, self.max_len,
                      adaptive_k, self.relaxed_threshold, self.tree)

    def kv_caches(self) -> list[CountedCaches]:
        """The per-sequence caches whose KV memory counts: the target's, and a draft model's (the proposer's
        draft_runner, its cache in the sequence's draft state, keyed by the draft's own history)."""
        counted = [CountedCaches(self.target, _target_cache, _history)]
        proposer = self.proposer
        if proposer.draft_runner is not None:
            counted.append(CountedCaches(proposer.draft_runner, _draft_cache, proposer.draft_history,
                                         proposer.draft_length, proposer.draft_reads_target_tokens))
        return counted

    # --- a sequence's life, as the scheduler tells it -----------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request this engine cannot run (QuickdraftError naming the problem), before anything of it
        is made."""
        if not prompt_ids:
            raise QuickdraftError("the prompt is empty; give at least one token of prompt")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise QuickdraftError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if params.logit_bias is not None and max(params.logit_bias) >= vocab:
            raise QuickdraftError(f"logit_bias names token {max(params.logit_bias)}, but the vocabulary has {vocab} "
                                  f"tokens (ids 0..{vocab - 1})")
        if len(prompt_ids) >= self.max_len:
            raise QuickdraftError(f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_len}; "
                                  "shorten the prompt so that at least one token can be generated")

    def attach(self, seq: Sequence) -> None:
        """Ready a new sequence for stepping: its target cache, its penalty row, its draft state."""
        params = seq.params
        if params.prompt_logprobs is not None and len(seq.prompt_ids) == 1:
            seq.prompt_logprobs = [None]  # a one-token prompt has nothing to score
        seq.target_cache = self._new_target_cache(seq)
        seq.metrics.num_speculative_tokens = self.k
        seq.relaxed = seq.metrics.lossy = self.relaxed_threshold is not None and self.k > 0
        if seq.penalties is not None:
            if self._penalty_table is None:
                self._penalty_table = sampling.PenaltyTable(self.vocab_size, self.device)
            seq.penalties.move_to(self._penalty_table)
        seq.draft_state = self.proposer.new_state(seq)

    def detach(self, seq: Sequence, preempted: bool = False) -> None:
        """The scheduler is done with seq's caches (their KV blocks are given back already): its target cache
        goes; the proposer releases its draft state (preempted: a fresh one, the sequence reruns from its whole
        history); a finished sequence gives its penalty row back."""
        seq.target_cache = self._new_target_cache(seq)
        seq.cache_mark = None
        self.proposer.release(seq, preempted=preempted)
        if not preempted and seq.penalties is not None:
            seq.penalties.release()
            seq.penalties = None

    def _new_target_cache(self, seq: Sequence):
        """An empty target cache told the length seq will reach: its last step may write K + 1 rows past it."""
        cache = self.target.new_cache()
        cache.length_hint = seq.max_length + self.max_step_drafts + 1
        return cache

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams,
                     generator: torch.Generator | None = None, noise_key: int | None = None) -> Sequence:
        """A sequence stepped by hand (step, step_batch, run), outside a scheduler."""
        self.check_request(prompt_ids, params)
        seq = Sequence(prompt_ids, params, generator, self.device, self.vocab_size, noise_key)
        self.attach(seq)
        return seq

    def run(self, seq: Sequence) -> Iterator[list[int]]:
        """Step until the sequence finishes, yielding each step's committed tokens; then detach it."""
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
            self.detach(seq)  # free the KV memory of finished or abandoned requests

    # --- the step -----------------------------------------------------------------------------------------------
    def step(self, seq: Sequence) -> list[int]:
        """One propose-verify-accept step of one sequence; returns the tokens committed (at least one)."""
        return self.step_batch([seq])[0]

    def step_batch(self, seqs: list[Sequence]) -> list[list[int]]:
        """One step of every sequence in `seqs` together: their drafts proposed as one batch, ONE target forward
        over all their new rows (ragged: each sequence its last token or prompt, then its own k_i drafts), then
        verification over the batch (step/verification.py), rollback and commit per sequence. A sequence's
        tokens do not depend on the others: the target's rows are computed alike however many there are (bf16
        on quickdraft's kernels), attention is per sequence, and sampling draws from each sequence's own
        generator. Returns the tokens each sequence committed."""
        t0 = time.perf_counter()
        proposer, policy = self.proposer, self.policy
        proposer.prepare(seqs)
        if self.k:
            kinds = [proposer.draft_kind(seq) for seq in seqs]  # asked once a step: what keys costs and acceptance
            chosen = policy.choose_ks(seqs, kinds)  # the draft length (a tree's depth) asked for
        else:  # plain decoding
            kinds, chosen = ["lookup"] * len(seqs), [0] * len(seqs)
        forwards_before = proposer.forwards
        proposals = self._propose(seqs, chosen, kinds)
        if any(chosen):
            drafts = [proposal.tokens if proposal.tree is not None or proposal.tokens.numel() <= k else
                      proposal.tokens[:k] for proposal, k in zip(proposals, chosen)]
            # Structured outputs: a draft ends before its first token the grammar does not take (a model draft's
            # tokens are drawn under the grammar's mask already; a lookup's may leave it). Trees are not asked for
            # grammar-constrained sequences (policy.tree_budgets).
            drafts = [draft[:seq.grammar.valid_prefix(seq.output_ids, draft.tolist())]
                      if seq.grammar is not None and draft.numel() else draft for seq, draft in zip(seqs, drafts)]
            batch = StepBatch.build(drafts, [proposal.probs for proposal in proposals],
                                    [proposal.tree for proposal in proposals])
        else:  # a plain step: every proposal is the same empty one
            drafts = None
            batch = StepBatch.plain(len(seqs), proposals[0].tokens)
        ks = batch.num_draft_tokens
        draft_forwards = proposer.forwards - forwards_before
        t1 = time.perf_counter()

        caches, feeds, histories = self._feeds(seqs, drafts)
        trees = batch.trees
        forward_kwargs = {"trees": [None if tree is None else TreeAttention.of_tree(length, tree.parent_list)
                                 for tree, length in zip(trees, histories)]} if any(t is not None for t in trees) else {}
        # A sequence that asked for prompt_logprobs scores every prompt row in its first forward (its feed is
        # the whole prompt then: the scheduler loads no cached prefix for it).
        prompt_rows = [int(feed.numel()) - 1 if seq.wants_prompt_logprobs and k == 0 else 0
                       for seq, feed, k in zip(seqs, feeds, ks)] if any(seq.wants_prompt_logprobs for seq in seqs) else None
        scores_prompts = prompt_rows is not None and any(prompt_rows)
        num_logits = [k + 1 + extra for k, extra in zip(ks, prompt_rows)] if scores_prompts else [k + 1 for k in ks]
        # Where every row is verified by its argmax (no sampling, nothing that processes its logits) and no one
        # reads its logprobs, the runner gives the argmax alone, which it may compute without writing the logits.
        argmax_only = self.relaxed_threshold is None and not scores_prompts and \
            all(reads_argmax_only(seq) and seq.params.logprobs is None for seq in seqs)
        if argmax_only:
            forward_kwargs["argmax_only"] = True
        hidden = None
        if proposer.uses_target_features:  # the same forward also gives every row's final hidden state
            logits, hidden = self.target.forward_batch(caches, feeds, num_logits, return_hidden=True, **forward_kwargs)
        else:  # [sum(num_logits), V], or argmax_only [sum(num_logits)]
            logits = self.target.forward_batch(caches, feeds, num_logits, **forward_kwargs)
        if scores_prompts:
            logits = self._record_prompt_logprobs(seqs, feeds, histories, logits, num_logits, prompt_rows)
        t2 = time.perf_counter()

        if argmax_only:
            verdict = verify_batch(seqs, None, batch, target=logits)
        else:
            processed = process_rows(seqs, logits, batch)  # [num_rows, V]: logits (greedy) or probabilities
            verdict = verify_batch(seqs, processed, batch, self.relaxed_threshold)
        verdicts = verdict.to_host()  # the step's one host read
        t3 = time.perf_counter()
        if any(seq.params.logprobs is not None for seq in seqs):
            step_logprobs = self._output_logprobs(seqs, logits, batch, verdicts)
        else:
            step_logprobs = [None] * len(seqs)
        if hidden is not None:
            self._observe(seqs, feeds, ks, histories, hidden, verdicts)
        timing = StepTiming(t0, t1, t2, t3)
        if policy.adaptive_k:
            policy.record_step(sum(int(feed.numel()) for feed in feeds), ks, timing, draft_forwards,
                               any(proposal.catch_up for proposal in proposals))
        return self._commit(seqs, batch, proposals, kinds, chosen, caches, histories, feeds, verdicts, step_logprobs,
                            draft_forwards, timing)

    def _feeds(self, seqs: list[Sequence], drafts: list[torch.Tensor] | None
               ) -> tuple[list, list[torch.Tensor], list[int]]:
        """Each sequence's cache (synced to its history), its feed (what the cache lacks of the history, then
        its drafts; drafts None: a plain step's, none) and its history's length. The history parts and the drafts
        made on the host (lookups) come from one host-to-device copy (from pinned memory, not waited for, on a
        GPU); a draft made on the device (a draft model's there) is joined to its feed on the device, with no host
        read."""
        caches, bounds, histories, host, on_device = [], [0], [], [], {}
        for i, seq in enumerate(seqs):
            history = seq.token_ids
            cache = seq.target_cache
            mark = seq.cache_mark
            if mark is not None and mark[0] is cache and len(cache) == mark[1] <= len(history):
                start = mark[1]  # the cache holds history[:start] (Sequence.cache_mark)
            else:
                start = cache.sync(history)
            if start == len(history):  # the last token's logits are needed again (only after a cache reset)
                start -= 1
                cache.rollback(start)
            caches.append(cache)
            histories.append(len(history))
            host += history[start:]
            draft = drafts[i] if drafts is not None else None
            if draft is not None and draft.numel():
                if draft.device.type == "cpu":
                    host += draft.tolist()
                else:
                    on_device[i] = draft
            bounds.append(len(host))
        parts = torch.tensor(host, dtype=torch.long)
        if self.device.type == "cuda":
            parts = parts.pin_memory().to(self.device, non_blocking=True)
        else:
            parts = parts.to(self.device)
        feeds = list(parts.split([b - a for a, b in zip(bounds, bounds[1:])]))  # views, in one call
        for i, draft in on_device.items():
            feeds[i] = torch.cat([feeds[i], draft.to(parts.device)])
        return caches, feeds, histories

    def _observe(self, seqs: list[Sequence], feeds: list[torch.Tensor], ks: list[int], histories: list[int],
                 hidden: torch.Tensor, verdicts: list[Verdict]) -> None:
        """[sum(n_i), hidden]: hand each sequence the features of its committed positions (the proposer reads
        the target's hidden states: EAGLE)."""
        row = 0
        for seq, feed, k, length, verdict in zip(seqs, feeds, ks, histories, verdicts):
            rows = int(feed.numel())
            committed = rows - k  # the feed's rows before its drafts (the last is the root)
            nodes = verdict.nodes
            if nodes == list(range(len(nodes))):  # a chain's accepted drafts follow the committed rows: a view
                features = hidden[row: row + committed + len(nodes)]
            else:  # a tree's path
                index = torch.tensor(list(range(committed)) + [committed + j for j in nodes], device=hidden.device)
                features = hidden[row:].index_select(0, index)
            self.proposer.observe(seq, length - committed, features)
            row += rows

    def _commit(self, seqs: list[Sequence], batch: StepBatch, proposals: list[Proposal], kinds: list[str],
                chosen: list[int], caches: list, histories: list[int], feeds: list[torch.Tensor],
                verdicts: list[Verdict], step_logprobs: list, draft_forwards: int, timing: StepTiming
                ) -> list[list[int]]:
        """Roll each sequence's cache back to what it keeps, count the step, and append its tokens (telling the
        policy how long one that finished ran); returns the tokens each committed. (One loop over the batch: the
        step's constants are read once.)"""
        policy, eos, max_len = self.policy, self.eos_token_ids, self.max_len
        recording = policy.adaptive_k
        alone = len(seqs) == 1
        draft_s, target_s, verify_s = timing.t1 - timing.t0, timing.t2 - timing.t1, timing.t3 - timing.t2
        out = []
        for i, seq in enumerate(seqs):
            tree, k, cache, length = batch.trees[i], batch.num_draft_tokens[i], caches[i], histories[i]
            n, tokens, nodes = verdicts[i]
            metrics = seq.metrics
            if tree is None:
                cache.rollback(length + n)  # keep the committed drafts, drop the rejected ones
                if k:
                    metrics.count_proposed(k)
                # The target's token ends the step as a bonus where every draft was accepted, else a correction.
                bonus = n == k
            else:  # the accepted path's keys move next to the prefix; every other node's are dropped
                cache.compact(length, [length + j for j in nodes])
                metrics.count_tree(tree.num_nodes, tree.max_depth, n)
                bonus = not tree.children(nodes[-1] + 1 if nodes else 0)  # the path ends at a leaf
            metrics.target_forwards += 1
            metrics.draft_forwards += draft_forwards  # the batch's draft forwards served every sequence in it
            metrics.draft_time_s += draft_s
            metrics.target_time_s += target_s
            metrics.verify_time_s += verify_s
            if recording or tree is not None:
                policy.record_sequence(seq, kinds[i], k, chosen[i], n, proposals[i], nodes, alone,
                                       int(feeds[i].numel()) != k + 1, timing, time.perf_counter())
            seq.cache_mark = (cache, length + n)
            out.append(seq.commit(tokens[:n], n if bonus else n + 1, tokens[n], eos, max_len, step_logprobs[i]))
            if recording and seq.finish_reason is not None:
                policy.record_finished(seq)
        return out

    def _propose(self, seqs: list[Sequence], ks: list[int], kinds: list[str]) -> list[Proposal]:
        """The step's proposals: token trees (Proposer.propose_tree_batch) for the sequences that may take one
        (trees on, a proposer that makes them, a draft this step, no grammar: a grammar checks drafts as a line),
        chains (propose_batch) for the others. Nothing is asked where no sequence drafts."""
        proposer = self.proposer
        if not any(ks):
            return [self._no_drafts] * len(seqs)
        if self.tree is None or not proposer.proposes_trees:
            return proposer.propose_batch(seqs, ks)
        budgets = self.policy.tree_budgets(seqs, ks, kinds)
        tree_rows = [i for i, budget in enumerate(budgets) if budget is not None]
        chain_rows = [i for i, budget in enumerate(budgets) if budget is None]
        proposals: list[Proposal | None] = [None] * len(seqs)
        if tree_rows:
            made = proposer.propose_tree_batch([seqs[i] for i in tree_rows], [budgets[i] for i in tree_rows])
            for i, proposal in zip(tree_rows, made):
                proposals[i] = proposal
        if chain_rows:
            made = proposer.propose_batch([seqs[i] for i in chain_rows], [ks[i] for i in chain_rows])
            for i, proposal in zip(chain_rows, made):
                proposals[i] = proposal
        if self.policy.auto_tree:
            proposals = self.policy.size_trees(seqs, kinds, proposals)
        for i in tree_rows:
            tree, budget = proposals[i].tree, budgets[i]
            if tree is not None and (tree.num_nodes > budget.max_nodes or tree.max_depth > budget.max_depth or
                                     int(proposals[i].tokens.numel()) != tree.num_nodes):
                raise QuickdraftError(f"{proposer.name}: a token tree of {tree.num_nodes} nodes and depth "
                                      f"{tree.max_depth} exceeds its budget of {budget.max_nodes} nodes and depth "
                                      f"{budget.max_depth} (or its tokens are not its nodes); this is a bug")
        return proposals

    # --- log-probabilities (asked for per request) --------------------------------------------------------------
    @staticmethod
    def _record_prompt_logprobs(seqs: list[Sequence], feeds: list[torch.Tensor], histories: list[int],
                                logits: torch.Tensor, num_logits: list[int], prompt_rows: list[int]) -> torch.Tensor:
        """Keep each prompt-scoring sequence's prompt log-probabilities (row i of its feed scores feed token
        i + 1) and return the verification rows alone, [sum(k_i + 1), V]."""
        keep, row = [], 0
        for seq, feed, length, count, extra in zip(seqs, feeds, histories, num_logits, prompt_rows):
            if extra:
                start = length - int(feed.numel())  # the feed's first position (0: the whole prompt)
                entries = sampling.token_logprobs(logits[row: row + extra], feed[1: extra + 1],
                                                  seq.params.prompt_logprobs)
                seq.prompt_logprobs = [None] * (start + 1) + _as_logprobs(entries)
            keep.extend(range(row + extra, row + count))
            row += count
        return logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))

    @staticmethod
    def _output_logprobs(seqs: list[Sequence], logits: torch.Tensor, batch: StepBatch,
                         verdicts: list[Verdict]) -> list[list[PositionLogprobs] | None]:
        """Per sequence that asked for logprobs, those of the tokens its step emits (the accepted drafts, then
        the target's token): the rows scoring them in the raw logits [sum(k_i + 1), V] (a chain's rows lo..lo+n,
        a tree's root row and its path's rows), the rows plain decoding computes for those positions; None for
        the others."""
        out: list[list[PositionLogprobs] | None] = []
        for i, (seq, verdict) in enumerate(zip(seqs, verdicts)):
            if seq.params.logprobs is None:
                out.append(None)
                continue
            lo = batch.cu_num_rows[i]
            rows = torch.tensor([lo] + [lo + 1 + j for j in verdict.nodes], device=logits.device)
            tokens = torch.tensor(verdict.tokens, device=logits.device)
            out.append(_as_logprobs(sampling.token_logprobs(logits.index_select(0, rows), tokens, seq.params.logprobs)))
        return out

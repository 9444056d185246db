"""The propose-verify-accept loop.

One step for a batch of sequences: the proposer drafts k_i tokens for each; the target runs once on every
sequence's new tokens (its last committed token, or on its first step its whole prompt with no drafts)
followed by its k_i drafts; each sequence's k_i+1 last rows are processed with its sampling parameters and
verified against its draft; the accepted prefix plus one target token (the correction or the bonus) is
committed; each target cache rolls back to exactly the committed positions. Per-request state lives on the
Sequence.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from quickdraft import adaptive, sampling, verify, verify_tree
from quickdraft.drafts.base import Proposal, Proposer, TreeBudget, TreeSettings
from quickdraft.errors import QuickdraftError
from quickdraft.models.base import Runner, TreeAttention
from quickdraft.params import SamplingParams
from quickdraft.sequence import Logprob, PositionLogprobs, RequestMetrics, Sequence, prefetch_log_noise
from quickdraft.step_batch import StepBatch

__all__ = ["Engine", "RequestMetrics", "Sequence"]


def _as_logprobs(entries: list[dict[int, tuple[float, int]]]) -> list[PositionLogprobs]:
    """sampling.token_logprobs' (log-probability, rank) pairs as the Logprob entries requests keep."""
    return [{t: Logprob(lp, rank) for t, (lp, rank) in entry.items()} for entry in entries]


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
        self.adaptive_k = adaptive_k and num_speculative_tokens > 0
        self.step_costs = adaptive.StepCosts(num_speculative_tokens)  # one sequence alone, by k
        # ... per draft kind after the first (Proposer.draft_kind): lookup steps cost no draft forwards
        self._step_costs_by_kind: dict[str, adaptive.StepCosts] = {}
        self.batch_costs = adaptive.BatchCosts()  # any batch, by rows
        # Per draft kind and part of a tree ("chain": its first-child path, "branch": its other nodes; "tree": "auto")
        self._tree_calibration: dict[tuple[str, str], adaptive.TreeCalibration] = {}
        self._acceptance_priors: dict[str, adaptive.AcceptancePrior] = {}  # per draft kind (acceptance_prior)
        self.eos_token_ids = set(eos_token_ids or ())
        self.max_len = min(max_len or target.max_len, target.max_len)
        # LOSSY relaxed acceptance (SpeculativeConfig acceptance="relaxed"): None, the default, is exact.
        self.relaxed_threshold = relaxed_threshold
        # Token trees (speculative_config "tree"): None, the default, drafts chains. "auto" sizes them: the depth
        # (draft levels) before drafting as adaptive K chooses k from the batch's costs by rows and the trees'
        # per-depth acceptance (a tree step's accepted path is a chain's accepted drafts), then the nodes worth
        # verifying (_size_trees).
        self.tree = tree if num_speculative_tokens > 0 else None
        self._auto_tree = self.tree is not None and self.tree.auto
        self.adaptive_k = self.adaptive_k or self._auto_tree
        if self.tree is not None and relaxed_threshold is not None:
            raise QuickdraftError("token trees are verified exactly; the LOSSY relaxed acceptance takes chains only: "
                                  "drop speculative_config['tree'] or the relaxed acceptance")

    @property
    def max_step_drafts(self) -> int:
        """The most draft tokens one sequence verifies in a step (K, or a token tree's max_nodes): the target
        rows and the cache slots past its history that a step may write."""
        return self.k if self.tree is None else max(self.k, self.tree.max_nodes)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def with_k(self, num_speculative_tokens: int, adaptive_k: bool | None = None) -> "Engine":
        """The same target, proposer and limits with another draft length (proposers keep no per-K state),
        adaptive or fixed (default: as this engine)."""
        adaptive_k = self.adaptive_k if adaptive_k is None else adaptive_k
        return Engine(self.target, self.proposer, num_speculative_tokens, self.eos_token_ids, self.max_len,
                      adaptive_k, self.relaxed_threshold, self.tree)

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams,
                     generator: torch.Generator | None = None, noise_key: int | None = None) -> Sequence:
        if not prompt_ids:
            raise QuickdraftError("the prompt is empty; give at least one token of prompt")
        vocab = self.target.vocab_size
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise QuickdraftError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if params.logit_bias is not None and max(params.logit_bias) >= vocab:
            raise QuickdraftError(f"logit_bias names token {max(params.logit_bias)}, but the vocabulary has {vocab} "
                                  f"tokens (ids 0..{vocab - 1})")
        if len(prompt_ids) >= self.max_len:
            raise QuickdraftError(f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_len}; "
                                  "shorten the prompt so that at least one token can be generated")
        seq = Sequence(prompt_ids, params, generator, self.device, vocab, noise_key)
        if params.prompt_logprobs is not None and len(prompt_ids) == 1:
            seq.prompt_logprobs = [None]  # a one-token prompt has nothing to score
        seq.target_cache = self.target.new_cache()
        seq.metrics.num_speculative_tokens = self.k
        seq.relaxed = seq.metrics.lossy = self.relaxed_threshold is not None and self.k > 0
        seq.draft_state = self.proposer.new_state(seq)
        return seq

    def step(self, seq: Sequence) -> list[int]:
        """One propose-verify-accept step of one sequence; returns the tokens committed (at least one)."""
        return self.step_batch([seq])[0]

    def _cap_k(self, seq: Sequence) -> int:
        """The most drafts `seq` may take this step: the engine's K, the request's own cap, what max_tokens, the
        context and the proposer leave room for; 0 while the prompt is still to be read."""
        history = seq.token_ids
        if len(history) - len(seq.target_cache) > 1:
            # The prompt goes through the target with no drafts after it, as in plain decoding: its cached keys
            # must not depend on whether drafts followed.
            return 0
        cap = self.k if seq.params.num_speculative_tokens is None else min(self.k, seq.params.num_speculative_tokens)
        remaining = seq.params.max_tokens - len(seq.output_ids)
        return max(0, min(cap, remaining - 1, self.max_len - len(history), self.proposer.max_draft_tokens(seq)))

    def _choose_ks(self, seqs: list[Sequence], kinds: list[str]) -> list[int]:
        """Each sequence's draft length this step: its cap when K is fixed; adaptive, the k that maximises
        expected tokens per second, for one sequence from its step costs by k, for a batch from the batch's
        costs by rows (batch-aware: as verification competes for compute, drafting stops where it no longer
        pays)."""
        caps = [self._cap_k(seq) for seq in seqs]
        if not self.adaptive_k:
            return caps
        if len(seqs) == 1:
            seq, kind = seqs[0], kinds[0]
            if caps[0] == 0:
                return [0]
            costs = self.step_costs_of(kind)
            # A model draft that has not read the prompt (or what it missed at K = 0) reads it first: priced.
            unread = self.proposer.unread_history(seq) if kind == "model" else 0
            return [adaptive.choose_k(self._acceptance(seq, kind), costs, caps[0],
                                      unread * costs.catch_up_per_token(), seq.params.max_tokens - len(seq.output_ids))]
        base_rows = sum(max(1, len(seq.token_ids) - len(seq.target_cache)) for seq in seqs)
        return adaptive.choose_batch_k([self._acceptance(seq, kind) for seq, kind in zip(seqs, kinds)], caps,
                                       base_rows, self.batch_costs, "model" in kinds)

    def step_costs_of(self, kind: str) -> adaptive.StepCosts:
        """The one-sequence step costs of drafts of `kind` (the first kind's are self.step_costs)."""
        costs = self._step_costs_by_kind.get(kind)
        if costs is None:
            costs = self._step_costs_by_kind[kind] = \
                self.step_costs if not self._step_costs_by_kind else adaptive.StepCosts(self.k)
        return costs

    def acceptance_prior(self, kind: str) -> adaptive.AcceptancePrior:
        """What a new request's drafts of `kind` are expected to accept, learned from every sequence's steps of
        that kind on this engine (a new request starts from the model pair's acceptance, not a fixed guess)."""
        prior = self._acceptance_priors.get(kind)
        if prior is None:
            prior = self._acceptance_priors[kind] = adaptive.AcceptancePrior()
        return prior

    def _acceptance(self, seq: Sequence, kind: str) -> adaptive.AcceptanceStats:
        """seq's acceptance estimates for drafts of `kind`, starting from (and feeding) the engine's prior."""
        return seq.acceptance_for(kind, self.acceptance_prior(kind))

    def step_batch(self, seqs: list[Sequence]) -> list[list[int]]:
        """One step of every sequence in `seqs` together: their drafts proposed as one batch, ONE target forward
        over all their new rows (ragged: each sequence its last token or prompt, then its own k_i drafts), then
        verification, rollback and commit per sequence. A sequence's tokens do not depend on the others: the
        target's rows are computed alike however many there are (bf16 on quickdraft's kernels), attention is
        per sequence, and sampling is per sequence. Returns the tokens each sequence committed."""
        t0 = time.perf_counter()
        self.proposer.prepare(seqs)
        kinds = [self.proposer.draft_kind(seq) for seq in seqs]  # asked once a step: what keys costs and acceptance
        ks = self._choose_ks(seqs, kinds)
        chosen = list(ks)  # the draft length (a tree's depth) asked for, which step costs are keyed by
        draft_forwards = self.proposer.forwards
        proposals = self._propose(seqs, ks, kinds)
        trees = [proposal.tree for proposal in proposals]  # None: a chain
        drafts = [proposal.tokens if tree is not None else proposal.tokens[:k]
                  for proposal, tree, k in zip(proposals, trees, ks)]
        # Structured outputs: a draft ends before its first token the grammar does not take (a model draft's
        # tokens are drawn under the grammar's mask already; a lookup's may leave it). Trees are not asked for
        # grammar-constrained sequences (_propose).
        drafts = [draft[:seq.grammar.valid_prefix(seq.output_ids, draft.tolist())]
                  if seq.grammar is not None and draft.numel() else draft for seq, draft in zip(seqs, drafts)]
        ks = [int(d.numel()) for d in drafts]
        draft_forwards = self.proposer.forwards - draft_forwards
        t1 = time.perf_counter()

        caches, feeds, histories, attention = [], [], [], []
        for seq, draft, tree in zip(seqs, drafts, trees):
            history = seq.token_ids
            cache = seq.target_cache
            start = cache.sync(history)
            if start == len(history):  # the last token's logits are needed again (only after a cache reset)
                start -= 1
                cache.rollback(start)
            caches.append(cache)
            histories.append(len(history))
            feeds.append(torch.cat([torch.tensor(history[start:], dtype=torch.long, device=self.device), draft]))
            # A tree's nodes at slots len(history).., hanging off the last committed token (its root).
            attention.append(None if tree is None else TreeAttention.of_tree(len(history), tree.parents.tolist()))
        tree_kwargs = {"trees": attention} if any(t is not None for t in trees) else {}
        # A sequence that asked for prompt_logprobs scores every prompt row in its first forward (its feed is
        # the whole prompt then: the scheduler loads no cached prefix for it).
        prompt_rows = [int(feed.numel()) - 1 if seq.wants_prompt_logprobs and k == 0 else 0
                       for seq, feed, k in zip(seqs, feeds, ks)]
        num_logits = [k + 1 + extra for k, extra in zip(ks, prompt_rows)]
        hidden = None
        if self.proposer.uses_target_features:  # the same forward also gives every row's final hidden state
            logits, hidden = self.target.forward_batch(caches, feeds, num_logits, return_hidden=True, **tree_kwargs)
        else:
            logits = self.target.forward_batch(caches, feeds, num_logits, **tree_kwargs)  # [sum(num_logits), V]
        if any(prompt_rows):
            logits = self._record_prompt_logprobs(seqs, feeds, histories, logits, num_logits, prompt_rows)
        t2 = time.perf_counter()

        n_tokens, paths = self._verify_batch(seqs, logits, drafts, proposals)  # logits: [sum(k_i + 1), V]
        t3 = time.perf_counter()
        # Each sequence's accepted draft indices: a tree's path, a chain's first n.
        accepted = [path if path is not None else list(range(n)) for path, (n, _) in zip(paths, n_tokens)]
        step_logprobs = self._output_logprobs(seqs, logits, drafts, n_tokens, accepted)
        if hidden is not None:  # [sum(n_i), hidden]: hand each sequence the features of its committed positions
            row = 0
            for seq, feed, k, length, nodes in zip(seqs, feeds, ks, histories, accepted):
                committed = int(feed.numel()) - k  # the feed's rows before its drafts (the last is the root)
                index = torch.tensor(list(range(committed)) + [committed + j for j in nodes], device=hidden.device)
                self.proposer.observe(seq, length - committed, hidden[row:].index_select(0, index))
                row += int(feed.numel())

        if self.adaptive_k:
            caught_up = any(proposal.catch_up for proposal in proposals)
            self.batch_costs.record(sum(int(feed.numel()) for feed in feeds), t3 - t1, sum(k > 0 for k in ks),
                                    draft_forwards, None if caught_up else t1 - t0)
        committed = []
        for index, (seq, proposal, tree, draft, k, cache, length, feed, (n, token), nodes, logprobs) in enumerate(
                zip(seqs, proposals, trees, drafts, ks, caches, histories, feeds, n_tokens, accepted, step_logprobs)):
            metrics = seq.metrics
            if tree is None:
                cache.rollback(length + n)  # keep the committed drafts, drop the rejected ones
                metrics.count_proposed(k)
            else:  # the accepted path's keys move next to the prefix; every other node's are dropped
                cache.compact(length, [length + j for j in nodes])
                metrics.count_tree(tree.num_nodes, tree.max_depth, n)
                if proposal.scores is not None:  # how the proposer's chances compare with what was accepted
                    chain = tree.first_child_path()
                    scores = proposal.scores.float().cpu()
                    on_chain = float(scores[chain].sum()) if chain else 0.0
                    accepted_on_chain = sum(1 for a, b in zip(nodes, chain) if a == b)  # the path's first nodes
                    self._calibration(kinds[index], "chain").update(on_chain, accepted_on_chain)
                    self._calibration(kinds[index], "branch").update(float(scores.sum()) - on_chain,
                                                                     n - accepted_on_chain)
            metrics.target_forwards += 1
            metrics.draft_forwards += draft_forwards  # the batch's draft forwards served every sequence in it
            metrics.draft_time_s += t1 - t0
            metrics.target_time_s += t2 - t1
            metrics.verify_time_s += t3 - t2
            if self.adaptive_k:
                # Per depth for a tree (depth d was judged when the path reached d - 1): a chain of its depth.
                # The kind's engine-wide prior is fed the same way (AcceptanceStats.update).
                self._acceptance(seq, kinds[index]).update(k if tree is None else tree.max_depth, n)
                # A step like every later one (no prompt, no draft catch-up), alone in its batch: its time is the
                # cost of drafting k (a tree: of the depth asked for, "auto"'s choice). Batched steps are not timed
                # (their cost depends on the batch).
                if len(seqs) == 1 and feed.numel() == k + 1 and not proposal.catch_up:
                    self.step_costs_of(kinds[index]).record(k if tree is None else chosen[index],
                                                            time.perf_counter() - t0, t1 - t0)
                elif len(seqs) == 1 and proposal.catch_up and k > 0 and tree is None:
                    self.step_costs_of(kinds[index]).record_catch_up(k, proposal.catch_up, t1 - t0)
            # The target's token ends the step as a bonus where nothing was left to verify after the accepted
            # drafts (all k of a chain; a tree path that ends at a leaf), else as a correction.
            bonus = n == k if tree is None else not tree.children(nodes[-1] + 1 if nodes else 0)
            committed.append(seq.commit(draft[nodes].tolist(), n if bonus else n + 1, token, self.eos_token_ids,
                                        self.max_len, logprobs))
        return committed

    def _propose(self, seqs: list[Sequence], ks: list[int], kinds: list[str]) -> list[Proposal]:
        """The step's proposals: token trees (Proposer.propose_tree_batch) for the sequences that may take one
        (trees on, a proposer that makes them, a draft this step, no grammar: a grammar checks drafts as a line),
        chains (propose_batch) for the others."""
        if self.tree is None or not self.proposer.proposes_trees:
            return self.proposer.propose_batch(seqs, ks)
        row_worth = self._row_worth(seqs, ks, kinds) if self._auto_tree else 0.0
        budgets = [self._tree_budget(seq, k, kind, row_worth) for seq, k, kind in zip(seqs, ks, kinds)]
        tree_rows = [i for i, budget in enumerate(budgets) if budget is not None]
        chain_rows = [i for i, budget in enumerate(budgets) if budget is None]
        proposals: list[Proposal | None] = [None] * len(seqs)
        if tree_rows:
            made = self.proposer.propose_tree_batch([seqs[i] for i in tree_rows], [budgets[i] for i in tree_rows])
            for i, proposal in zip(tree_rows, made):
                proposals[i] = proposal
        if chain_rows:
            made = self.proposer.propose_batch([seqs[i] for i in chain_rows], [ks[i] for i in chain_rows])
            for i, proposal in zip(chain_rows, made):
                proposals[i] = proposal
        if self._auto_tree:
            proposals = self._size_trees(seqs, kinds, proposals)
        for i in tree_rows:
            tree, budget = proposals[i].tree, budgets[i]
            if tree is not None and (tree.num_nodes > budget.max_nodes or tree.max_depth > budget.max_depth or
                                     int(proposals[i].tokens.numel()) != tree.num_nodes):
                raise QuickdraftError(f"{self.proposer.name}: a token tree of {tree.num_nodes} nodes and depth "
                                      f"{tree.max_depth} exceeds its budget of {budget.max_nodes} nodes and depth "
                                      f"{budget.max_depth} (or its tokens are not its nodes); this is a bug")
        return proposals

    def _calibration(self, kind: str, part: str) -> adaptive.TreeCalibration:
        """How the draft's tree scores of `kind` compare with what verification accepts, learned per kind and per
        part of the tree: "chain" (the first-child path) and "branch" (every other node). Apart because they
        differ: a sampled tree's chain is the draft's draws, accepted with sum min(p, q) whatever their score,
        and its branches are tried against what the draw left (the residual)."""
        if (kind, part) not in self._tree_calibration:
            self._tree_calibration[kind, part] = adaptive.TreeCalibration()
        return self._tree_calibration[kind, part]

    def _size_trees(self, seqs: list[Sequence], kinds: list[str], proposals: list[Proposal]) -> list[Proposal]:
        """"tree": "auto": each candidate tree (a proposal with node scores) cut to its chain (the first-child path,
        kept whole: the depth adaptive K chose for it from measured acceptance) and those of its other nodes worth
        verifying for the batch's expected tokens per second (adaptive.choose_tree_nodes over the measured step
        costs by rows), best first by calibrated chance.

        Why the chain is kept whole: the draft's confidence is a poor guide to a sampled draw's acceptance (a draw
        from q is accepted with sum min(p, q), whatever q's top probability), and cutting by it lost tokens that
        the chain, sized by measured acceptance, keeps: at T = 0.8 on the Qwen pair 39% of auto's trees lost part of
        their chain (2.66 -> 2.03 nodes) and auto took 0.90x the adaptive chain's tokens a forward
        (benchmarks/RESULTS.md, session 31)."""
        sized = [i for i, p in enumerate(proposals) if p.tree is not None and p.scores is not None]
        if not sized:
            return proposals
        base_rows = sum(max(1, len(seq.token_ids) - len(seq.target_cache)) for seq in seqs) + sum(
            int(p.tokens.numel()) for i, p in enumerate(proposals) if i not in sized)
        chances, orders, chains, base_tokens = [], [], [], 0.0
        for i in sized:
            raw = proposals[i].scores.float().cpu()
            chain = proposals[i].tree.first_child_path()
            in_chain = set(chain)
            scores = (raw * self._calibration(kinds[i], "branch").factor).clamp(max=1.0).tolist()
            order = sorted((j for j in range(len(scores)) if j not in in_chain), key=lambda j: (-scores[j], j))
            chances.append([scores[j] for j in order])  # parents first among equals
            orders.append(order)
            chains.append(chain)
            base_rows += len(chain)
            base_tokens += float((raw[chain] * self._calibration(kinds[i], "chain").factor).clamp(max=1.0).sum())
        counts = adaptive.choose_tree_nodes(chances, base_rows, self.batch_costs, base_tokens)
        out = list(proposals)
        for i, order, chain, count in zip(sized, orders, chains, counts):
            if len(chain) + count < int(proposals[i].tokens.numel()):
                out[i] = proposals[i].pruned(sorted(chain + order[:count]))
        return out

    def _row_worth(self, seqs: list[Sequence], ks: list[int], kinds: list[str]) -> float:
        """"auto": what one more verification row costs, as a share of the step's time (the measured target
        cost by rows and the draft's), at the rows the chosen depths give; 0 while unmeasured. A node is worth
        its row where its chance of being on the accepted path is above the step's expected tokens times this."""
        rows = sum(max(1, len(seq.token_ids) - len(seq.target_cache)) + k for seq, k in zip(seqs, ks))
        step = self.batch_costs.step_seconds(rows, max(ks, default=0), sum(k > 0 for k in ks), "model" in kinds)
        now, more = self.batch_costs.target.estimate(rows, 0.0), self.batch_costs.target.estimate(rows + 1, 0.0)
        if step is None or now is None or more is None or step <= 0:
            return 0.0
        return max(0.0, more - now) / step

    def _tree_budget(self, seq: Sequence, k: int, kind: str, row_worth: float = 0.0) -> TreeBudget | None:
        """The token tree seq may take this step: depth up to k (the step's draft cap) and the tree settings'
        max_depth, nodes up to max_nodes and the slots left in the context; None for a chain step. row_worth
        ("auto"): a node beyond the most probable path must be worth its row (min_chance, in the draft's own
        probabilities: the calibrated chance over the calibration factor)."""
        if k == 0 or seq.grammar is not None:
            return None
        max_nodes = min(self.tree.max_nodes, self.max_len - len(seq.token_ids))
        max_depth = min(self.tree.max_depth, k, max_nodes)
        if max_depth <= 0:
            return None
        min_chance = 0.0
        if row_worth > 0:
            expected = self._acceptance(seq, kind).expected_tokens(max_depth)
            min_chance = min(1.0, expected * row_worth / max(self._calibration(kind, "branch").factor, 1e-6))
        return TreeBudget(max_nodes, max_depth, min_chance)

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
    def _output_logprobs(seqs: list[Sequence], logits: torch.Tensor, drafts: list[torch.Tensor],
                         n_tokens: list[tuple[int, int]], accepted: list[list[int]]) -> list[list[PositionLogprobs] | None]:
        """Per sequence that asked for logprobs, those of the tokens its step emits (the accepted drafts, then
        the target's token): the rows scoring them in the raw logits [sum(k_i + 1), V] (a chain's rows lo..lo+n,
        a tree's root row and its path's rows), the rows plain decoding computes for those positions; None for
        the others."""
        out: list[list[PositionLogprobs] | None] = []
        lo = 0
        for seq, draft, (_, token), nodes in zip(seqs, drafts, n_tokens, accepted):
            if seq.params.logprobs is not None:
                tokens = torch.cat([draft[nodes].to(logits.device), torch.tensor([token], device=logits.device)])
                rows = torch.tensor([lo] + [lo + 1 + j for j in nodes], device=logits.device)
                entries = sampling.token_logprobs(logits.index_select(0, rows), tokens, seq.params.logprobs)
                out.append(_as_logprobs(entries))
            else:
                out.append(None)
            lo += int(draft.numel()) + 1
        return out

    @staticmethod
    def _processed_rows(seqs: list[Sequence], logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The step's rows [num_rows, V] as verification reads them: each sequence's grammar mask, logit bias and
        penalties (at row j, its history plus draft[:j]; a tree's row, its history plus the path to it); then the
        sampled sequences' rows as probabilities."""
        processed = logits
        adjusted = [seq.penalties is not None or seq.params.logit_bias is not None or seq.grammar is not None
                    for seq in seqs]
        if any(adjusted):
            processed = logits.clone()
            for i, (seq, adjust) in enumerate(zip(seqs, adjusted)):
                if adjust:
                    (lo, hi), draft = batch.rows(i), batch.drafts(i)
                    rows = processed[lo:hi]
                    if seq.grammar is not None:  # row i at the grammar's state after draft[:i]: the draft's own
                        rows = seq.grammar_masked(rows, draft.tolist())
                    tree = batch.trees[i]
                    seen, counts = (None, None) if seq.penalties is None else \
                        seq.penalties.rows(draft, hi - lo) if tree is None else seq.penalties.tree_rows(tree)
                    processed[lo:hi] = sampling.apply_penalties(rows, seq.params, seen, counts)
        sampled = [(*batch.rows(i), seq.params) for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled:
            index = torch.tensor([r for lo, hi, _ in sampled for r in range(lo, hi)], device=processed.device)
            params = [p for lo, hi, p in sampled for _ in range(lo, hi)]
            processed = processed.index_copy(0, index, sampling.probs_rows(processed.index_select(0, index), params))
        return processed

    def _verify_batch(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[torch.Tensor],
                      proposals: list[Proposal]) -> tuple[list[tuple[int, int]], list[list[int] | None]]:
        """Verify every sequence of the step: (drafts accepted, the target's token after them) each.

        logits: [sum(k_i + 1), V], sequence i's k_i + 1 rows in order (row j scores draft j, row k_i the bonus):
        the layout StepBatch names. Each row is processed with its sequence's parameters (_processed_rows: its
        penalties, then temperature, top-k, top-p and min-p for all sampled rows of the step in one pass); then
        verify.py's rules: greedy sequences match the argmax (one argmax over the whole step) and seeded ones the
        argmax of their noise-keyed scores, all in one verify.greedy_accept over the batch; the others are
        rejection sampled with their own generator. A sequence with a token tree is verified by verify_tree's
        rules of its kind (greedy, seeded, recursive rejection sampling). The results come back to the host in one
        read: per sequence (drafts accepted, the target's token after them), and the accepted nodes of a tree
        (None for a chain)."""
        batch = StepBatch.build(drafts, [proposal.probs for proposal in proposals],
                                [proposal.tree for proposal in proposals])
        processed = self._processed_rows(seqs, logits, batch)  # [num_rows, V]: logits (greedy) or probabilities
        vocab = processed.shape[-1]
        prefetch_log_noise([(seq, len(seq.output_ids), (batch.num_draft_tokens[i] if batch.trees[i] is None else
                                                         batch.trees[i].max_depth) + 1)
                            for i, seq in enumerate(seqs) if not seq.params.greedy and seq.noise_key is not None], vocab)
        tree_verdicts = {i: self._verify_tree(seq, batch, processed, i) for i, seq in enumerate(seqs)
                         if batch.trees[i] is not None}  # [N_i + 1] on the device: accepted mask, then the token
        relaxed = self.relaxed_threshold
        matched = [seq.params.greedy or seq.noise_key is not None for seq in seqs]
        seeded_rows, seeded_draws = [], []  # seeded sequences' rows and the target's own draws there
        passes = []  # per sequence [k_i]: the LOSSY relaxed test's results (relaxed acceptance only)
        pairs = []  # per rejection-sampled sequence, on the device: (accepted, token)
        for i, (seq, is_matched) in enumerate(zip(seqs, matched)):
            if i in tree_verdicts:
                continue
            (lo, hi), draft, q = batch.rows(i), batch.drafts(i), batch.draft_probs[i]
            k = hi - lo - 1
            q = None if q is None else q[None]
            if not is_matched:
                accepted, token = verify.rejection_sample(processed[lo:hi][None], q, draft[None], seq.generator,
                                                          relaxed)
                pairs.append(torch.stack([accepted[0], token[0]]))
            elif not seq.params.greedy:
                scores = sampling.scores_with_log_noise(processed[lo:hi], seq.log_noise(len(seq.output_ids), hi - lo,
                                                                                        vocab))
                seeded_rows.extend(range(lo, hi))
                seeded_draws.append(scores.argmax(-1))  # [k_i + 1]: the target's own draws at these positions
            if relaxed is not None:  # LOSSY: see SpeculativeConfig.acceptance
                if not is_matched or k == 0:  # rejection sampling took its own relaxed test
                    passes.append(torch.zeros(k, dtype=torch.bool, device=processed.device))
                elif seq.params.greedy:  # p(x) >= threshold * the target's top probability
                    passes.append(verify.relaxed_greedy_accepts(processed[lo:lo + k][None], draft[None], relaxed)[0])
                else:
                    passes.append(verify.relaxed_accepts(processed[lo:lo + k][None], q, draft[None], relaxed)[0])
        on_device = []
        if any(matched):
            # Greedy matching of the target's tokens (argmax, or its seeded draws) over the whole batch; the rows
            # of rejection-sampled sequences take part but their results are not read.
            target_tokens = sampling.argmax_rows(processed)  # [num_rows]
            if seeded_draws:
                target_tokens = target_tokens.index_copy(
                    0, torch.tensor(seeded_rows, device=processed.device), torch.cat(seeded_draws))
            on_device.extend(verify.greedy_accept(target_tokens, batch.draft_token_ids, batch.num_draft_tokens,
                                                  torch.cat(passes) if relaxed is not None else None))
        values = torch.cat([t.reshape(-1).to(torch.long)
                            for t in on_device + pairs + list(tree_verdicts.values())]).tolist()  # the one host sync
        size = len(seqs) if on_device else 0
        rest = iter(values[2 * size:])
        results: list[tuple[int, int]] = []
        for i, is_matched in enumerate(matched):  # pairs in sequence order, then the trees'
            if i in tree_verdicts:
                results.append((0, 0))
            elif is_matched:
                results.append((values[i], values[size + i]))
            else:
                results.append((next(rest), next(rest)))
        paths: list[list[int] | None] = [None] * len(seqs)
        for i in tree_verdicts:
            mask = [next(rest) for _ in range(batch.num_draft_tokens[i])]
            paths[i] = [j for j, taken in enumerate(mask) if taken]  # parents first: path order
            results[i] = (len(paths[i]), next(rest))
        return results, paths

    @staticmethod
    def _verify_tree(seq: Sequence, batch: StepBatch, processed: torch.Tensor, i: int) -> torch.Tensor:
        """Sequence i's token tree verified by the exact rule of its kind (verify_tree): [N + 1] long on the device,
        the accepted nodes' mask then the token after the path."""
        (lo, hi), tree = batch.rows(i), batch.trees[i].to(processed.device)
        rows = processed[lo:hi]  # [N + 1, V]: processed logits (greedy) or probabilities
        if seq.params.greedy:
            verdict = verify_tree.tree_greedy_accept(tree, rows)
        elif seq.noise_key is not None:
            log_noise = seq.log_noise(len(seq.output_ids), tree.max_depth + 1, rows.shape[-1])
            verdict = verify_tree.tree_seeded_accept(tree, rows, log_noise.to(rows.device))
        else:
            verdict = verify_tree.tree_rejection_sample(tree, rows, batch.draft_probs[i], seq.generator)
        return torch.cat([verdict.accepted.long(), verdict.next_token.reshape(1).long()])

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
            self.proposer.release(seq)

"""How much a step drafts: adaptive K, token-tree sizing and calibration, from what the engine measures.

`SpeculationPolicy` holds everything the engine learns while it runs (adaptive.py has the formulas): the step
costs of one sequence by k (per draft kind), the batch's costs by rows, each draft kind's acceptance prior, and
how a tree proposer's node scores compare with what verification accepts (per kind and per part of a tree). The
engine asks it each step for every sequence's draft length (`choose_ks`: a request's own cap, then the k that
maximises expected tokens per second), for the token trees' budgets and which candidate nodes to keep
(`tree_budgets`, `size_trees`), and tells it afterwards what the step cost and accepted (`record_step`,
`record_sequence`). A draft that cannot pay shows it here: its acceptance and its measured cost make K = 0 the
best choice, and the request decodes plainly until a probe finds its text turned easy.
"""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft import adaptive
from quickdraft.drafts.base import Proposal, Proposer, TreeBudget, TreeSettings
from quickdraft.sequence import Sequence

__all__ = ["SpeculationPolicy", "StepTiming"]


@dataclass(frozen=True)
class StepTiming:
    """One step's clock: drafting (t0 -> t1), the target's forward (t1 -> t2), verification (t2 -> t3)."""

    t0: float
    t1: float
    t2: float
    t3: float


def cost_kind(kind: str) -> str:
    """The kind whose step costs drafts of `kind` share: a class of a kind ("lookup:1") costs what the kind does
    (Proposer.draft_kind)."""
    return kind.partition(":")[0]


def _any_model(kinds: list[str]) -> bool:
    """Whether any of the step's drafts runs a draft model (its batch costs differ: BatchCosts)."""
    return any(cost_kind(kind) == "model" for kind in kinds)


def _plain_rows(seqs: list[Sequence]) -> int:
    """The rows a step verifies without drafts: each sequence's unread tokens (its last one, or a prompt)."""
    return sum(max(1, len(seq.token_ids) - len(seq.target_cache)) for seq in seqs)


class SpeculationPolicy:
    """Adaptive K and tree sizing for one engine (its target, proposer and K)."""

    def __init__(self, proposer: Proposer, k: int, adaptive_k: bool, tree: TreeSettings | None, max_len: int):
        self.proposer = proposer
        self.k = k
        self.tree = tree
        self.auto_tree = tree is not None and tree.auto
        self.adaptive_k = (adaptive_k and k > 0) or self.auto_tree
        self.max_len = max_len
        self.step_costs = adaptive.StepCosts(k)  # one sequence alone, by k
        # ... per draft kind after the first (Proposer.draft_kind): lookup steps cost no draft forwards
        self._step_costs_by_kind: dict[str, adaptive.StepCosts] = {}
        self.batch_costs = adaptive.BatchCosts()  # any batch, by rows
        # Per draft kind and part of a tree ("chain": its first-child path, "branch": its other nodes; "tree": "auto")
        self.tree_calibration: dict[tuple[str, str], adaptive.TreeCalibration] = {}
        self._acceptance_priors: dict[str, adaptive.AcceptancePrior] = {}  # per draft kind (acceptance_prior)
        # Seconds one-sequence probes may still spend: PROBE_BUDGET of every plain step chosen alone, less each probe's
        # cost (its draft model's catch-up included). Engine-wide, not per request: a draft model's probe can cost
        # more than one short request's plain steps earn, and the engine's prior must still learn from some.
        self.probe_credit = 0.0
        self.output_lengths = adaptive.OutputLengths()  # what recent requests generated (a catch-up's earning time)

    # --- what the engine has learned ------------------------------------------------------------------------
    def step_costs_of(self, kind: str) -> adaptive.StepCosts:
        """The one-sequence step costs of drafts of `kind` (the first kind's are self.step_costs): those of its
        cost_kind."""
        kind = cost_kind(kind)
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

    def acceptance(self, seq: Sequence, kind: str) -> adaptive.AcceptanceStats:
        """seq's acceptance estimates for drafts of `kind`, starting from (and feeding) the engine's prior."""
        return seq.acceptance_for(kind, self.acceptance_prior(kind))

    def calibration(self, kind: str, part: str) -> adaptive.TreeCalibration:
        """How the draft's tree scores of `kind` compare with what verification accepts, learned per kind and per
        part of the tree: "chain" (the first-child path) and "branch" (every other node). Apart because they
        differ: a sampled tree's chain is the draft's draws, accepted with sum min(p, q) whatever their score,
        and its branches are tried against what the draw left (the residual)."""
        if (kind, part) not in self.tree_calibration:
            self.tree_calibration[kind, part] = adaptive.TreeCalibration()
        return self.tree_calibration[kind, part]

    # --- each step's choices --------------------------------------------------------------------------------
    def cap_k(self, seq: Sequence) -> int:
        """The most drafts `seq` may take this step: the engine's K, the request's own cap
        (SamplingParams.num_speculative_tokens; 0 turns speculation off for it), what max_tokens, the context and
        the proposer leave room for; 0 while the prompt is still to be read."""
        history = seq.token_ids
        if len(history) - len(seq.target_cache) > 1:
            # The prompt goes through the target with no drafts after it, as in plain decoding: its cached keys
            # must not depend on whether drafts followed.
            return 0
        own = seq.params.num_speculative_tokens
        cap = self.k if own is None else min(self.k, own)
        if cap == 0:
            return 0
        remaining = seq.params.max_tokens - len(seq.output_ids)
        return max(0, min(cap, remaining - 1, self.max_len - len(history), self.proposer.max_draft_tokens(seq)))

    def choose_ks(self, seqs: list[Sequence], kinds: list[str]) -> list[int]:
        """Each sequence's draft length this step: its cap when K is fixed; adaptive, the k that maximises
        expected tokens per second, for one sequence from its step costs by k, for a batch from the batch's
        costs by rows (batch-aware: as verification competes for compute, drafting stops where it no longer
        pays)."""
        caps = [self.cap_k(seq) for seq in seqs]
        if not self.adaptive_k or not any(caps):
            return caps
        if len(seqs) == 1:
            seq, kind = seqs[0], kinds[0]
            costs, stats = self.step_costs_of(kind), self.acceptance(seq, kind)
            # A model draft that has not read the prompt (or what it missed at K = 0) reads it first: priced.
            unread = self.proposer.unread_history(seq) if cost_kind(kind) == "model" else 0
            catch_up_s = unread * costs.catch_up_per_token()
            # What it may still generate spreads a catch-up; nothing to read, nothing to spread (not read then).
            remaining = self.output_lengths.expected_remaining(len(seq.output_ids), seq.params.max_tokens) \
                if catch_up_s > 0 else None
            k = adaptive.choose_k(stats, costs, caps[0], catch_up_s, remaining, self.probe_credit)
            if k == 0:
                self.probe_credit += adaptive.PROBE_BUDGET * (costs.estimate(0) or 0.0)
            elif stats.due_for_probe:  # a probe (or a request due for one drafting by choice: charged alike)
                self.probe_credit -= adaptive.probe_seconds(costs, catch_up_s)
            return [k]
        base_rows = _plain_rows(seqs)
        return adaptive.choose_batch_k([self.acceptance(seq, kind) for seq, kind in zip(seqs, kinds)], caps,
                                       base_rows, self.batch_costs, _any_model(kinds))

    def tree_budgets(self, seqs: list[Sequence], ks: list[int], kinds: list[str]) -> list[TreeBudget | None]:
        """The token tree each sequence may take this step (None: a chain step): depth up to its k (the step's
        draft cap) and the tree settings' max_depth, nodes up to max_nodes and the slots left in the context.
        "auto": a node beyond the most probable path must be worth its row (min_chance, in the draft's own
        probabilities: the calibrated chance over the calibration factor)."""
        row_worth = self._row_worth(seqs, ks, kinds) if self.auto_tree else 0.0
        budgets: list[TreeBudget | None] = []
        for seq, k, kind in zip(seqs, ks, kinds):
            max_nodes = min(self.tree.max_nodes, self.max_len - len(seq.token_ids))
            max_depth = min(self.tree.max_depth, k, max_nodes)
            if k == 0 or seq.grammar is not None or max_depth <= 0:
                budgets.append(None)
                continue
            min_chance = 0.0
            if row_worth > 0:
                expected = self.acceptance(seq, kind).expected_tokens(max_depth)
                min_chance = min(1.0, expected * row_worth / max(self.calibration(kind, "branch").factor, 1e-6))
            budgets.append(TreeBudget(max_nodes, max_depth, min_chance))
        return budgets

    def _row_worth(self, seqs: list[Sequence], ks: list[int], kinds: list[str]) -> float:
        """"auto": what one more verification row costs, as a share of the step's time (the measured target
        cost by rows and the draft's), at the rows the chosen depths give; 0 while unmeasured. A node is worth
        its row where its chance of being on the accepted path is above the step's expected tokens times this."""
        plain = _plain_rows(seqs)
        rows = plain + sum(ks)
        costs = self.batch_costs
        step = costs.step_seconds(rows, max(ks, default=0), sum(k > 0 for k in ks), _any_model(kinds), plain)
        now, more = costs.target_seconds(rows, plain), costs.target_seconds(rows + 1, plain)
        if step is None or now is None or more is None or step <= 0:
            return 0.0
        return max(0.0, more - now) / step

    def size_trees(self, seqs: list[Sequence], kinds: list[str], proposals: list[Proposal]) -> list[Proposal]:
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
        plain_rows = _plain_rows(seqs)
        base_rows = plain_rows + sum(int(p.tokens.numel()) for i, p in enumerate(proposals) if i not in sized)
        chances, orders, chains, base_tokens = [], [], [], 0.0
        for i in sized:
            raw = proposals[i].scores.float().cpu()
            chain = proposals[i].tree.first_child_path()
            in_chain = set(chain)
            scores = (raw * self.calibration(kinds[i], "branch").factor).clamp(max=1.0).tolist()
            order = sorted((j for j in range(len(scores)) if j not in in_chain), key=lambda j: (-scores[j], j))
            chances.append([scores[j] for j in order])  # parents first among equals
            orders.append(order)
            chains.append(chain)
            base_rows += len(chain)
            base_tokens += float((raw[chain] * self.calibration(kinds[i], "chain").factor).clamp(max=1.0).sum())
        counts = adaptive.choose_tree_nodes(chances, base_rows, self.batch_costs, base_tokens, plain_rows)
        out = list(proposals)
        for i, order, chain, count in zip(sized, orders, chains, counts):
            if len(chain) + count < int(proposals[i].tokens.numel()):
                out[i] = proposals[i].pruned(sorted(chain + order[:count]))
        return out

    # --- what a step showed ---------------------------------------------------------------------------------
    def record_step(self, rows: int, ks: list[int], timing: StepTiming, draft_forwards: int, caught_up: bool) -> None:
        """The batch's costs (adaptive K): the target's forward and verification over `rows`, the drafting (not where
        a draft model caught up on history it had missed: a one-off cost)."""
        self.batch_costs.record(rows, timing.t3 - timing.t1, sum(k > 0 for k in ks), draft_forwards,
                                None if caught_up else timing.t1 - timing.t0, sum(ks))

    def record_finished(self, seq: Sequence) -> None:
        """seq ended in a step (its end of text, or max_tokens): how long it ran (OutputLengths)."""
        self.output_lengths.record(len(seq.output_ids), seq.finish_reason == "length")

    def record_sequence(self, seq: Sequence, kind: str, k: int, chosen: int, num_accepted: int,
                        proposal: Proposal, nodes: list[int], alone: bool, read_history: bool, timing: StepTiming,
                        now: float) -> None:
        """One sequence's step: its acceptance (a tree's per depth: depth d was judged when the path reached
        d - 1, a chain of its depth; the kind's engine-wide prior is fed the same way), a tree's calibration, and
        where it ran alone its step's cost by the k asked for (chosen). read_history: the target read more than
        the last token (a prompt), which no later step does."""
        tree = proposal.tree
        if tree is not None and proposal.scores is not None:  # how the proposer's chances compare with what passed
            chain = tree.first_child_path()
            scores = proposal.scores.float().cpu()
            on_chain = float(scores[chain].sum()) if chain else 0.0
            accepted_on_chain = sum(1 for a, b in zip(nodes, chain) if a == b)  # the path's first nodes
            self.calibration(kind, "chain").update(on_chain, accepted_on_chain)
            self.calibration(kind, "branch").update(float(scores.sum()) - on_chain, num_accepted - accepted_on_chain)
        if not self.adaptive_k:
            return
        self.acceptance(seq, kind).update(k if tree is None else tree.max_depth, num_accepted)
        if not alone:  # batched steps are not timed per k: their cost depends on the batch
            return
        # A step like every later one (no prompt, no draft catch-up), alone in its batch: its time is the cost of
        # drafting k (a tree: of the depth asked for, "auto"'s choice).
        if not proposal.catch_up and not read_history:
            self.step_costs_of(kind).record(k if tree is None else chosen, now - timing.t0, timing.t1 - timing.t0)
        elif proposal.catch_up and k > 0 and tree is None:
            self.step_costs_of(kind).record_catch_up(k, proposal.catch_up, timing.t1 - timing.t0)

"""Token trees as proposers build them (issue 25; the tree itself: quickdraft/token_tree.py): a lookup's
continuations merged into a trie that keeps the most frequent nodes within a budget, a draft model's candidates
ranked by path probability as it grows them (DynamicTree: EAGLE-2, Li et al. 2024), and the proposal either
becomes: a chain where only one continuation is left (verified as today), else a tree of DETERMINISTIC children
(a function of the context, so q is one-hot and verification stays exact at every temperature) or, for an
unseeded sampled request, of DRAWN_FIRST children (each row's first child the draw from q a chain would make,
verified with q; its siblings ranked)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from quickdraft import sampling

from quickdraft.drafts.base import Proposal
from quickdraft.models.base import TreeAttention
from quickdraft.token_tree import ChildSelection, TokenTree


def deterministic_tree_proposal(tokens: Sequence[int], parents: Sequence[int], chances: Sequence[float],
                                device: torch.device, catch_up: int = 0) -> Proposal:
    """The proposal of a looked-up or ranked tree (tokens and parents in node order, parents[i] < i, -1: a child
    of the root; chances: per node the proposer's estimate that the accepted path passes through it, Proposal.scores):
    nothing for no node, a chain (tree None) for a line, else the TokenTree."""
    if not tokens:
        return Proposal(torch.empty(0, dtype=torch.long, device=device), catch_up=catch_up)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
    if list(parents) == list(range(-1, len(tokens) - 1)):
        return Proposal(ids, catch_up=catch_up)
    return Proposal(ids, catch_up=catch_up, tree=TokenTree.from_parents(ids, parents, ChildSelection.DETERMINISTIC),
                    scores=torch.tensor(list(chances), dtype=torch.float32, device=device))


def frequency_trie(continuations: Sequence[Sequence[int]], max_nodes: int,
                   max_depth: int) -> tuple[list[int], list[int], list[float]]:
    """The trie of `continuations` (most recent first) cut at max_depth tokens, keeping the max_nodes nodes that
    most continuations pass through (ties: the shallower, then the most recent): (tokens, parents, the share of
    the continuations through each node) in an order where a parent comes first and siblings are most frequent
    first. A node's count never exceeds its parent's, so the nodes kept always hang together."""
    count: dict[tuple[int, ...], int] = {}
    first_seen: dict[tuple[int, ...], int] = {}
    for rank, continuation in enumerate(continuations):
        path: tuple[int, ...] = ()
        for token in list(continuation)[:max_depth]:
            path += (int(token),)
            count[path] = count.get(path, 0) + 1
            first_seen.setdefault(path, rank)
    kept = sorted(count, key=lambda p: (-count[p], len(p), first_seen[p]))[:max(max_nodes, 0)]
    ordered = number_nodes(kept, lambda p: p[:-1] if len(p) > 1 else None, len, lambda p: (-count[p], first_seen[p]))
    index = {path: i for i, path in enumerate(ordered)}
    return ([path[-1] for path in ordered], [index[path[:-1]] if len(path) > 1 else -1 for path in ordered],
            [count[path] / len(continuations) for path in ordered])


def number_nodes(kept: Sequence, parent_of, depth_of, sibling_key) -> list:
    """`kept` (nodes closed under parents) in node order: level by level, the children of each parent together
    in parent order, each parent's children by sibling_key (most probable first). parent_of(node) is None
    for a child of the root."""
    position: dict = {}
    ordered: list = []
    by_depth: dict[int, list] = {}
    for node in kept:
        by_depth.setdefault(depth_of(node), []).append(node)
    for depth in sorted(by_depth):
        level = sorted(by_depth[depth], key=lambda n: (-1 if parent_of(n) is None else position[parent_of(n)],
                                                      sibling_key(n)))
        for node in level:
            position[node] = len(ordered)
            ordered.append(node)
    return ordered


# A draft model's dynamic tree (EAGLE-2): each expanded node offers its TREE_TOP_K most probable tokens as
# children, and each level expands at most TREE_WIDTH nodes (one row each of that level's batched draft forward).
TREE_TOP_K = 8
TREE_WIDTH = 4


class DynamicTree:
    """One sequence's EAGLE-2 tree as a draft model grows it level by level (Li et al. 2024): candidate nodes
    scored by the product of the draft's probabilities along their path; each level expands the most probable
    nodes of the deepest level that can still be among the max_nodes best (a node's descendants never score
    above it, so one outside them has none inside); the proposal is the max_nodes best candidates, a tree
    closed under parents. The expanded nodes sit in the draft's cache at slots base, base + 1, ... (the root,
    the last committed token, at base - 1) in expansion order: `attention` is the TreeAttention of a forward
    that writes the current frontier. Host-side bookkeeping only; the caller runs the forwards.

    capacity: the tree slots the draft's cache can hold (no more nodes are expanded). min_chance: a node other
    than its parent's most probable child is a candidate only if its path probability reaches it (TreeBudget's:
    a sibling worth less than the row it costs is neither expanded nor proposed; 0 keeps every node)."""

    def __init__(self, base: int, max_nodes: int, max_depth: int, capacity: int,
                 top_k: int = TREE_TOP_K, width: int = TREE_WIDTH, min_chance: float = 0.0):
        self.base, self.max_nodes, self.max_depth, self.capacity = base, max_nodes, max_depth, capacity
        self.min_logp = math.log(min_chance) if min_chance > 0 else -math.inf
        self.top: list[bool] = []  # whether a node is its parent's most probable child
        self.top_k = max(1, min(top_k, max_nodes))
        # A budget of a chain (max_nodes == max_depth) expands one node a level: a wider level could not be kept.
        self.width = max(1, min(width, max_nodes - max_depth + 1))
        self.tokens: list[int] = []
        self.parents: list[int] = []  # the parent node, -1: the root
        self.depth: list[int] = []
        self.logp: list[float] = []  # log of the path's probability
        self.slot: dict[int, int] = {}  # expanded node -> its tree slot (0: base)
        self.slot_parents: list[int] = []  # per tree slot, its parent's cache slot (TreeAttention.parents)
        self.frontier: list[int] = []  # the nodes the next forward writes
        # Per node whose first child was DRAWN from the draft's q (-1: the root), that q [V_target]: every row of an
        # unseeded sampled request (rank_children), none of a greedy or seeded one (their children are ranked).
        self.drawn_from: dict[int, torch.Tensor] = {}

    def _key(self, node: int) -> tuple[float, int, int]:
        return -self.logp[node], self.depth[node], node  # a parent before a child of equal probability

    def best(self) -> list[int]:
        """The max_nodes best candidates (closed under parents): by path probability, each a most probable child
        or at least min_chance, under a kept parent."""
        kept: list[int] = []
        taken: set[int] = set()
        for node in sorted(range(len(self.tokens)), key=self._key):  # a parent before its children
            if len(kept) == self.max_nodes:
                break
            parent = self.parents[node]
            if (parent < 0 or parent in taken) and (self.top[node] or self.logp[node] >= self.min_logp):
                kept.append(node)
                taken.add(node)
        return kept

    def add_children(self, node: int, probs: torch.Tensor) -> None:
        """The top_k tokens of `probs` [V] (the draft's probabilities after `node`'s path; -1: the root) that have
        any probability, as candidate children of node."""
        values, ids = torch.topk(probs.double(), min(self.top_k, probs.shape[-1]))
        self.add_top_children(node, values, ids)

    def add_top_children(self, node: int, values: torch.Tensor, ids: torch.Tensor,
                         drawn_from: torch.Tensor | None = None) -> None:
        """add_children from the row's top tokens already picked: ids [k] and their probabilities [k], most
        probable first (rank_children picks them for all its rows in one call). drawn_from: the q [V_target] that
        ids[0] was DRAWN from (the others then rank q's tokens besides it; values[0] is the draw's score, at least
        every sibling's so that it stays first); None: ids are ranked."""
        if node >= 0 and self.depth[node] >= self.max_depth:
            return
        if drawn_from is not None:
            self.drawn_from[node] = drawn_from
        base_logp = self.logp[node] if node >= 0 else 0.0
        depth = self.depth[node] + 1 if node >= 0 else 1
        for rank, (value, token) in enumerate(zip(values.tolist(), ids.tolist())):
            if value <= 0.0:
                break
            self.top.append(rank == 0)
            self.tokens.append(int(token))
            self.parents.append(node)
            self.depth.append(depth)
            self.logp.append(base_logp + math.log(value))

    def next_frontier(self, depth: int) -> list[int]:
        """The nodes of `depth` to expand next (at most width, the most probable of those still among the best,
        within the cache's capacity), given tree slots now; [] when none is worth a forward."""
        if depth >= self.max_depth:
            self.frontier = []
            return self.frontier
        best = self.best()
        room = self.capacity - len(self.slot_parents)
        self.frontier = [n for n in best if self.depth[n] == depth][:max(0, min(self.width, room))]
        for node in self.frontier:
            self.slot[node] = len(self.slot_parents)
            parent = self.parents[node]
            self.slot_parents.append(self.base - 1 if parent < 0 else self.base + self.slot[parent])
        return self.frontier

    def top_path_slots(self) -> list[int]:
        """The tree slots (0: base) of the expanded nodes along the most probable children from the root down:
        the path a draft cache keeps after the tree (ascending: a child is expanded after its parent)."""
        slots, node = [], -1
        while True:
            child = next((n for n in self.slot if self.parents[n] == node and self.top[n]), None)
            if child is None:
                return slots
            slots.append(self.slot[child])
            node = child

    def path(self, node: int) -> list[int]:
        """The tokens from the root's child down to node."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def attention(self) -> TreeAttention:
        """How the forward that writes the frontier attends: every tree slot so far, parents by slot."""
        return TreeAttention(self.base, tuple(self.slot_parents))

    def proposal_order(self) -> list[int]:
        """The max_nodes best candidates in node order, siblings most probable first (a drawn child first)."""
        return number_nodes(self.best(), lambda n: None if self.parents[n] < 0 else self.parents[n],
                            lambda n: self.depth[n], self._key)

    def proposal_nodes(self, ordered: list[int] | None = None) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, path probabilities) of proposal_order's nodes (`ordered`, where already computed)."""
        ordered = self.proposal_order() if ordered is None else ordered
        index = {node: i for i, node in enumerate(ordered)}
        return ([self.tokens[n] for n in ordered], [index[self.parents[n]] if self.parents[n] >= 0 else -1
                                                    for n in ordered], [math.exp(self.logp[n]) for n in ordered])


def tree_proposal(tree: DynamicTree, device: torch.device, catch_up: int = 0) -> Proposal:
    """A grown DynamicTree's proposal: deterministic_tree_proposal's where its children were ranked; where the
    first child of every row was drawn from q (DRAWN_FIRST), the proposal carries for each node the q of its
    parent's row [N, V_target]: a chain of draws (one child a row) is today's sampled chain, else the tree."""
    ordered = tree.proposal_order()
    tokens, parents, chances = tree.proposal_nodes(ordered)
    if not tree.drawn_from or not ordered:
        return deterministic_tree_proposal(tokens, parents, chances, device, catch_up)
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    q = torch.stack([tree.drawn_from[tree.parents[n]] for n in ordered]).to(device)  # [N, V_target]
    if parents == list(range(-1, len(tokens) - 1)):  # a line: each node its row's draw, verified as a chain
        return Proposal(ids, q, catch_up=catch_up)
    return Proposal(ids, q, catch_up=catch_up, tree=TokenTree.from_parents(ids, parents, ChildSelection.DRAWN_FIRST),
                    scores=torch.tensor(chances, dtype=torch.float32, device=device))


def ranks_on_part(seq) -> bool:
    """Whether a draft scoring part of the vocabulary may rank seq's children on those tokens alone: nothing
    in the request's processing depends on token ids (no penalties, logit bias, grammar or seeded noise), so
    temperature, top-k, top-p and min-p over the part give the full row's result (its other tokens are -inf)."""
    return seq.penalties is None and not seq.params.logit_bias and seq.grammar is None and seq.noise_key is None


def rank_children(seq, tree: DynamicTree, nodes: list[int], logits: torch.Tensor,
                  vocab_ids: torch.Tensor | None = None, target_vocab: int = 0) -> None:
    """Rank the children of `nodes` (-1: the root) of a draft's DynamicTree from its logits after each
    [len(nodes), V_target] (-inf for tokens it cannot propose), or [len(nodes), V'] over the tokens vocab_ids
    [V'] (a draft of part of the vocabulary; only where ranks_on_part(seq)):
    the draft's processed distribution (softmax of the penalised logits for a greedy request); for a seeded
    request the softmax of the noise-coupled scores its draw at that position maximises. An unseeded sampled
    request's first child a row is instead a draw from q, as its chain's draft token is, and the others q's most
    probable tokens besides it (ChildSelection.DRAWN_FIRST: the tree verifies at least the chain's path)."""
    if vocab_ids is not None and not ranks_on_part(seq):
        raise ValueError("rank_children: this request's processing reads token ids; pass full-vocabulary logits")
    if vocab_ids is not None and target_vocab < vocab_ids.numel():
        raise ValueError(f"rank_children: logits over part of the vocabulary need the target's vocabulary size "
                         f"(target_vocab, got {target_vocab}) for the q its drawn children are verified with")
    logits = logits.to(seq.device)
    paths = [tree.path(n) for n in nodes]
    if seq.penalties is None:  # rows do not depend on their paths: one call
        processed = seq.process(logits, torch.empty(0, dtype=torch.long, device=seq.device))
    else:
        processed = torch.cat([seq.process(logits[i:i + 1], torch.tensor(path, dtype=torch.long, device=seq.device),
                                           first_row=len(path)) for i, path in enumerate(paths)])
    # Only each row's top_k children are kept: they are picked on the row as it is (float32; the softmax keeps
    # the order) and only theirs are made probabilities, exp(x - logsumexp(row)), in float64 from there. Why:
    # a softmax in float64 over the whole vocabulary a row, and its top-k, were ~5 ms of a 4-level tree's step
    # on the Qwen pair's 151,936 tokens (profiled: a chain-shaped tree drafted ~10 ms a step slower than the chain).
    k = min(tree.top_k, processed.shape[-1])
    if seq.params.greedy:
        scores = processed.float()
    elif seq.noise_key is not None:  # the frontier is one depth: one output position's noise
        log_noise = seq.log_noise(len(seq.output_ids) + len(paths[0]), 1, processed.shape[-1])
        scores = sampling.scores_with_log_noise(processed, log_noise).float()
    else:  # the draft's probabilities already
        scores = None
    drawn_from: list[torch.Tensor | None] = [None] * len(nodes)
    if scores is None:  # unseeded sampling: the first child is a draw from q (the chain's), then q's best others
        q = processed.float()  # [rows, V] the draft's probabilities
        drawn = sampling.draw(q, seq.generator).tolist()  # [rows]
        top, top_ids = (t.tolist() for t in sampling.top_k_rows(q, k))
        # The draw's score is the row's top probability (a node's chance, what the tree ranks and sizes by):
        # a draw from q is accepted about as often as the top token, and it must stay its siblings' first.
        # Its siblings: the row's top k without it, k - 1 of them.
        rows = [([x] + [t for t in row_ids if t != x][:k - 1], [values[0]] + [v for v, t in zip(values, row_ids)
                                                                             if t != x][:k - 1])
                for x, values, row_ids in zip(drawn, top, top_ids)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        probs = torch.tensor([r[1] for r in rows], dtype=torch.float64)
        if vocab_ids is None:
            drawn_from = list(q)
        else:
            full = q.new_zeros(len(nodes), target_vocab)
            full[:, vocab_ids.to(q.device)] = q
            drawn_from = list(full)
    else:
        top, ids, lse = sampling.top_k_rows(scores, k, with_logsumexp=True)
        probs = (top.double() - lse.double()[:, None]).exp()
    if vocab_ids is not None:
        ids = vocab_ids.to(ids.device)[ids]
    for node, row, row_ids, q_row in zip(nodes, probs, ids, drawn_from):
        tree.add_top_children(node, row, row_ids, q_row)


def grow_trees(seqs, trees: dict[int, DynamicTree], root_logits: torch.Tensor, levels: int, forward_level,
               vocab_ids: torch.Tensor | None = None, target_vocab: int = 0) -> None:
    """Grow each sequence's DynamicTree level by level (EAGLE-2): rank the root's children from root_logits
    [len(trees), V_target] (a row per tree, in the dict's order), then for each level below `levels` let every
    tree that has nodes worth expanding pick its frontier, run forward_level(rows) (ONE draft forward writing the
    frontiers of trees[j], j in rows, in that order; it returns their logits [sum of frontiers, V_target]) and
    rank the frontier's children. seqs[j] is the sequence of trees[j]. vocab_ids: the logits are over these
    tokens [V'] instead, of a target vocabulary of target_vocab tokens (rank_children)."""
    for row, j in enumerate(trees):
        rank_children(seqs[j], trees[j], [-1], root_logits[row:row + 1], vocab_ids, target_vocab)
    for level in range(1, levels):
        rows = [j for j in trees if trees[j].next_frontier(level)]
        if not rows:
            break
        logits, offset = forward_level(rows), 0
        for j in rows:
            count = len(trees[j].frontier)
            rank_children(seqs[j], trees[j], trees[j].frontier, logits[offset:offset + count], vocab_ids,
                          target_vocab)
            offset += count

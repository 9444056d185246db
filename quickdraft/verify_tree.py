"""Exact verification of a token tree (quickdraft.token_tree) in one target forward, at every temperature.

Rows: the target's output row r (0 = the root, the last committed token; i + 1 = node i) is the distribution
of the token after row r's input, so node i is scored by row tree.parent_rows[i] and the token after an
accepted path ending at node j comes from row j + 1 (a chain: verify's convention, row i scores draft i).

Three kinds of request, as verify.py has them:
- greedy (tree_greedy_accept): the deepest node whose every path token equals the target's argmax at its
  parent's row, then the argmax at that node's row.
- seeded (tree_seeded_accept): the same with the target's own noise-keyed draws (sampling.scores_with_log_noise
  of the position's noise, keyed by output position = committed length + row depth). The emitted tokens are
  the tokens plain seeded decoding draws, whatever the tree: at each depth the target's draw at the reached
  row is the draw plain decoding makes at that position, and the walk goes on only while a child equals it.
- sampled without a seed (tree_rejection_sample): recursive rejection sampling over each node's children
  with the rule exact for how they were chosen (tree_acceptance has the rules and their derivation).

Pure tensor functions with no host synchronisation; tensors carry leading batch dimensions [...] (trees of one
shape; one tree has none). match_trees applies the greedy and seeded rule to the trees of a whole step at once,
over their flattened nodes. The caller reads the verdict once per step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quickdraft.sampling import argmax_rows, draw, scores_with_log_noise
from quickdraft.token_tree import ChildSelection, TokenTree


class TreeVerdict(NamedTuple):
    """accepted: [..., N] bool, the accepted root path (ancestors first in node order, so nonzero() is path
    order); last_row: [...] long, the row of the last accepted node (0: none accepted), the row the next token
    came from; next_token: [...] long, the token emitted after the path (correction or bonus)."""

    accepted: torch.Tensor  # [..., N]
    last_row: torch.Tensor  # [...]
    next_token: torch.Tensor  # [...]

    @property
    def num_accepted(self) -> torch.Tensor:
        """[...] long: accepted draft tokens (the path's length; the step emits one more)."""
        return self.accepted.sum(-1)


class TreeAcceptance(NamedTuple):
    """accept_probs: [..., N], the probability that node i is accepted given that its parent was reached and
    every earlier sibling rejected; residuals: [..., N + 1, V], the distribution the next token is drawn from at
    each row once every child of that row is rejected (the target's p at a row without children)."""

    accept_probs: torch.Tensor  # [..., N]
    residuals: torch.Tensor  # [..., N + 1, V]


def _deepest_full_path(tree: TokenTree, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The deepest node whose whole root path is `ok` [..., N] (ties: the first), as (path mask [..., N], its
    row [...], 0 when no child of the root is ok)."""
    n = tree.num_nodes
    batch = ok.shape[:-1]
    if n == 0:
        return ok.new_zeros(*batch, 0), torch.zeros(batch, dtype=torch.long, device=ok.device)
    full = ~(tree.ancestors & ~ok[..., None, :]).any(-1)  # [..., N]: the node and all its ancestors are ok
    order = torch.arange(n, device=ok.device)
    score = torch.where(full, tree.depth * (n + 1) + (n - order), 0)  # deeper first, then the earlier index
    best, node = score.max(-1)
    found = best > 0
    return tree.ancestors[node] & found[..., None], torch.where(found, node + 1, 0)


def _match(tree: TokenTree, target_tokens: torch.Tensor) -> TreeVerdict:
    """Greedy matching of the target's tokens at each row [..., N + 1]."""
    scored = target_tokens.index_select(-1, tree.parent_rows)  # [..., N]: the target's token at each parent
    accepted, last_row = _deepest_full_path(tree, tree.tokens == scored)
    next_token = target_tokens.gather(-1, last_row[..., None]).squeeze(-1)
    return TreeVerdict(accepted, last_row, next_token)


def _check_rows(tree: TokenTree, rows: torch.Tensor, what: str) -> None:
    if rows.shape[-2] != tree.num_rows:
        raise ValueError(f"{what} has {rows.shape[-2]} rows; a tree of {tree.num_nodes} nodes needs "
                         f"{tree.num_rows} (the root's row, then one per node)")


class FlatTreeVerdict(NamedTuple):
    """The verdicts of several trees over their flattened nodes (tree t's nodes after tree t - 1's): accepted
    [sum N_t] bool (each tree's accepted root path); num_accepted, last_row and next_token [T] long per tree
    (last_row within the tree's own rows, 0: none accepted)."""

    accepted: torch.Tensor
    num_accepted: torch.Tensor
    last_row: torch.Tensor
    next_token: torch.Tensor


def match_trees(trees: list[TokenTree], row_starts: list[int], target_tokens: torch.Tensor) -> FlatTreeVerdict:
    """Greedy matching of the target's tokens [num_rows] (argmax, or seeded draws) for every tree of a step at
    once: tree t's rows start at row_starts[t] (its root's, then one per node). The rule of _match per tree, over
    the flattened nodes: a node is ok where its token is the target's at its parent's row; the deepest node whose
    whole path is ok wins (ties: the first), through one block-diagonal ancestor matrix."""
    device = target_tokens.device
    largest = max(tree.num_nodes for tree in trees)
    parent_rows, depth, local, owner, offsets = [], [], [], [], []
    for t, (tree, start) in enumerate(zip(trees, row_starts)):
        offsets.append(len(local))
        parent_rows += [start + parent + 1 for parent in tree.parent_list]
        depth += tree.depth_list
        local += range(tree.num_nodes)
        owner += [t] * tree.num_nodes
    host = torch.tensor([parent_rows, depth, local, owner], dtype=torch.long).to(device)
    parent_rows_t, depth_t, local_t, owner_t = host
    starts = torch.tensor([row_starts, offsets], dtype=torch.long).to(device)
    tokens = torch.cat([tree.tokens.reshape(-1) for tree in trees]).to(device)
    ancestors = torch.block_diag(*[tree.ancestors for tree in trees]).to(device)  # [D, D]
    ok = target_tokens[parent_rows_t] == tokens
    full = ~(ancestors & ~ok[None, :]).any(-1)  # the node and every ancestor of it are ok
    score = torch.where(full, depth_t * (largest + 1) + (largest - local_t), 0)  # deeper first, then earlier
    best = torch.zeros(len(trees), dtype=torch.long, device=device).scatter_reduce(0, owner_t, score, "amax")
    found = best > 0
    best_local = torch.where(found, largest - best % (largest + 1), 0)
    accepted = (ancestors[starts[1] + best_local] & found[:, None]).any(0)
    last_row = torch.where(found, best_local + 1, 0)
    return FlatTreeVerdict(accepted, best // (largest + 1), last_row, target_tokens[starts[0] + last_row])


def tree_greedy_accept(tree: TokenTree, target_logits: torch.Tensor) -> TreeVerdict:
    """Greedy: the longest root path of argmax matches, then the argmax after it.

    target_logits: [..., N + 1, V] (processed, e.g. penalised, per row with its own path's history)."""
    _check_rows(tree, target_logits, "target_logits")
    return _match(tree, argmax_rows(target_logits))


def tree_seeded_accept(tree: TokenTree, target_probs: torch.Tensor, log_noise: torch.Tensor) -> TreeVerdict:
    """Seeded sampling: greedy matching of the target's own draws, each row drawn with the noise of the output
    position it predicts, so the text is plain seeded decoding's, tree on or off.

    target_probs: [..., N + 1, V] processed probabilities; log_noise: [..., D + 1, V], log E of output positions
    committed .. committed + D (Sequence.log_noise(len(output_ids), D + 1, V)), D >= tree.max_depth."""
    _check_rows(tree, target_probs, "target_probs")
    if log_noise.shape[-2] < tree.max_depth + 1:
        raise ValueError(f"log_noise has {log_noise.shape[-2]} positions; a tree of depth {tree.max_depth} "
                         f"draws at {tree.max_depth + 1} (the root's and one per depth)")
    noise = log_noise.index_select(-2, tree.row_depths)  # [..., N + 1, V]: each row its position's noise
    return _match(tree, scores_with_log_noise(target_probs, noise).argmax(-1))


def _next_residual(residual: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """max(0, r - q) renormalised: what the next sibling (or the final draw) is verified against after a child
    drawn from q was rejected. When it is empty the rejection had probability zero; r is kept so the result
    stays a distribution (verify.residual_probs' convention)."""
    residual_mass = (residual - proposal).clamp_min(0.0)
    total = residual_mass.sum(-1, keepdim=True)
    return torch.where(total > 0, residual_mass / total.clamp_min(torch.finfo(residual.dtype).tiny), residual)


def tree_acceptance(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> TreeAcceptance:
    """Recursive rejection sampling's acceptance probabilities and residuals for every node and row.

    target_probs: [..., N + 1, V] processed target probabilities (row r: after row r's path); draft_probs:
    [..., N, V], for node i the draft's processed distribution at its parent's context (the same row for every
    sibling, before any removal; unused for DETERMINISTIC children and DRAWN_FIRST's later siblings, and may be
    None when all children are DETERMINISTIC).

    The rule at a row with children x_1..x_k tried in order: r_0 = p; child j is accepted with probability
    min(1, r_{j-1}(x_j) / q_j(x_j)); if rejected, r_j = max(0, r_{j-1} - q_j) renormalised; if all are rejected
    the next token is drawn from r_k. Here q_j must be the law of x_j given everything the verifier has seen
    (the context and x_1..x_{j-1}): then by the one-draft lemma (Leviathan et al. 2023, Chen et al. 2023), the
    token this row emits from step j on is distributed as r_{j-1}: P(y) = min(r, q_j)(y) + (1 - sum min(r, q_j))
    * norm(r - q_j)+(y) = r(y); by induction from j = k down to 1 it is r_0 = p. So q_j is, by mode:
    - IID (with replacement): q_j = q. SpecInfer's multi-step speculative sampling (Miao et al. 2024) and the
      recursive form of SpecTr's k-sequential selection (Sun et al. 2023). A repeated token is its own trial:
      its acceptance is then 0 (r_{j-1}(x) = 0 after x was rejected) but its residual step still counts.
    - WITHOUT_REPLACEMENT: q_j = q with x_1..x_{j-1} removed and renormalised, the law of the j-th draw of
      sampling without replacement (the recursive rejection sampling of Recursive Speculative Decoding, Jeon et
      al. 2024, arXiv:2402.14160).
    - DETERMINISTIC (top-k by draft probability as EAGLE-2 ranks them, lookups): x_j is a function of the
      context, so its law is the point mass at x_j: q_j is one-hot, child j is accepted with probability
      r_{j-1}(x_j) and a rejected child is removed from the residual. The result: the row emits a draw from p
      and goes down the child equal to it. The plain SpecInfer rule with the draft's q for such children is
      NOT exact: it would accept the top child with probability min(1, p(x)/q(x)), although x was proposed
      with probability 1, not q(x) (with p == q the top child is always taken: tests/test_verify_tree.py).
    - DRAWN_FIRST (the chain's draft token drawn from q, then q's most probable other tokens): q_1 = q, and
      x_2..x_k are a function of the context and x_1, so q_j (j > 1) is the point mass at x_j: the first child
      is verified as a chain's draft (accepted with min(1, p/q), else r_1 = max(0, p - q) renormalised), and
      the row then emits a draw from r_1 and goes down the sibling equal to it. Never below the chain: the
      chain stops where this rule may still go down a sibling.

    Exact whenever each node's children, given the path to it and the tree above, are the first k draws of
    their mode in trial order; k and the subtrees may depend on anything but those draws (node budgets over
    other branches, EAGLE-2's expansion by path products). A chain (one child per node) is verify.rejection_sample
    exactly, bit for bit."""
    _check_rows(tree, target_probs, "target_probs")
    vocab = target_probs.shape[-1]
    if draft_probs is None and tree.needs_draft_probs:
        raise ValueError("tree_acceptance: IID, WITHOUT_REPLACEMENT or DRAWN_FIRST children need draft_probs "
                         "[..., N, V]; only a tree of DETERMINISTIC children may pass None")
    if draft_probs is not None and draft_probs.shape[-2] != tree.num_nodes:
        raise ValueError(f"draft_probs has {draft_probs.shape[-2]} rows; one per node ({tree.num_nodes}) is needed")
    residuals = target_probs.clone()
    batch = target_probs.shape[:-2]
    accept_probs = target_probs.new_zeros(*batch, tree.num_nodes)
    modes = tree.selection_modes  # host-side: which passes need q, and which the without-replacement mask
    removed = torch.zeros_like(residuals, dtype=torch.bool) if ChildSelection.WITHOUT_REPLACEMENT in modes else None
    tiny = torch.finfo(target_probs.dtype).tiny
    for rank, nodes in enumerate(tree.nodes_by_rank):  # one pass per sibling rank; a parent has one node each
        rank_modes = {modes[i] for i in tree.node_lists_by_rank[rank]}
        rows = tree.parent_rows.index_select(0, nodes)  # [n]
        x = tree.tokens.expand(*accept_probs.shape).index_select(-1, nodes)[..., None]  # [..., n, 1]
        # q is read where a child of this rank was drawn from it: IID, WITHOUT_REPLACEMENT, a DRAWN_FIRST draw;
        # a one-hot point mass where it was ranked: DETERMINISTIC, a DRAWN_FIRST draw's siblings.
        drawn = bool(rank_modes & {ChildSelection.IID, ChildSelection.WITHOUT_REPLACEMENT}) or \
            (rank == 0 and ChildSelection.DRAWN_FIRST in rank_modes)
        ranked = ChildSelection.DETERMINISTIC in rank_modes or (rank > 0 and ChildSelection.DRAWN_FIRST in rank_modes)
        if draft_probs is None:
            drawn, ranked = False, True
        point = torch.zeros(*batch, nodes.numel(), vocab, dtype=target_probs.dtype, device=target_probs.device
                            ).scatter_(-1, x, 1.0) if ranked or removed is not None else None  # [..., n, V]
        proposal = point
        if drawn:
            q = draft_probs.index_select(-2, nodes).to(target_probs.dtype)  # [..., n, V]
            mode = tree.selection.index_select(0, nodes)[:, None]  # [n, 1]
            if rank > 0 and removed is not None:  # without replacement: the earlier siblings removed, renormalised
                kept = q.masked_fill(removed.index_select(-2, rows), 0.0)
                without = kept / kept.sum(-1, keepdim=True).clamp_min(tiny)
                q = torch.where(mode == ChildSelection.WITHOUT_REPLACEMENT, without, q)
            proposal = q
            if ranked:  # this rank mixes drawn and ranked children (of different rows)
                is_ranked = mode == ChildSelection.DETERMINISTIC
                if rank > 0:
                    is_ranked = is_ranked | (mode == ChildSelection.DRAWN_FIRST)
                proposal = torch.where(is_ranked, point, q)
        residual = residuals.index_select(-2, rows)  # [..., n, V]
        px = residual.gather(-1, x).squeeze(-1)
        qx = proposal.gather(-1, x).squeeze(-1)
        # A child drawn from q has q(x) > 0; the clamp only keeps a 0/0 from becoming NaN (it gives 0).
        accept_probs[..., nodes] = (px / qx.clamp_min(tiny)).clamp(max=1.0)
        residuals[..., rows, :] = _next_residual(residual, proposal)
        if removed is not None:
            removed[..., rows, :] |= point > 0
    return TreeAcceptance(accept_probs, residuals)


def _first_passing(tree: TokenTree, passes: torch.Tensor) -> torch.Tensor:
    """[..., N] bool: the nodes taken. A child is tried only when every earlier sibling was rejected, so of the
    siblings whose test passes [..., N] the first in trial order is the one taken."""
    return passes & ~(tree.earlier_siblings & passes[..., None, :]).any(-1)


def tree_rejection_sample(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                          generator: torch.Generator | None = None) -> TreeVerdict:
    """Lossless tree speculative sampling: the emitted tokens (the accepted path, then next_token) are
    distributed exactly as plain sampling from p (tree_acceptance has the rule and why).

    target_probs: [..., N + 1, V]; draft_probs: [..., N, V] or None (all DETERMINISTIC). Draws one uniform per
    node (all nodes, reached or not) and then one token, in verify.rejection_sample's order: a chain with the
    same generator gives its result bit for bit."""
    acceptance = tree_acceptance(tree, target_probs, draft_probs)
    batch, vocab = target_probs.shape[:-2], target_probs.shape[-1]
    uniform = torch.rand(*batch, tree.num_nodes, generator=generator, device=target_probs.device,
                         dtype=target_probs.dtype)
    passes = uniform < acceptance.accept_probs  # [..., N]
    accepted, last_row = _deepest_full_path(tree, _first_passing(tree, passes))
    index = last_row[..., None, None].expand(*batch, 1, vocab)
    final = acceptance.residuals.gather(-2, index).squeeze(-2)  # [..., V]
    next_token = draw(final.reshape(-1, vocab), generator).reshape(batch)
    return TreeVerdict(accepted, last_row, next_token)

"""Token trees as proposers build them (issue 25; the tree itself: quickdraft/token_tree.py): a lookup's
continuations merged into a trie that keeps the most frequent nodes within a budget, a draft model's
candidates ranked by path probability (EAGLE-2, Li et al. 2024), and the proposal either becomes: a chain where
only one continuation is left (verified as today), else a tree of DETERMINISTIC children (a function of the
context, so q is one-hot and verification stays exact at every temperature)."""

from __future__ import annotations

from typing import Sequence

import torch

from quickdraft.drafts.base import Proposal
from quickdraft.token_tree import ChildSelection, TokenTree


def deterministic_tree_proposal(tokens: Sequence[int], parents: Sequence[int], device: torch.device,
                                catch_up: int = 0) -> Proposal:
    """The proposal of a looked-up or ranked tree (tokens and parents in node order, parents[i] < i, -1: a child
    of the root): nothing for no node, a chain (tree None) for a line, else the TokenTree."""
    if not tokens:
        return Proposal(torch.empty(0, dtype=torch.long, device=device), catch_up=catch_up)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
    if list(parents) == list(range(-1, len(tokens) - 1)):
        return Proposal(ids, catch_up=catch_up)
    return Proposal(ids, catch_up=catch_up, tree=TokenTree.from_parents(ids, parents, ChildSelection.DETERMINISTIC))


def frequency_trie(continuations: Sequence[Sequence[int]], max_nodes: int,
                   max_depth: int) -> tuple[list[int], list[int]]:
    """The trie of `continuations` (most recent first) cut at max_depth tokens, keeping the max_nodes nodes that
    most continuations pass through (ties: the shallower, then the most recent): (tokens, parents) in an order
    where a parent comes first and siblings are most frequent first. A node's count never exceeds its
    parent's, so the nodes kept always hang together."""
    count: dict[tuple[int, ...], int] = {}
    first_seen: dict[tuple[int, ...], int] = {}
    for rank, continuation in enumerate(continuations):
        path: tuple[int, ...] = ()
        for token in list(continuation)[:max_depth]:
            path += (int(token),)
            count[path] = count.get(path, 0) + 1
            first_seen.setdefault(path, rank)
    kept = sorted(count, key=lambda p: (-count[p], len(p), first_seen[p]))[:max(max_nodes, 0)]
    return _ordered(kept, lambda p: (-count[p], first_seen[p]))


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


def _ordered(kept: Sequence[tuple[int, ...]], sibling_key) -> tuple[list[int], list[int]]:
    """Paths closed under prefixes -> (tokens, parents) in number_nodes' order."""
    ordered = number_nodes(kept, lambda p: p[:-1] if len(p) > 1 else None, len, sibling_key)
    index = {path: i for i, path in enumerate(ordered)}
    return [path[-1] for path in ordered], [index[path[:-1]] if len(path) > 1 else -1 for path in ordered]

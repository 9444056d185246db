"""Attention masks for the torch forwards: which cache slots each new row sees, causal or as a token tree, a
sliding window applied by position. models/hf.py and models/torch_runner.py build them on the host from a
TreeAttention (models/cuda_runner.py builds its masks on the device, over a paged pool: models/paged_attention.py).

A row of a tree node sees the causal prefix, its ancestors and itself, and its position is base + depth - 1
(models.base.TreeAttention), so the slots it sees hold, in slot order, positions 0, 1, .., its own: exactly
the keys a plain line of the same tokens would hold. A window of w keeps the keys whose positions are above the
row's minus w, the rule transformers' masks and the native runner apply to plain rows.
"""

from __future__ import annotations

import torch

from quickdraft.models.base import TreeAttention


def visible_keys(positions: torch.Tensor, capacity: int, window: int | None) -> torch.Tensor:
    """Which of key slots 0..capacity each query at `positions` [n] (a device tensor) sees, [n, capacity] bool:
    the causal ones within the sliding window (slots past the sequence none)."""
    k_pos = torch.arange(capacity, device=positions.device)[None, :]
    q_pos = positions[:, None]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    """A bool visibility [n, keys] as the additive mask attention adds to its scores: 0 where seen, -inf elsewhere."""
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def tree_positions(tree: TreeAttention) -> torch.Tensor:
    """[end] the position of every slot 0..end-1 (int64, on the CPU): the slot below base, base + depth - 1 in
    the tree."""
    return torch.tensor(tree.positions(0, tree.end), dtype=torch.long)


def tree_visibility(tree: TreeAttention, start: int, window: int | None = None) -> torch.Tensor:
    """[end - start, end] bool (on the CPU): whether the row of slot start + i sees slot j. A row below base is
    a causal row (slots <= its own); a tree row sees the prefix [0, base), its ancestors and itself. With a
    window, only the slots whose positions are above the row's position minus `window`."""
    end, base = tree.end, tree.base
    slots = torch.arange(start, end)
    allowed = torch.arange(end)[None, :] <= slots[:, None]  # [end - start, end]; a tree row's prefix is all there
    size = end - base
    if size and end > max(start, base):
        # ancestors[i, j]: tree slot base + j is tree slot base + i or one of its ancestors. One pass per level:
        # every node climbs one parent at a time until it passes the root (-1).
        parent = torch.tensor(tree.parents) - base  # [size]; -1: a child of the root
        ancestors = torch.eye(size, dtype=torch.bool)
        nodes, above = torch.arange(size), parent.clone()
        live = above >= 0
        while bool(live.any()):
            ancestors[nodes[live], above[live]] = True
            above[live] = parent[above[live]]
            live = above >= 0
        first = max(start, base)  # the first new tree row; rows before it are causal rows below base
        allowed[first - start:, base:] = ancestors[first - base:]
    if window is not None:
        positions = tree_positions(tree)
        allowed &= positions[None, :] > positions[start:, None] - window
    return allowed

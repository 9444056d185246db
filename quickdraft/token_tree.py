"""A tree of draft tokens verified in one target forward (SpecInfer, Miao et al. 2024; Medusa; EAGLE-2).

Flat layout. The target is run on [root, node 0, ..., node N-1], where the root is the last committed token
(its KV is written this step, as today's chain writes it) and the nodes are the drafts in an order where a
parent comes before its children (parents[i] < i). Input row 0 is the root and row i + 1 is node i; output
row r is the distribution of the token after row r's input, so node i is scored by row parents[i] + 1 (its
parent's row) and the bonus after an accepted path ending at node j comes from row j + 1.

A chain of K drafts is the one-child case: parents = [-1, 0, ..., K-2], rows 0..K, row i scores draft i,
positions first..first+K, a causal mask and a length change on rollback: exactly today's layout
(quickdraft.verify's position convention).

How each node's siblings were chosen (ChildSelection) decides the exact acceptance rule (verify_tree): the
siblings of one parent share one mode, and their order is the order in which they were drawn or ranked
(the verifier tries them in that order).

Pure tensor functions and host-side structure, no I/O. Tokens may carry leading batch dimensions
([..., N]: trees of one shape, e.g. a static tree over a batch); the structure (parents, selection) is one.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Sequence

import torch


class ChildSelection(enum.IntEnum):
    """How the children of one node were chosen (the verifier's exact rule depends on it: verify_tree)."""

    DETERMINISTIC = 0  # a function of the context: top-k by draft probability (EAGLE-2), n-gram / suffix lookups
    IID = 1  # independent draws from the draft's q, with replacement (SpecTr; SpecInfer's multi-step sampling)
    WITHOUT_REPLACEMENT = 2  # sequential draws from q with earlier siblings removed (Jeon et al. 2024, RSD)
    # The first child one draw from q (the chain's draft token), the others q's most probable tokens besides it
    # (a function of the context and that draw): a sampled chain with ranked alternatives beside it.
    DRAWN_FIRST = 3


class KVCompaction(NamedTuple):
    """Which of the step's KV rows survive an acceptance, and the moves that pack them (row 0 = the root).

    kept_rows: [m + 1] long, the root's row and the accepted nodes' rows in path order; after compaction the
        sequence's KV holds them at step rows 0..m (the bonus token is not in the KV yet: it is next step's root).
    src, dst: [M] long, the moves (step row src -> step row dst) where the row is not already in place; empty
        for a chain, whose rollback stays a length change.
    """

    kept_rows: torch.Tensor  # [m + 1]
    src: torch.Tensor  # [M]
    dst: torch.Tensor  # [M]

    @property
    def length(self) -> int:
        """Rows of this step that the KV keeps (the root plus the accepted path)."""
        return int(self.kept_rows.numel())

    @property
    def is_length_change(self) -> bool:
        return self.src.numel() == 0


class TokenTree:
    """Draft nodes in flat form: tokens, parent per node (-1: a child of the root, the last committed token),
    and how each node's siblings were chosen. Build with from_paths, from_parents or chain.

    tokens: [..., N] long; parents: [N] long, parents[i] in [-1, i); selection: [N] int8 (ChildSelection),
    equal among siblings. Derived (host-side, fixed at construction): depth [N] (1 for a child of the root),
    parent_rows [N] (parents + 1: the output row that scores each node), sibling_rank [N] (0 for the first
    child of its parent, in trial order), ancestors [N, N] bool (ancestors[i, j]: node j is node i or one of
    its ancestors; the tree attention mask), earlier_siblings [N, N] bool (node j shares node i's parent and is
    tried before it), nodes_by_rank (per sibling rank r, the nodes of rank r [n_r] long)."""

    def __init__(self, tokens: torch.Tensor, parents: Sequence[int], selection: Sequence[int]):
        tokens = torch.as_tensor(tokens)
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token tree tokens must be integer ids, got {tokens.dtype}")
        parents = [int(p) for p in parents]
        selection = [ChildSelection(int(s)) for s in selection]
        n = len(parents)
        if tokens.dim() == 0 or tokens.shape[-1] != n or len(selection) != n:
            raise ValueError(f"token tree: tokens {tuple(tokens.shape)}, {n} parents and {len(selection)} "
                             "selection modes must agree on the number of nodes (tokens [..., N])")
        depth, rank, first_mode, children = [], [], {}, {}
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"token tree node {i} has parent {parent}: a parent must come before its "
                                 "children (-1 for a child of the root)")
            depth.append(1 if parent < 0 else depth[parent] + 1)
            siblings = children.setdefault(parent, [])
            rank.append(len(siblings))
            siblings.append(i)
            mode = first_mode.setdefault(parent, selection[i])
            if mode != selection[i]:
                raise ValueError(f"token tree node {i}: its siblings were chosen as {mode.name}, it as "
                                 f"{selection[i].name}; the children of one node share one selection mode")
        self.tokens = tokens.long()  # [..., N]
        self.parents = torch.tensor(parents, dtype=torch.long, device=tokens.device)  # [N]
        self.selection = torch.tensor([int(s) for s in selection], dtype=torch.int8, device=tokens.device)  # [N]
        self.depth = torch.tensor(depth, dtype=torch.long, device=tokens.device)  # [N]
        self.parent_rows = self.parents + 1  # [N]
        self.sibling_rank = torch.tensor(rank, dtype=torch.long, device=tokens.device)  # [N]
        self._parent_list, self._depth_list, self._children, self._rank = parents, depth, children, rank
        self._modes = {parent + 1: mode for parent, mode in first_mode.items()}  # row -> its children's mode
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(parents):
            if parent >= 0:
                ancestors[i] = ancestors[parent]
            ancestors[i, i] = True
        self.ancestors = ancestors.to(tokens.device)  # [N, N]
        same_parent = self.parents[:, None] == self.parents[None, :]
        order = torch.arange(n, device=tokens.device)
        self.earlier_siblings = same_parent & (order[None, :] < order[:, None])  # [N, N]: j tried before i
        # The nodes of each sibling rank, as index tensors: the verifier walks the ranks (the trial order) with
        # every parent at once, one pass per rank, and needs no host read to find them.
        self.node_lists_by_rank = [[i for i in range(n) if rank[i] == r] for r in range(max(rank, default=-1) + 1)]
        self.nodes_by_rank = [torch.tensor(nodes, dtype=torch.long, device=tokens.device)
                              for nodes in self.node_lists_by_rank]
        self.selection_modes = selection  # [N] ChildSelection, host-side
        for parent, kids in children.items():
            if first_mode[parent] != ChildSelection.IID and len(kids) > 1:
                # i.i.d. draws may repeat a token (each copy is its own trial); ranked or without-replacement
                # children are distinct by construction, so a repeat is a proposer's bug.
                kid_tokens = self.tokens[..., kids]  # [..., k]
                if ((kid_tokens[..., :, None] == kid_tokens[..., None, :]).sum(-1) > 1).any():
                    raise ValueError(f"token tree: the {first_mode[parent].name} children of row {parent + 1} "
                                     "repeat a token; only IID children may (merge them, or mark them IID)")

    # -- constructors -------------------------------------------------------------------------------------------

    @classmethod
    def from_parents(cls, tokens, parents: Sequence[int],
                     selection: ChildSelection | Sequence[int] = ChildSelection.DETERMINISTIC) -> TokenTree:
        """tokens [..., N], parents [N] (-1: child of the root), selection one mode or one per node [N]."""
        n = len(parents)
        modes = [selection] * n if isinstance(selection, (ChildSelection, int)) else list(selection)
        return cls(torch.as_tensor(tokens, dtype=torch.long), parents, modes)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]],
                   selection: ChildSelection = ChildSelection.DETERMINISTIC) -> TokenTree:
        """A trie of continuations (n-gram / suffix branches, EAGLE-2 paths): shared prefixes are merged, siblings
        ordered by first appearance. IID children must not be merged (each draw is its own trial, see
        verify_tree): a shared first token under IID raises; build such trees with from_parents."""
        tokens, parents, index = [], [], {}
        for path in paths:
            parent = -1
            for token in path:
                key = (parent, int(token))
                if key in index:
                    if selection == ChildSelection.IID:
                        raise ValueError("token tree from_paths would merge IID draws sharing the token "
                                         f"{int(token)} under node {parent}; build i.i.d. trees with from_parents")
                else:
                    index[key] = len(tokens)
                    tokens.append(int(token))
                    parents.append(parent)
                parent = index[key]
        return cls(torch.tensor(tokens, dtype=torch.long), parents, [selection] * len(tokens))

    @classmethod
    def chain(cls, tokens, selection: ChildSelection = ChildSelection.IID) -> TokenTree:
        """K drafts in a line (today's layout). IID: drawn from q (one child: with or without replacement alike);
        DETERMINISTIC: a lookup draft (q one-hot, verify's q=None)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        k = tokens.shape[-1]
        return cls(tokens, list(range(-1, k - 1)), [selection] * k)

    # -- structure ----------------------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self._parent_list)

    @property
    def num_rows(self) -> int:
        """Rows of the target's forward: the root and every node."""
        return self.num_nodes + 1

    @property
    def parent_list(self) -> list[int]:
        """parents as host integers [N] (-1: a child of the root)."""
        return self._parent_list

    @property
    def depth_list(self) -> list[int]:
        """depth as host integers [N]."""
        return self._depth_list

    @property
    def max_depth(self) -> int:
        return max(self._depth_list, default=0)

    @property
    def max_children(self) -> int:
        return max((len(kids) for kids in self._children.values()), default=0)

    @property
    def needs_draft_probs(self) -> bool:
        """Whether some children were drawn from the draft's q (IID, WITHOUT_REPLACEMENT or DRAWN_FIRST), which
        their verification needs."""
        return any(mode != ChildSelection.DETERMINISTIC for mode in self._modes.values())

    @property
    def is_chain(self) -> bool:
        return self._parent_list == list(range(-1, self.num_nodes - 1))

    def children(self, row: int) -> list[int]:
        """The nodes scored by output row `row` (row 0: the root's children), in trial order."""
        return list(self._children.get(row - 1, []))

    def first_child_path(self) -> list[int]:
        """The nodes from the root down through each node's first child in trial order: the chain inside the tree
        (a ranked tree's most probable line, a DRAWN_FIRST tree's draws: the chain its proposer would draft)."""
        path, children = [], self._children.get(-1)
        while children:
            path.append(children[0])
            children = self._children.get(children[0])
        return path

    def children_mode(self, row: int) -> ChildSelection | None:
        """How the children of row `row` were chosen (None: it has none)."""
        return self._modes.get(row)

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (itself included); [] for node -1 (the root)."""
        if not -1 <= node < self.num_nodes:
            raise ValueError(f"token tree has nodes 0..{self.num_nodes - 1}, not {node}")
        path = []
        while node >= 0:
            path.append(node)
            node = self._parent_list[node]
        return path[::-1]

    def path_tokens(self, node: int) -> torch.Tensor:
        """The draft tokens from the root to `node`, [..., depth]."""
        return self.tokens[..., self.path_to(node)]

    @property
    def row_depths(self) -> torch.Tensor:
        """[N + 1]: 0 for the root, then each node's depth. Row r predicts the token at output position
        (committed output length) + row_depths[r]: the position whose noise a seeded request draws with."""
        return torch.cat([self.depth.new_zeros(1), self.depth])

    def positions(self, first: int) -> torch.Tensor:
        """Position ids of the forward's rows [N + 1], by depth: the root at `first` (the last committed token's
        position), a node at first + depth. A chain gives first..first+K."""
        return first + self.row_depths

    def attention_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True where node i attends to node j (j is i or an ancestor of i). Every
        node also sees the committed prefix and the root (not in this matrix; see step_attention_mask)."""
        return self.ancestors

    def step_attention_mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool over the step's rows (root first): the root sees itself, each node the root, its
        ancestors and itself. A chain gives the causal lower triangle (today's layout). The committed prefix
        before the root is visible to every row."""
        n = self.num_nodes
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=self.ancestors.device)
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestors
        return mask

    def row_path_counts(self, vocab: int) -> torch.Tensor:
        """[..., N + 1, V] float: how often each token occurs on the path from the root to each row (row 0: none;
        row i + 1: node i's path, itself included), the draft tokens a row's penalties must see on top of the
        committed history. A chain gives PenaltyHistory.rows' cumulative steps."""
        onehot = torch.nn.functional.one_hot(self.tokens, vocab).float()  # [..., N, V]
        counts = self.ancestors.float() @ onehot  # [..., N, V]
        return torch.cat([torch.zeros_like(counts[..., :1, :]), counts], dim=-2)

    def compaction_plan(self, accepted: torch.Tensor | Sequence[int]) -> KVCompaction:
        """The KV rows that survive once `accepted` is known: a bool mask [N] (TreeVerdict.accepted of one tree)
        or the accepted nodes in path order. Raises if they are not a root path."""
        accepted = torch.as_tensor(accepted)
        if accepted.dtype == torch.bool:
            if accepted.shape != (self.num_nodes,):
                raise ValueError(f"compaction_plan takes one tree's accepted mask [{self.num_nodes}], got "
                                 f"{tuple(accepted.shape)}")
            nodes = accepted.cpu().nonzero().flatten().tolist()  # ancestors come first: path order
        else:
            nodes = [int(n) for n in accepted.flatten().tolist()]
        if nodes and self.path_to(nodes[-1]) != nodes:
            raise ValueError(f"accepted nodes {nodes} are not a path from the root in this token tree")
        kept = torch.tensor([0] + [n + 1 for n in nodes], dtype=torch.long)
        moved = kept != torch.arange(kept.numel())
        return KVCompaction(kept, kept[moved], torch.arange(kept.numel())[moved])

    def subtree(self, nodes: Sequence[int]) -> TokenTree:
        """The tree of `nodes` (node indices, each node's parent among them or the root), renumbered in node
        order, with their tokens and selection modes: a pruned tree (the engine's node budget). A node's children
        keep their trial order, so the rule for how they were chosen still holds for the ones kept only when they
        are a prefix of that order (DETERMINISTIC children are exact whatever is kept; DRAWN_FIRST siblings whose
        drawn first child is cut become DETERMINISTIC)."""
        nodes = sorted(int(n) for n in nodes)
        index = {n: i for i, n in enumerate(nodes)}
        parents = []
        for n in nodes:
            parent = self._parent_list[n]
            if parent >= 0 and parent not in index:
                raise ValueError(f"subtree: node {n} is kept but its parent {parent} is not")
            parents.append(-1 if parent < 0 else index[parent])
        picked = torch.tensor(nodes, dtype=torch.long, device=self.tokens.device)
        modes = self.selection[picked].tolist()
        # DRAWN_FIRST's rule reads its first child as the draw from q: where that child is cut, the siblings kept
        # are ranked tokens only (a function of the context and a draw the verifier never sees): DETERMINISTIC.
        drawn_kept = {self._parent_list[n] for n in nodes if self._rank[n] == 0}
        modes = [int(ChildSelection.DETERMINISTIC) if mode == ChildSelection.DRAWN_FIRST
                 and self._parent_list[n] not in drawn_kept else mode for n, mode in zip(nodes, modes)]
        return TokenTree(self.tokens.index_select(-1, picked), parents, modes)

    def to(self, device: torch.device | str) -> TokenTree:
        """The same tree with its tensors on `device`."""
        tree = TokenTree.__new__(TokenTree)
        tree.__dict__.update(self.__dict__)
        for name in ("tokens", "parents", "selection", "depth", "parent_rows", "sibling_rank", "ancestors",
                     "earlier_siblings"):
            setattr(tree, name, getattr(self, name).to(device))
        tree.nodes_by_rank = [nodes.to(device) for nodes in self.nodes_by_rank]
        return tree

    def __repr__(self) -> str:
        return (f"TokenTree(tokens={self.tokens.tolist()}, parents={self._parent_list}, "
                f"selection={[ChildSelection(int(s)).name for s in self.selection.tolist()]})")

"""One step's drafts and the target rows that verify them, as named ragged data.

A step verifies several sequences at once: sequence i proposed k_i draft tokens (k_i may be 0: a prompt, a
plain step, or a sequence whose max_tokens leaves no room for drafts) and the target's forward returned
k_i + 1 rows for it, concatenated in batch order into logits [num_rows, vocab]. Row j of sequence i scores
its draft j (the position convention of quickdraft/verify.py) and its last row is the bonus row, used when
every draft is accepted. `StepBatch` names that layout once, with the shapes written beside each field as
vLLM's SpecDecodeMetadata does, so that the engine and the acceptance rules in verify.py index the same rows.

Token trees (issue 25) extend it without changing what chains see. A tree of k_i nodes is still k_i flat
draft tokens and k_i + 1 rows (the root row, then one row per node in node order, each scoring that node's
children); `trees[i]` is then its quickdraft.token_tree.TokenTree (parents, depths, how children were chosen):
the row scoring node j is its parent's row, lo + tree.parent_rows[j], which for a chain is lo + j. The tree
rules (verify_tree.py) walk parents where the chain rules take prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from quickdraft.token_tree import TokenTree

__all__ = ["StepBatch"]


@dataclass(frozen=True)
class StepBatch:
    """The drafts of one step's sequences, flat, with their offsets and their rows in the target's logits."""

    draft_token_ids: torch.Tensor  # [num_draft_tokens] every sequence's drafts, in batch order (long)
    num_draft_tokens: list[int]  # [batch] k_i
    cu_num_draft_tokens: list[int]  # [batch + 1] sequence i's drafts: draft_token_ids[cu[i]:cu[i + 1]]
    cu_num_rows: list[int]  # [batch + 1] sequence i's rows of the logits [num_rows, vocab]: cu[i]:cu[i + 1]
    # [batch] entries [k_i, vocab]: the processed distributions the drafts were drawn from, or None where the
    # draft is deterministic (a lookup, or any draft under greedy decoding: verification takes q one-hot).
    draft_probs: list[torch.Tensor | None]
    # [batch] None for a chain, else the sequence's token tree over its k_i drafts (node order; see the module doc).
    trees: list[TokenTree | None]

    @staticmethod
    def build(drafts: list[torch.Tensor], draft_probs: list[torch.Tensor | None],
              trees: list[TokenTree | None] | None = None) -> "StepBatch":
        """From each sequence's draft tokens [k_i] (a 0-d or empty tensor for none) and its proposal's draft
        probabilities ([>= k_i, vocab]: a proposal may have drafted more than the step keeps, cut here to k_i)
        or None, and its token tree or None (a chain; trees None: all chains)."""
        if len(drafts) != len(draft_probs):
            raise ValueError(f"StepBatch.build: {len(drafts)} drafts but {len(draft_probs)} draft probabilities")
        trees = [None] * len(drafts) if trees is None else list(trees)
        for i, (d, tree) in enumerate(zip(drafts, trees)):
            if tree is not None and tree.num_nodes != int(d.numel()):
                raise ValueError(f"StepBatch.build: sequence {i}'s tree has {tree.num_nodes} nodes but {int(d.numel())} "
                                 "draft tokens")
        if not drafts:
            raise ValueError("StepBatch.build: a step verifies at least one sequence")
        ks = [int(d.numel()) for d in drafts]
        probs = [None if q is None else q[:k] for q, k in zip(draft_probs, ks)]
        for i, (q, k) in enumerate(zip(probs, ks)):
            if q is not None and q.shape[0] != k:
                raise ValueError(f"StepBatch.build: sequence {i} has {k} drafts but probabilities for {q.shape[0]}")
        cu_drafts = [0, *accumulate(ks)]
        drafting = [d.reshape(-1).to(torch.long) for d, k in zip(drafts, ks) if k]  # (a plain step has none)
        return StepBatch(
            draft_token_ids=torch.cat(drafting) if drafting else drafts[0].new_empty(0, dtype=torch.long),
            num_draft_tokens=ks,
            cu_num_draft_tokens=cu_drafts,
            cu_num_rows=[c + i for i, c in enumerate(cu_drafts)],  # k_i + 1 rows each
            draft_probs=probs,
            trees=trees,
        )

    @staticmethod
    def plain(batch_size: int, empty: torch.Tensor) -> "StepBatch":
        """A step with no drafts (plain decoding): one row a sequence. empty: a long tensor of no tokens, on the
        device the drafts would be."""
        return StepBatch(draft_token_ids=empty, num_draft_tokens=[0] * batch_size,
                         cu_num_draft_tokens=[0] * (batch_size + 1), cu_num_rows=list(range(batch_size + 1)),
                         draft_probs=[None] * batch_size, trees=[None] * batch_size)

    @property
    def batch_size(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def num_rows(self) -> int:
        return self.cu_num_rows[-1]

    @property
    def device(self) -> torch.device:
        return self.draft_token_ids.device

    def num_rows_of(self, i: int) -> int:
        """Sequence i's rows, k_i + 1."""
        return self.cu_num_rows[i + 1] - self.cu_num_rows[i]

    def rows(self, i: int) -> tuple[int, int]:
        """(lo, hi): sequence i's rows of the logits, hi - lo = k_i + 1."""
        return self.cu_num_rows[i], self.cu_num_rows[i + 1]

    def drafts(self, i: int) -> torch.Tensor:
        """Sequence i's draft tokens [k_i]."""
        return self.draft_token_ids[self.cu_num_draft_tokens[i]: self.cu_num_draft_tokens[i + 1]]

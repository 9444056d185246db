"""`ngram`: prompt lookup decoding (Saxena 2023). No model: the draft is the continuation of the most
recent earlier occurrence of the sequence's last n tokens, in the prompt or the generated text. Asked for a token
tree, it merges the continuations of the earlier occurrences (the most recent MAX_OCCURRENCES) into a trie and
keeps its most frequent nodes (drafts/trees.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quickdraft.drafts.base import DraftOptions, Proposal, Proposer, TreeBudget
from quickdraft.drafts.trees import deterministic_tree_proposal, frequency_trie
from quickdraft.errors import QuickdraftError

# The earlier occurrences a tree merges at most (the most recent): bounds the trie's work on repetitive text.
MAX_OCCURRENCES = 64


def find_continuations(ids: np.ndarray, min_n: int, max_n: int, k: int,
                       occurrences: int = 1) -> list[np.ndarray]:
    """The up-to-k tokens that followed each of the `occurrences` most recent earlier matches of the longest
    suffix of `ids` with length in [min_n, max_n], most recent first; [] when nothing matches."""
    length = ids.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = ids[length - n:]
        # Windows starting at 0 .. length-n-1: every occurrence except the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            return [ids[int(start) + n:int(start) + n + k] for start in starts[::-1][:occurrences]]
    return []


def find_continuation(ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up-to-k tokens that followed the most recent earlier match of the longest suffix of `ids` with
    length in [min_n, max_n]; empty when nothing matches."""
    found = find_continuations(ids, min_n, max_n, k)
    return found[0] if found else ids[:0]


@dataclass
class NgramOptions(DraftOptions):
    """prompt_lookup_min / prompt_lookup_max: the n-gram sizes ngram tries, longest first."""

    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise QuickdraftError(f"ngram: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}")


class NgramProposer(Proposer):
    name = "ngram"
    options = NgramOptions
    spelling = "ngram"
    proposes_trees = True

    def __init__(self, min_n: int = 1, max_n: int = 4):
        super().__init__()
        NgramOptions(min_n, max_n)  # refuses bad sizes
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def from_config(cls, config, context) -> "NgramProposer":
        return cls(config.options.prompt_lookup_min, config.options.prompt_lookup_max)

    def propose(self, seq, k: int) -> Proposal:
        ids = np.asarray(seq.token_ids, dtype=np.int64)
        tokens = find_continuation(ids, self.min_n, self.max_n, k)
        return Proposal(torch.from_numpy(tokens.copy()).to(seq.device))

    def propose_tree_batch(self, seqs, budgets: list[TreeBudget]) -> list[Proposal]:
        """The trie of the continuations of the longest matching n-gram's earlier occurrences, its most frequent
        nodes within each budget; one distinct continuation stays a chain."""
        out = []
        for seq, budget in zip(seqs, budgets):
            if budget.max_nodes <= 0:
                out.append(Proposal.empty(seq.device))
                continue
            ids = np.asarray(seq.token_ids, dtype=np.int64)
            found = find_continuations(ids, self.min_n, self.max_n, budget.max_depth, MAX_OCCURRENCES)
            trie = frequency_trie([c.tolist() for c in found], budget.max_nodes, budget.max_depth)
            out.append(deterministic_tree_proposal(*trie, seq.device))
        return out

"""`ngram`: prompt lookup decoding (Saxena 2023). No model: the draft is the continuation of the most
recent earlier occurrence of the sequence's last n tokens, in the prompt or the generated text."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quickdraft.drafts.base import DraftOptions, Proposal, Proposer
from quickdraft.errors import QuickdraftError


def find_continuation(ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up-to-k tokens that followed the most recent earlier match of the longest suffix of `ids` with
    length in [min_n, max_n]; empty when nothing matches."""
    length = ids.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = ids[length - n:]
        # Windows starting at 0 .. length-n-1: every occurrence except the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            start = int(starts[-1]) + n
            return ids[start:start + k]
    return ids[:0]


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

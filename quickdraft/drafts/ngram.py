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
from quickdraft.sequence import DraftState

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


class NgramIndex(DraftState):
    """The most recent start of every n-gram (min_n <= n <= max_n) of a sequence's history but its last token,
    kept up as tokens commit: a chain's lookup is a few dictionary reads, where find_continuation scans the whole
    history (50-80 us a sequence a step on a 300-token history, most of a batch's host time at 64 sequences). The
    same answer as find_continuation: the longest suffix first, its most recent earlier occurrence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.ids: list[int] = []  # the history indexed so far
        # match()'s last answer: (the history length it was asked at, its answer, that history's last-n tokens by
        # n). A step asks it for the draft's kind, its length and its tokens (draft_kind, max_draft_tokens,
        # propose) on the same history; and the last-n tokens are the windows the next token makes indexable, so a
        # step's one committed token costs no new keys (at 64 sequences this is host time every step).
        self._match: tuple[int, tuple[int, int], dict[int, tuple[int, ...]]] | None = None

    def _catch_up(self, history: list[int]) -> None:
        ids = self.ids
        old = len(ids)
        if len(history) == old and (not old or history[-1] == ids[-1]):  # nothing new (asked again this step)
            return
        if len(history) < old or (ids and history[old - 1] != ids[-1]):  # not an extension: start over
            self.__init__(self.min_n, self.max_n)
            ids, old = self.ids, 0
        ids.extend(history[old:])
        suffixes = self._match[2] if self._match is not None and self._match[0] == old else {}
        for n, latest in self.latest.items():
            # Windows ending (exclusive) at e <= len - 1, i.e. inside the history but its last token.
            for end in range(max(n, old), len(ids)):
                key = suffixes.get(n) if end == old else None
                latest[key if key is not None else tuple(ids[end - n:end])] = end - n

    def match(self, history: list[int]) -> tuple[int, int]:
        """(where the continuation starts in the history, the length n of the matched suffix); n = 0 where
        nothing matches."""
        self._catch_up(history)
        ids, length = self.ids, len(self.ids)
        if self._match is not None and self._match[0] == length:
            return self._match[1]
        suffixes = {n: tuple(ids[length - n:]) for n in range(self.min_n, min(self.max_n, length - 1) + 1)}
        found = (length, 0)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.latest[n].get(suffixes[n])
            if start is not None:
                found = (start + n, n)
                break
        self._match = (length, found, suffixes)
        return found

    def continuation(self, history: list[int], k: int) -> list[int]:
        begin, n = self.match(history)
        return self.ids[begin:begin + k] if n else []


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
        self._alone = True  # this step's batch is one sequence (prepare): draft_kind and max_draft_tokens look up

    @classmethod
    def from_config(cls, config, context) -> "NgramProposer":
        return cls(config.options.prompt_lookup_min, config.options.prompt_lookup_max)

    def new_state(self, seq) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def _index(self, seq) -> NgramIndex:
        state = seq.draft_state
        if isinstance(state, NgramIndex):
            return state
        index = NgramIndex(self.min_n, self.max_n)  # a sequence the engine did not attach: its own from now on
        if state is None:
            seq.draft_state = index
        return index

    def prepare(self, seqs) -> None:
        self._alone = len(seqs) == 1

    def draft_kind(self, seq) -> str:
        """Alone in its step: "lookup:1" where only the last token matched, else "lookup", and adaptive K learns
        the two's acceptance apart (their step costs are a lookup's, the same). In a batch: "lookup", with no
        lookup until the sequences that draft propose.

        Why: on Spec-Bench chat (SmolLM2, greedy, batch 1) 1-token matches were 434 of 673 drafting steps and
        their first draft passed 0.25 of the time, against 0.41, 0.59 and 0.73 for 2-, 3- and 4-token matches.
        One estimate for all of them priced a 1-token match's later positions at what the long matches accepted
        there (0.88-0.9), so it drafted 3 on a 0.25 chance (benchmarks/RESULTS.md, session 42). A class for each
        length drafted more at batch 4, where a draft row costs ~0.6 of a token, and lost 2-3% there.

        Why not in a batch: the lookup every step is host time for every sequence (~5 us each in Python), and at
        64 sequences on a CPU, where almost nothing drafts, it took the step's host time from 1.47 to 2.1 ms
        (host_time.py). Batched, a sequence's draft is looked up when the policy gives it a k, as before."""
        if not self._alone:
            return "lookup"
        _, n = self._index(seq).match(seq.token_ids)
        return "lookup:1" if n == 1 else "lookup"

    def max_draft_tokens(self, seq) -> int:
        """Alone: what follows the match in the history (0: nothing matches, so the step does not draft). In a
        batch: no bound (not looked up; the draft proposed is as long as the match gives)."""
        if not self._alone:
            return super().max_draft_tokens(seq)
        begin, n = self._index(seq).match(seq.token_ids)
        return len(seq.token_ids) - begin if n else 0

    def propose(self, seq, k: int) -> Proposal:
        return Proposal(torch.tensor(self._index(seq).continuation(seq.token_ids, k), dtype=torch.long,
                                     device=seq.device))

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

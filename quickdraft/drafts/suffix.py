"""`suffix`: SuffixDecoding (Oliaro et al. 2024, as in Snowflake's Arctic Inference). No model: drafts come
from a suffix tree over the running requests' text (prompt and output) and a bounded cache of earlier
requests' text, shared by every request the proposer serves (the tree and how it drafts: drafts/suffix_tree.py).

Each running request is one doc of the index, made when its sequence is (new_state; its prompt indexed then)
and extended with what it commits at each step's `prepare`, which also drafts. When the request ends
(`release`: finished or aborted), its doc, the last step's tokens too, is finished into the cache of earlier
requests' text; a preempted request keeps its doc (its rerun goes on appending to it).

Drafts are deterministic (Proposal.probs None: q one-hot), so verification keeps the target's law exactly,
whatever the cache holds. Asked for a token tree (propose_tree_batch), it follows every continuation seen after
the longest match, most probable first, within the budget (SuffixIndex.speculate_tree). `lookup_else_model` is
how eagle and model_lookup take this lookup's draft where it is confident and a model's elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from quickdraft.drafts.base import DraftOptions, Proposal, Proposer, TreeBudget
from quickdraft.drafts.trees import deterministic_tree_proposal
from quickdraft.drafts.suffix_tree import (DEFAULT_MAX_CACHED_TOKENS, DEFAULT_MAX_DEPTH, DEFAULT_MAX_SPEC_FACTOR,
                                           DEFAULT_MIN_TOKEN_PROB, DEFAULT_UNSEEN_PRIOR, SuffixIndex,
                                           check_index_settings)
from quickdraft.errors import QuickdraftError
from quickdraft.sequence import DraftState

MAX_SPEC_TOKENS = 32

__all__ = ["MAX_SPEC_TOKENS", "SuffixIndex", "SuffixOptions", "SuffixProposer", "SuffixState", "lookup_else_model"]


@dataclass
class SuffixOptions(DraftOptions):
    """The suffix lookup's settings (drafts/suffix_tree.py): the tree's depth (the longest context matched), the
    tokens of finished requests' text kept for later requests (least recently used evicted; 0: none), the draft
    length's cap per matched token, and the least probability a draft's continuation may have."""

    suffix_decoding_max_tree_depth: int = DEFAULT_MAX_DEPTH
    suffix_decoding_max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS
    suffix_decoding_max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    suffix_decoding_min_token_prob: float = DEFAULT_MIN_TOKEN_PROB

    def __post_init__(self) -> None:
        check_index_settings(self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_tokens)
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not (isinstance(factor, (int, float)) and factor > 0):
            raise QuickdraftError(f"suffix: max_spec_factor (suffix_decoding_max_spec_factor) must be > 0, "
                                  f"got {factor!r}")
        if not (isinstance(prob, (int, float)) and 0 <= prob <= 1):
            raise QuickdraftError(f"suffix: min_token_prob (suffix_decoding_min_token_prob) must be in [0, 1], "
                                  f"got {prob!r}")


@dataclass
class SuffixState(DraftState):
    """One request's handle on the index: its doc, and the draft computed for its history's length `at`."""

    doc: object  # suffix_tree's doc of this request's text
    draft: list[int] = field(default_factory=list)
    at: int = -1


class SuffixProposer(Proposer):
    name = "suffix"
    options = SuffixOptions
    spelling = "suffix"
    proposes_trees = True

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
                 max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR, min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
                 max_spec_tokens: int = MAX_SPEC_TOKENS, unseen_prior: float = DEFAULT_UNSEEN_PRIOR):
        super().__init__()
        SuffixOptions(max_depth, max_cached_tokens, max_spec_factor, min_token_prob)  # refuses bad settings
        if not (isinstance(max_spec_tokens, int) and max_spec_tokens >= 1):
            raise QuickdraftError(f"suffix: max_spec_tokens must be an integer >= 1, got {max_spec_tokens!r}")
        self.index = SuffixIndex(max_depth, max_cached_tokens)
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.max_spec_tokens = max_spec_tokens
        self.unseen_prior = float(unseen_prior)

    @classmethod
    def from_options(cls, options: SuffixOptions, max_spec_tokens: int = MAX_SPEC_TOKENS) -> "SuffixProposer":
        return cls(options.suffix_decoding_max_tree_depth, options.suffix_decoding_max_cached_tokens,
                   options.suffix_decoding_max_spec_factor, options.suffix_decoding_min_token_prob, max_spec_tokens)

    @classmethod
    def from_config(cls, config, context) -> "SuffixProposer":
        return cls.from_options(config.options, max(MAX_SPEC_TOKENS, config.num_speculative_tokens))

    # --- a request's doc -------------------------------------------------------------------------------------
    def new_state(self, seq) -> SuffixState:
        """The request's doc, its prompt indexed now."""
        state = SuffixState(self.index.new_doc())
        self._sync(state, seq)
        return state

    def finish(self, state: SuffixState, seq) -> None:
        """The request ended: its doc, with what it committed since the last step, becomes cached text."""
        self._sync(state, seq)
        self.index.finish(state.doc)

    def release(self, seq, preempted: bool = False) -> None:
        if preempted:
            return  # its doc goes on when the sequence reruns; the state holds no KV memory
        self.finish(seq.draft_state, seq)
        seq.draft_state = None

    def _sync(self, state: SuffixState, seq) -> None:
        doc, ids = state.doc, seq.token_ids
        if len(ids) > len(doc.tokens) and doc.active is not None:
            self.index.extend(doc, ids[len(doc.tokens):])

    # --- drafting ---------------------------------------------------------------------------------------------
    def lookup(self, state: SuffixState, seq, max_tokens: int) -> list[int]:
        """Index what `seq` committed since the last call and return its draft of at most max_tokens (empty: no
        confident match). `state` is this proposer's state for seq (another proposer may hold it: eagle)."""
        if not self._indexed(state, seq):
            return []
        return self.index.speculate(state.doc, max_tokens, self.max_spec_factor, self.min_token_prob, self.unseen_prior)

    def _indexed(self, state: SuffixState, seq) -> bool:
        """Index what `seq` committed since the last call; whether its doc now holds its history to draft from (a
        request asking for no speculation, or a finished doc, drafts nothing)."""
        self._sync(state, seq)
        doc = state.doc
        return seq.params.num_speculative_tokens != 0 and doc.active is not None and \
            len(doc.tokens) == len(seq.token_ids)

    def update_draft(self, seq) -> list[int]:
        """Index the tokens seq committed since the last step and draft for its history now; the draft is kept
        on its state, for max_draft_tokens (the engine's K) and propose."""
        return self._redraft(seq.draft_state, seq)

    def _redraft(self, state: SuffixState, seq) -> list[int]:
        state.draft, state.at = self.lookup(state, seq, self.max_spec_tokens), len(seq.token_ids)
        return state.draft

    def drafted(self, state: SuffixState, seq) -> list[int]:
        """The draft for seq's history now, looked up once per history length and kept on `state` (this
        proposer's state for seq; another proposer may hold it: model_lookup)."""
        return state.draft if state.at == len(seq.token_ids) else self._redraft(state, seq)

    def prepare(self, seqs) -> None:
        for seq in seqs:
            self.update_draft(seq)

    def _draft(self, seq) -> list[int]:
        """The draft prepared for seq's history now (drafted here when this step's prepare did not)."""
        return self.drafted(seq.draft_state, seq)

    def max_draft_tokens(self, seq) -> int:
        return len(self._draft(seq))  # 0: no confident match

    def propose(self, seq, k: int) -> Proposal:
        draft = self._draft(seq)[:k]
        if not draft:
            return Proposal.empty(seq.device)
        return Proposal(torch.tensor(draft, dtype=torch.long, device=seq.device))

    def propose_tree_batch(self, seqs, budgets: list[TreeBudget]) -> list[Proposal]:
        """The suffix tree's most probable branches from each sequence's longest match (SuffixIndex.speculate_tree:
        every continuation seen, not only the most frequent), within each budget; one branch stays a chain."""
        out = []
        for seq, budget in zip(seqs, budgets):
            state = seq.draft_state
            if budget.max_nodes <= 0 or not self._indexed(state, seq):
                out.append(Proposal.empty(seq.device))
                continue
            tree = self.index.speculate_tree(state.doc, budget.max_nodes, budget.max_depth, self.max_spec_factor,
                                             self.min_token_prob, self.unseen_prior)
            out.append(deterministic_tree_proposal(*tree, seq.device))
        return out


# The shortest confident lookup draft taken instead of a model's (model_lookup, eagle): a single looked-up token
# would displace a model draft of K tokens for at most one token (chosen, not tuned).
LOOKUP_MIN_TOKENS = 2


def lookup_else_model(seqs, ks: list[int], confident_lookup: Callable[[int], list[int]],
                      propose_by_model: Callable[[list[int]], list[Proposal]]) -> tuple[list[Proposal], list[int]]:
    """Each sequence's proposal of at most ks[j] tokens (none where ks[j] is 0): the suffix lookup's draft where
    `confident_lookup(j)` gives one (a non-empty list: a match its caller trusts), else the model's, which
    `propose_by_model(indices)` makes for all the others in one batch. A step's drafts for a sequence all come
    from one source; a looked-up draft is deterministic (q one-hot: exact). Returns the proposals and the
    indices the model drafted for."""
    out = [Proposal.empty(seq.device) for seq in seqs]
    modelled = []
    for j, (seq, k) in enumerate(zip(seqs, ks)):
        if k <= 0:
            continue
        draft = confident_lookup(j)
        if draft:
            out[j] = Proposal(torch.tensor(draft[:k], dtype=torch.long, device=seq.device))
        else:
            modelled.append(j)
    if modelled:
        for j, proposal in zip(modelled, propose_by_model(modelled)):
            out[j] = proposal
    return out, modelled

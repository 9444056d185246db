"""`model_lookup`: a draft model and the suffix lookup together. Where the lookup over the request's text (and
finished requests', drafts/suffix.py) has a confident match of at least LOOKUP_MIN_TOKENS tokens, its draft is
taken: no draft forward at all. Elsewhere the draft model proposes (drafts/draft_model.py).

Exact by construction: a lookup token is deterministic, so verification takes q one-hot at it (Proposal.probs
None); a model token comes with the draft model's processed q it was drawn from (or none where it needs none:
greedy, or a seeded draw coupled to the target's noise), exactly as draft_model gives it. A step's drafts all
come from one source.

Adaptive K prices the two sources apart: draft_kind says per step which one drafts ("lookup" or "model"), and
the engine keeps step costs (the draft model's forwards are inside a model step's wall time) and acceptance
estimates per kind, so cheap lookup steps do not make model steps look cheap, nor copied text make the model
look accurate. The draft model's cache falls behind during lookup steps and catches up (one forward over the
missed tokens) at its next step; like draft_model's catch-ups, such a step is not timed."""

from __future__ import annotations

import weakref

import torch

from quickdraft.drafts.base import Proposal, Proposer
from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.drafts.suffix import SuffixProposer

# The shortest confident lookup draft taken instead of the model's: a single looked-up token would displace a
# model draft of K tokens for at most one token (chosen, not tuned).
LOOKUP_MIN_TOKENS = 2


class ModelLookupProposer(Proposer):
    name = "model_lookup"
    spelling = "lookup+MODEL"
    runs_a_model = True

    def __init__(self, model: DraftModelProposer, lookup: SuffixProposer, lookup_min_tokens: int = LOOKUP_MIN_TOKENS):
        super().__init__()
        self.model = model
        self.lookup = lookup
        self.lookup_min_tokens = lookup_min_tokens
        # Per sequence: its suffix-index state, and the lookup draft planned at a history length. Weak keys: the
        # suffix state dies with its sequence (its finalizer moves the text into the index's cache).
        self._lookups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.lookup_drafts = self.model_drafts = 0  # proposals made by each source (for reports and tests)

    @classmethod
    def from_config(cls, config, context) -> "ModelLookupProposer":
        return cls(DraftModelProposer.from_config(config, context), SuffixProposer.from_config(config, context))

    # The draft model's cache is the sequence's draft state: the KV budget counts it as draft_model's.
    @property
    def draft_runner(self):
        return self.model.draft_runner

    @property
    def draft_reads_target_tokens(self) -> bool:
        return self.model.draft_reads_target_tokens

    def draft_history(self, seq) -> list[int]:
        return self.model.draft_history(seq)

    def new_state(self, seq):
        if seq not in self._lookups:  # a preempted sequence keeps its suffix state (its doc goes on)
            self._lookups[seq] = self.lookup.new_state(seq)
        return self.model.new_state(seq)

    def _plan(self, seq) -> list[int]:
        """The lookup draft for seq's current history (empty: the model drafts this step), computed once a step."""
        length = len(seq.token_ids)
        plan = self._plans.get(seq)
        if plan is None or plan[0] != length:
            state = self._lookups.get(seq)
            if state is None:
                state = self._lookups[seq] = self.lookup.new_state(seq)
            draft = self.lookup.lookup(state, seq, self.lookup.max_spec_tokens)
            plan = self._plans[seq] = (length, draft if len(draft) >= self.lookup_min_tokens else [])
        return plan[1]

    def draft_kind(self, seq) -> str:
        return "lookup" if self._plan(seq) else "model"

    def max_draft_tokens(self, seq) -> int:
        draft = self._plan(seq)
        return len(draft) if draft else self.model.max_draft_tokens(seq)

    def propose(self, seq, k: int) -> Proposal:
        return self.propose_batch([seq], [k])[0]

    def propose_batch(self, seqs, ks: list[int]) -> list[Proposal]:
        out = [Proposal.empty(seq.device) for seq in seqs]
        modelled = []
        for j, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            draft = self._plan(seq)
            if draft:
                out[j] = Proposal(torch.tensor(draft[:k], dtype=torch.long, device=seq.device))
                self.lookup_drafts += 1
            else:
                modelled.append(j)
        if modelled:
            before = self.model.forwards
            proposals = self.model.propose_batch([seqs[j] for j in modelled], [ks[j] for j in modelled])
            self.forwards += self.model.forwards - before
            for j, proposal in zip(modelled, proposals):
                out[j] = proposal
            self.model_drafts += len(modelled)
        return out

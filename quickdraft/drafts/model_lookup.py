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

from dataclasses import dataclass

from quickdraft.drafts.base import Proposal, Proposer
from quickdraft.drafts.draft_model import DraftModelOptions, DraftModelProposer, DraftModelState
from quickdraft.drafts.suffix import LOOKUP_MIN_TOKENS, SuffixOptions, SuffixProposer, SuffixState, lookup_else_model


@dataclass
class ModelLookupOptions(DraftModelOptions, SuffixOptions):
    """The draft model's settings (its quantization; the model is the common `model`) and the suffix lookup's."""

    def __post_init__(self) -> None:
        DraftModelOptions.__post_init__(self)
        SuffixOptions.__post_init__(self)


@dataclass
class ModelLookupState(DraftModelState):
    """The draft model's state (its cache: what the KV budget counts) and the sequence's suffix state (its doc
    and the lookup draft for its history's length)."""

    lookup: SuffixState | None = None


class ModelLookupProposer(Proposer):
    name = "model_lookup"
    options = ModelLookupOptions
    spelling = "lookup+MODEL"
    runs_a_model = True
    loads_draft_model = True

    def __init__(self, model: DraftModelProposer, lookup: SuffixProposer, lookup_min_tokens: int = LOOKUP_MIN_TOKENS):
        super().__init__()
        self.model = model
        self.lookup = lookup
        self.lookup_min_tokens = lookup_min_tokens
        self.lookup_drafts = self.model_drafts = 0  # proposals made by each source (for reports and tests)

    @classmethod
    def parse_spelling(cls, draft: str) -> dict | None:
        return {"model": draft.split("+", 1)[1]} if draft.startswith("lookup+") else None

    @classmethod
    def from_config(cls, config, context) -> "ModelLookupProposer":
        return cls(DraftModelProposer.from_config(config, context), SuffixProposer.from_options(config.options))

    # The draft model's cache is the sequence's draft state's: the KV budget counts it as draft_model's.
    @property
    def draft_runner(self):
        return self.model.draft_runner

    @property
    def draft_reads_target_tokens(self) -> bool:
        return self.model.draft_reads_target_tokens

    def draft_history(self, seq) -> list[int]:
        return self.model.draft_history(seq)

    def draft_length(self, token_ids: list[int]) -> int:
        return self.model.draft_length(token_ids)

    def unread_history(self, seq) -> int:
        return self.model.unread_history(seq)

    def new_state(self, seq, lookup: SuffixState | None = None) -> ModelLookupState:
        """A fresh model state; `lookup`: the suffix doc of a preempted sequence, which goes on."""
        model = self.model.new_state(seq)
        if lookup is not None:
            lookup.at = -1  # a rerun looks up afresh
        return ModelLookupState(model.kv_cache, model.translation,
                                lookup=lookup if lookup is not None else self.lookup.new_state(seq))

    def release(self, seq, preempted: bool = False) -> None:
        state = seq.draft_state
        if preempted:
            seq.draft_state = self.new_state(seq, state.lookup)
            return
        self.lookup.finish(state.lookup, seq)
        seq.draft_state = None

    def _plan(self, seq) -> list[int]:
        """The lookup draft for seq's current history (empty: the model drafts this step), looked up once a step."""
        draft = self.lookup.drafted(seq.draft_state.lookup, seq)
        return draft if len(draft) >= self.lookup_min_tokens else []

    def prepare(self, seqs) -> None:
        for seq in seqs:
            self._plan(seq)

    def draft_kind(self, seq) -> str:
        return "lookup" if self._plan(seq) else "model"

    def max_draft_tokens(self, seq) -> int:
        draft = self._plan(seq)
        return len(draft) if draft else self.model.max_draft_tokens(seq)

    def propose(self, seq, k: int) -> Proposal:
        return self.propose_batch([seq], [k])[0]

    def propose_batch(self, seqs, ks: list[int]) -> list[Proposal]:
        def by_model(indices: list[int]) -> list[Proposal]:
            before = self.model.forwards
            proposals = self.model.propose_batch([seqs[j] for j in indices], [ks[j] for j in indices])
            self.forwards += self.model.forwards - before
            return proposals

        out, modelled = lookup_else_model(seqs, ks, lambda j: self._plan(seqs[j]), by_model)
        self.model_drafts += len(modelled)
        self.lookup_drafts += sum(k > 0 for k in ks) - len(modelled)
        return out

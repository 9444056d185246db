"""`none`: no draft. The engine then runs plain autoregressive decoding, one target forward per token."""

from __future__ import annotations

from quickdraft.drafts.base import Proposal, Proposer


class NoDraft(Proposer):
    name = "none"
    spelling = "none"
    speculates = False

    def propose(self, seq, k: int) -> Proposal:
        return Proposal.empty(seq.device)

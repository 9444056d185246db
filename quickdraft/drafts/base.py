"""The proposer interface every draft method implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from quickdraft.drafts import SpeculativeConfig
    from quickdraft.models.base import Runner
    from quickdraft.sequence import Sequence


@dataclass
class LoadedDraft:
    runner: "Runner"
    tokenizer: Any  # None for a model object given without one
    name: str


@dataclass
class DraftContext:
    """What building a draft may need of the LLM it drafts for: the target's runner and tokenizer, and a loader
    that turns a draft model (alias, path, hub id or module, with the tokenizer given for a module) into a
    runner and its tokenizer."""

    target: "Runner"
    load_draft_model: Callable[[Any, Any], LoadedDraft]
    target_tokenizer: Any = None
    target_name: str = "target"


@dataclass
class Proposal:
    """Up to K draft tokens for one sequence.

    tokens: [k] on the target's device (k may be smaller than asked, or 0).
    probs: [k, V_target] processed draft distributions q the tokens were drawn from, or None when the
    draft is deterministic (n-gram lookup, or any draft under greedy decoding): verification then treats q
    as one-hot at each token, which is exact.
    catch_up: how many tokens of history a draft model read before drafting beyond the one or two that
    follow its previous proposal (after plain steps it re-reads what it missed: a one-off cost that adaptive
    K must not count as the price of drafting)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    catch_up: int = 0

    @staticmethod
    def empty(device: torch.device) -> "Proposal":
        return Proposal(torch.empty(0, dtype=torch.long, device=device))


class Proposer(ABC):
    """Proposes draft tokens for a sequence. State that belongs to one request (a draft KV cache) lives in
    the object returned by `new_state` and is stored on the Sequence, so proposers serve many requests."""

    name: str = "proposer"
    # How the command line's --draft names the method (help strings are built from these); "" for none.
    spelling: str = ""
    runs_a_model: bool = False  # drafts cost forwards (batched per draft position), not lookups
    # Reads the target's final hidden states (EAGLE): the engine then asks the target's forward for them and
    # hands each sequence's committed rows to `observe`.
    uses_target_features: bool = False

    def __init__(self) -> None:
        self.forwards = 0  # draft model calls, for metrics

    @classmethod
    def from_config(cls, config: "SpeculativeConfig", context: DraftContext) -> "Proposer":
        """The proposer a speculative_config asks for (the registry in drafts/__init__.py calls this)."""
        return cls()

    @property
    def draft_runner(self) -> "Runner | None":
        """The model that drafts, whose per-sequence caches (the states) hold KV memory; None for lookups."""
        return None

    @property
    def draft_reads_target_tokens(self) -> bool:
        """Whether the draft runner's caches hold the target's token ids (positions align with the target's,
        so prefix caching may share them); False for a draft with another tokenizer."""
        return True

    def draft_history(self, seq: "Sequence") -> list[int]:
        """The token ids the draft runner's cache of `seq` is keyed by (the target's history unless the draft
        has another tokenizer): what the KV budget reserves draft positions for."""
        return seq.token_ids

    def draft_length(self, token_ids: list[int]) -> int:
        """How many tokens the draft runner reads for the target tokens `token_ids` (what the KV budget checks
        a request's prompt against before it becomes a sequence)."""
        return len(token_ids)

    def new_state(self, seq: "Sequence") -> Any:
        return None

    def draft_kind(self, seq: "Sequence") -> str:
        """How `seq`'s drafts are made this step, which keys adaptive K's step costs and acceptance estimates:
        "model" (draft forwards) or "lookup" (free). Asked after max_draft_tokens; a proposer that switches per
        step (model_lookup) answers per step, so neither kind's costs or acceptance are averaged into the
        other's."""
        return "model" if self.runs_a_model else "lookup"

    def observe(self, seq: "Sequence", start: int, features: torch.Tensor) -> None:
        """The target's final hidden states [n, hidden] of seq's committed positions start..start+n-1, from the
        step's verification forward (only called when uses_target_features)."""

    def max_draft_tokens(self, seq: "Sequence") -> int:
        """The most tokens this proposer can draft for `seq` now (a draft model's context may end first)."""
        return 1 << 30

    def propose_batch(self, seqs: "list[Sequence]", ks: list[int]) -> list[Proposal]:
        """Proposals for several sequences at once, at most ks[i] tokens for seqs[i] (0: none). Model drafts
        override this to run one batched forward per draft position."""
        return [self.propose(seq, k) if k > 0 else Proposal.empty(seq.device) for seq, k in zip(seqs, ks)]

    @abstractmethod
    def propose(self, seq: "Sequence", k: int) -> Proposal:
        """Propose at most k >= 1 tokens to follow seq.token_ids."""

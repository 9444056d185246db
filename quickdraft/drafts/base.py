"""The proposer interface every draft method implements, and the options a method declares.

A method is one Proposer subclass in its own file, which says what the rest of quickdraft needs to know of it:
its `name` (speculative_config's "method"), its `options` (a DraftOptions dataclass: its own keys of the flat
speculative_config, their defaults and their validation), how the command line's `--draft` spells it
(`spelling` for help strings, `parse_spelling` to read one, `label` to write one), and how it drafts. The
registry in drafts/__init__.py lists the methods; nothing else names them.

Lifecycle of a sequence's draft state (Sequence.draft_state, a sequence.DraftState): `new_state` when the engine
makes the sequence; `prepare` once per step for the step's sequences, before the engine chooses their K;
`propose_batch`; `release` when the scheduler finishes, aborts or preempts the sequence (the engine's `run`
when its sequence ends)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

import torch

from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from quickdraft.drafts import SpeculativeConfig
    from quickdraft.token_tree import TokenTree
    from quickdraft.models.base import Runner
    from quickdraft.sequence import DraftState, Sequence


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
class DraftOptions:
    """A method's own settings: its keys of the flat, vLLM-style speculative_config (SpeculativeConfig holds the
    common ones: method, num_speculative_tokens, adaptive, acceptance, threshold, model, tokenizer).

    A method's options subclass this with fields that have defaults; `__post_init__` refuses a bad value with
    a QuickdraftError that names the key and what to give instead, and `check` what the method needs of the
    common settings (a draft model, say). Methods that share settings share the dataclass (eagle and model_lookup
    take suffix's lookup settings)."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Its speculative_config keys."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def default(cls, key: str) -> Any:
        return next(f.default for f in fields(cls) if f.name == key)

    def settings(self) -> dict[str, Any]:
        """The settings that differ from their defaults, by key."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def check(self, config: "SpeculativeConfig") -> None:
        """Refuse what the method cannot run with among the common settings (QuickdraftError); nothing here."""


def spelling_argument(draft: str, name: str) -> str | None:
    """The ARG of a --draft string spelled NAME:ARG ("" for NAME alone); None when it is spelled otherwise."""
    if draft == name:
        return ""
    return draft[len(name) + 1:] if draft.startswith(name + ":") else None


@dataclass(frozen=True)
class TreeSettings:
    """speculative_config's "tree": token trees of at most max_nodes nodes and max_depth levels per sequence
    and step ({"max_nodes": N, "max_depth": D}); auto: the engine sizes each step's tree from its measured step
    costs and per-depth acceptance, within those bounds, down to a chain or nothing ("tree": "auto")."""

    max_nodes: int = 16
    max_depth: int = 6
    auto: bool = False

    def __post_init__(self) -> None:
        for key in ("max_nodes", "max_depth"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QuickdraftError(f"speculative_config['tree']['{key}'] must be an integer >= 1, got {value!r}")
        if self.max_depth > self.max_nodes:
            raise QuickdraftError(f"speculative_config['tree']: max_depth {self.max_depth} > max_nodes "
                                  f"{self.max_nodes}; a tree of depth D has at least D nodes")
        if not isinstance(self.auto, bool):
            raise QuickdraftError(f"speculative_config['tree']['auto'] must be true or false, got {self.auto!r}")

    @classmethod
    def from_config(cls, value: Any) -> "TreeSettings | None":
        """speculative_config's "tree" as given: None (chains), "auto", {"max_nodes": N, "max_depth": D} (a key
        left out keeps its default; "auto": true sizes each step within those bounds), or a TreeSettings."""
        if value is None or isinstance(value, TreeSettings):
            return value
        if value == "auto":
            return cls(auto=True)
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"max_nodes", "max_depth", "auto"})
            if unknown:
                raise QuickdraftError(f"speculative_config['tree'] has unknown keys {unknown}; it takes max_nodes, "
                                      "max_depth and auto")
            return cls(**value)
        raise QuickdraftError(f"speculative_config['tree'] must be {{\"max_nodes\": N, \"max_depth\": D}}, \"auto\" or "
                              f"null (chains), got {value!r}")

    def to_config(self) -> "str | dict[str, Any]":
        """The JSON form from_config reads back: "auto" at the default bounds, else the bounds (and auto)."""
        if self.auto and (self.max_nodes, self.max_depth) == (TreeSettings.max_nodes, TreeSettings.max_depth):
            return "auto"
        return {"max_nodes": self.max_nodes, "max_depth": self.max_depth, **({"auto": True} if self.auto else {})}

    @property
    def spelling(self) -> str:
        """As the command line's --tree writes it: N,D or auto (auto at other bounds: auto:N,D)."""
        bounds = f"{self.max_nodes},{self.max_depth}"
        if not self.auto:
            return bounds
        return "auto" if self.to_config() == "auto" else f"auto:{bounds}"


@dataclass(frozen=True)
class TreeBudget:
    """The most nodes and levels one sequence's token tree may have this step (the engine's sizing of it), and
    the least path probability (by the draft's own estimate) a node beyond the most probable path is worth:
    "auto" sets it from the measured cost of a verification row (0: every node within the budget)."""

    max_nodes: int
    max_depth: int
    min_chance: float = 0.0


@dataclass
class Proposal:
    """Up to K draft tokens for one sequence.

    tokens: [k] on the target's device (k may be smaller than asked, or 0).
    probs: [k, V_target] processed draft distributions q the tokens were drawn from, or None when the
    draft is deterministic (n-gram lookup, or any draft under greedy decoding): verification then treats q
    as one-hot at each token, which is exact.
    catch_up: how many tokens of history a draft model read before drafting beyond the one or two that
    follow its previous proposal (after plain steps it re-reads what it missed: a one-off cost that adaptive
    K must not count as the price of drafting; it is timed per token read instead, StepCosts.record_catch_up).
    tree: None for a chain; else a token_tree.TokenTree whose nodes are `tokens` (node order, parents first)
    and whose children modes say how they were chosen; probs is then [N, V_target], node i's row the draft's
    processed distribution at its PARENT's context (what its children were drawn or ranked from), or None
    when every child is DETERMINISTIC. Only proposers asked for trees (Proposer.propose_tree) return one."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    catch_up: int = 0
    tree: "TokenTree | None" = None
    # [N] the proposer's estimate, per tree node, of the chance that the accepted path passes through it (the
    # product of draft probabilities along its path: EAGLE-2's confidence), never above its parent's; None where
    # it has none. What "tree": "auto" sizes a tree by (adaptive.choose_tree_nodes).
    scores: torch.Tensor | None = None

    def pruned(self, nodes: list[int]) -> "Proposal":
        """The proposal of a tree cut down to `nodes` (ascending, closed under parents; TokenTree.subtree)."""
        index = torch.tensor(nodes, dtype=torch.long, device=self.tokens.device)
        tree = self.tree.subtree(nodes)
        return Proposal(tree.tokens, None if self.probs is None else self.probs[index.to(self.probs.device)],
                        self.catch_up, tree, None if self.scores is None else self.scores[index.to(self.scores.device)])

    @staticmethod
    def empty(device: torch.device) -> "Proposal":
        return Proposal(torch.empty(0, dtype=torch.long, device=device))


class Proposer(ABC):
    """Proposes draft tokens for sequences. State that belongs to one request (a draft KV cache) lives in the
    DraftState that `new_state` returns and the engine stores on the Sequence, so proposers serve many
    requests; `release` ends it (see the module docstring)."""

    name: str = "proposer"
    options: type[DraftOptions] = DraftOptions  # its own speculative_config keys
    # How the command line's --draft names the method (help strings are built from these): e.g. "layers:N".
    spelling: str = ""
    # A spelling that reads any string (a draft MODEL): the registry tries it after every other method's.
    spelling_catches_all: bool = False
    speculates: bool = True  # False for `none`: K does not apply
    runs_a_model: bool = False  # drafts cost forwards (batched per draft position), not lookups
    # speculative_config's `model` names a draft model the LLM loads (alias, path, hub id or a model object).
    loads_draft_model: bool = False
    # Reads the target's final hidden states (EAGLE): the engine then asks the target's forward for them and
    # hands each sequence's committed rows to `observe`.
    uses_target_features: bool = False

    def __init__(self) -> None:
        self.forwards = 0  # draft model calls, for metrics

    # --- what the method is -------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: "SpeculativeConfig", context: DraftContext) -> "Proposer":
        """The proposer a speculative_config asks for (the registry in drafts/__init__.py calls this)."""
        return cls()

    @classmethod
    def parse_spelling(cls, draft: str) -> dict[str, Any] | None:
        """The settings a `--draft` string gives this method (the registry adds method and K), or None when the
        string is not this method's; a malformed one of its own (layers:x) is a QuickdraftError."""
        return {} if draft == cls.spelling else None

    @classmethod
    def label(cls, config: "SpeculativeConfig") -> str:
        """A config of this method as the command line's --draft names it (reports and tune's candidates)."""
        return cls.name

    # --- a sequence's draft state -------------------------------------------------------------------------
    def new_state(self, seq: "Sequence") -> "DraftState | None":
        """seq's draft state as it is made (the engine stores it as seq.draft_state)."""
        return None

    def prepare(self, seqs: "list[Sequence]") -> None:
        """Called once a step for the step's sequences before the engine chooses their K (max_draft_tokens,
        draft_kind): a lookup indexes what they committed and drafts here, once."""

    def release(self, seq: "Sequence", preempted: bool = False) -> None:
        """The scheduler is done with seq's draft state, once per event, after it gave the state's KV blocks
        back: seq finished, was aborted or failed (preempted False: seq.draft_state becomes None, and what the
        proposer keeps of the request beyond it, suffix's text, is settled now), or was preempted (it reruns
        from its whole history: a fresh state, with what outlives a KV cache carried over)."""
        seq.draft_state = self.new_state(seq) if preempted else None

    # --- drafting ---------------------------------------------------------------------------------------------
    @property
    def draft_runner(self) -> "Runner | None":
        """The model that drafts, whose per-sequence caches (the states' kv_cache) hold KV memory; None for
        lookups."""
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

    def draft_kind(self, seq: "Sequence") -> str:
        """How `seq`'s drafts are made this step, which keys adaptive K's step costs and acceptance estimates:
        "model" (draft forwards) or "lookup" (free). Asked after `prepare`; a proposer that switches per step
        (model_lookup) answers per step, so neither kind's costs or acceptance are averaged into the other's.
        A kind may name a class after a colon ("lookup:1": ngram's 1-token matches): acceptance is learned per
        class, step costs per kind (the part before the colon), as the classes' drafts cost alike."""
        return "model" if self.runs_a_model else "lookup"

    def observe(self, seq: "Sequence", start: int, features: torch.Tensor) -> None:
        """The target's final hidden states [n, hidden] of seq's committed positions start..start+n-1, from the
        step's verification forward (only called when uses_target_features)."""

    def max_draft_tokens(self, seq: "Sequence") -> int:
        """The most tokens this proposer can draft for `seq` now (a draft model's context may end first; a
        lookup's prepared draft may be shorter)."""
        return 1 << 30

    def unread_history(self, seq: "Sequence") -> int:
        """How many tokens of seq's history a draft model has not read yet: its next drafting step reads them
        first (a new prompt, or what it missed at K = 0), a one-off cost adaptive K weighs against what drafting
        can still save (adaptive.choose_k's catch_up_s). 0 for drafts that read nothing (lookups)."""
        return 0

    def propose_batch(self, seqs: "list[Sequence]", ks: list[int]) -> list[Proposal]:
        """Proposals for several sequences at once, at most ks[i] tokens for seqs[i] (0: none). Model drafts
        override this to run one batched forward per draft position."""
        return [self.propose(seq, k) if k > 0 else Proposal.empty(seq.device) for seq, k in zip(seqs, ks)]

    # Whether propose_tree can return more than a chain (the engine asks for trees only where it does).
    proposes_trees: bool = False

    def propose_tree_batch(self, seqs: "list[Sequence]", budgets: "list[TreeBudget]") -> list[Proposal]:
        """Token-tree proposals (Proposal.tree set, or a chain where the method finds one continuation) of at most
        budgets[i].max_nodes nodes and budgets[i].max_depth levels for seqs[i] (max_nodes 0: none). The default:
        a chain of max_depth tokens, today's proposal."""
        return self.propose_batch(seqs, [min(b.max_nodes, b.max_depth) for b in budgets])

    @abstractmethod
    def propose(self, seq: "Sequence", k: int) -> Proposal:
        """Propose at most k >= 1 tokens to follow seq.token_ids."""

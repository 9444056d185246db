"""`draft_model`: a smaller model proposes K tokens autoregressively, through a vocabulary mapping
(drafts/vocab_mapping.py): the target's ids, or for a draft with another tokenizer the vocabularies'
intersection (lossless too).

Each draft token is drawn from the draft's distribution processed exactly like the target's (same
penalties with the same history, temperature, top-k/p, min-p); that processed q is what verification
divides by. Under greedy decoding the draft takes its argmax and verification needs no q. A seeded request
draws with the target's position noise (sampling.position_noise), which couples the draft's draw with the
target's: they agree wherever the two distributions put their mass alike.

Asked for a token tree (propose_tree_batch), it grows an EAGLE-2 tree (drafts/trees.py DynamicTree): each level is
ONE batched draft forward over every sequence's frontier, attending as a tree (models.base.TreeAttention); the
children of a node are its most probable tokens (DETERMINISTIC: exact at every temperature without q), ranked
by the draft's processed distribution, or for a seeded request by the noise-coupled scores its draw would use.
Afterwards the draft cache keeps the committed history and the tree's most probable expanded path (compacted
after it; every other tree slot dropped): the next step's catch-up keeps what of it was accepted and reads the
rest. A grammar-constrained sequence drafts a chain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quickdraft import sampling
from quickdraft.drafts.base import DraftOptions, Proposal, Proposer, TreeBudget
from quickdraft.drafts.trees import DynamicTree, grow_trees, tree_proposal
from quickdraft.drafts.vocab_mapping import IdentityMapping, IntersectionMapping, Translation, same_vocabulary
from quickdraft.errors import QuickdraftError
from quickdraft.kv.pool import BLOCK_SIZE
from quickdraft.models.base import QUANTIZATION_SCHEMES
from quickdraft.models.base import Runner
from quickdraft.sequence import DraftState

__all__ = ["DraftModelOptions", "DraftModelProposer", "DraftModelState", "QuantizationOptions", "same_vocabulary"]


@dataclass
class QuantizationOptions(DraftOptions):
    """quantization: weight-only quantization of a draft model: int8 or q4 (4-bit codes, a scale and min per 32
    inputs, on the quantized CPU kernels; a GGUF draft's 4-bit blocks, Q4_0/Q4_1/Q4_K, stay as stored). The
    target is never quantized by this: the output stays exactly the target's."""

    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_SCHEMES:
            raise QuickdraftError(f"unknown quantization {self.quantization!r}; use one of "
                                  f"{', '.join(QUANTIZATION_SCHEMES)}")


@dataclass
class DraftModelOptions(QuantizationOptions):
    """A draft model's settings: its quantization (the model itself is speculative_config's common `model`), and
    draft_vocab_size: the draft scores only the token ids below it (None: all). Its output head is then that
    prefix of its rows, read in full every draft token: on the Qwen2.5-Coder 0.5B the head is 145 of the 392 MB
    a token streams. Lossless: the draft's q is zero at the other ids, and verification divides by that q (a
    target token there is always a rejection, never a wrong output). A byte-level BPE's lowest ids are its first
    merges, its most frequent pieces (FR-Spec, Zhao et al. 2025, ranks by corpus counts instead). Needs a draft
    with the target's tokenizer and the native runner."""

    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        size = self.draft_vocab_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise QuickdraftError(f"draft_vocab_size must be a positive number of token ids (or None for all), "
                                  f"got {size!r}")

    def check(self, config) -> None:
        if not config.model:
            raise QuickdraftError(f"method '{config.method}' needs a draft model: set speculative_config['model']")


@dataclass
class DraftModelState(DraftState):
    """A sequence's draft model cache, and its history translated into draft tokens (None: the draft reads the
    target's ids)."""

    kv_cache: Any = None  # the draft runner's SequenceCache
    translation: Translation | None = None
    # The draft history length and depth of the token tree proposed last (None: a chain), whose accepted path
    # the next step may read again (where it left the tree's kept path): not a catch-up.
    tree_at: int | None = None
    tree_depth: int = 0

    @property
    def nbytes(self) -> int:
        return self.kv_cache.nbytes


class DraftModelProposer(Proposer):
    name = "draft_model"
    options = DraftModelOptions
    spelling = "a draft MODEL"
    spelling_catches_all = True
    runs_a_model = True
    loads_draft_model = True
    proposes_trees = True

    def __init__(self, runner: Runner, target_vocab_size: int,
                 mapping: IdentityMapping | IntersectionMapping | None = None):
        super().__init__()
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        self.mapping = mapping if mapping is not None else IdentityMapping(target_vocab_size)

    @classmethod
    def parse_spelling(cls, draft: str) -> dict[str, Any]:
        return {"model": draft}

    @classmethod
    def label(cls, config) -> str:
        model = config.model
        name = model if isinstance(model, str) else type(model).__name__
        quantization = config.options.quantization
        return f"{name} ({quantization})" if quantization else name

    @classmethod
    def from_config(cls, config, context) -> "DraftModelProposer":
        draft = context.load_draft_model(config.model, config.tokenizer)
        quantization, vocab = config.options.quantization, config.options.draft_vocab_size
        runner = draft.runner.quantized(quantization) if quantization else draft.runner
        if same_vocabulary(context.target_tokenizer, draft.tokenizer, context.target_name, draft.name):
            if vocab is not None:
                runner = runner.with_vocabulary(min(vocab, runner.vocab_size))
            return cls(runner, context.target.vocab_size)
        if vocab is not None:
            raise QuickdraftError(f"draft_vocab_size needs a draft with the target's tokenizer; {draft.name}'s differs "
                                  "(it drafts over the two vocabularies' intersection): drop draft_vocab_size")
        # Another tokenizer: drafting over the vocabularies' intersection keeps verification exact.
        return cls(runner, context.target.vocab_size, IntersectionMapping(
            context.target_tokenizer, draft.tokenizer, context.target.vocab_size, draft.runner.vocab_size))

    @property
    def draft_runner(self) -> Runner:
        return self.runner

    @property
    def draft_reads_target_tokens(self) -> bool:
        return self.mapping.reads_target_tokens

    def new_state(self, seq) -> DraftModelState:
        cache = self.runner.new_cache()
        # A rough length (another tokenizer counts otherwise) plus a step's drafts: grown past it if need be.
        cache.length_hint = seq.max_length + BLOCK_SIZE
        return DraftModelState(cache, self.mapping.new_translation())

    def draft_history(self, seq) -> list[int]:
        return self.mapping.history(seq, seq.draft_state.translation)

    def draft_length(self, token_ids: list[int]) -> int:
        return self.mapping.draft_length(token_ids)

    def max_draft_tokens(self, seq) -> int:
        # Drafting k tokens feeds the history and k - 1 drafts through the draft model. A history that translates
        # to no draft token at all (only special tokens the draft lacks) gives it nothing to read: no drafts.
        history = self.draft_history(seq)
        return self.runner.max_len - len(history) + 1 if history else 0

    def unread_history(self, seq) -> int:
        # The cache may also hold a few rejected drafts; the count is then short by at most K tokens.
        state = seq.draft_state
        return 0 if state is None else max(0, len(self.draft_history(seq)) - len(state.kv_cache))

    def propose(self, seq, k: int) -> Proposal:
        return self.propose_batch([seq], [k])[0]

    def _catch_up_feed(self, seq) -> tuple[torch.Tensor, int]:
        """What seq's draft cache lacks of its draft history (at least its last token, whose logits the first
        draft needs), fed in the first draft forward, and how many of those tokens are catch-up: beyond what
        the previous proposal's step adds (the bonus and maybe a chain's last draft, or a tree's accepted path
        and its bonus)."""
        state, history = seq.draft_state, self.draft_history(seq)
        cache = state.kv_cache
        start = cache.sync(history)
        if start == len(history):  # everything is cached: recompute the last position for its logits
            start -= 1
            cache.rollback(start)
        follow = 2  # a chain's step reads the bonus and maybe its last draft
        if state.tree_at is not None:
            follow = max(follow, min(len(history) - state.tree_at, state.tree_depth + 1))
            state.tree_at = None
        return torch.tensor(history[start:], dtype=torch.long, device=self.runner.device), \
            max(0, len(history) - start - follow)

    def _draft_logits(self, caches, feeds: list[torch.Tensor], num_logits: list[int], trees=None) -> torch.Tensor:
        """One batched draft forward; its logits over the target's vocabulary."""
        if trees is None:
            logits = self.runner.forward_batch(caches, feeds, num_logits)
        else:
            logits = self.runner.forward_batch(caches, feeds, num_logits, trees=trees)
        self.forwards += 1
        return self.mapping.to_target_logits(logits)

    def propose_batch(self, seqs, ks: list[int]) -> list[Proposal]:
        """k_i tokens for each sequence, autoregressively: draft position i is ONE batched draft forward over
        every sequence still drafting (the first also reads what each draft cache lacks of its history)."""
        ks = list(ks)  # a sequence's draft may end early (below)
        active = [j for j, k in enumerate(ks) if k > 0]
        feeds, catch_ups, tokens, probs = {}, {}, {}, {}
        for j in active:
            seq = seqs[j]
            feeds[j], catch_ups[j] = self._catch_up_feed(seq)
            tokens[j] = torch.empty(ks[j], dtype=torch.long, device=seq.device)
            probs[j] = torch.empty(ks[j], self.target_vocab_size, device=seq.device) if seq.needs_draft_probs \
                else None
        # A draft that scores part of the target's vocabulary (a prefix, or another tokenizer's intersection) may
        # find every token a grammar allows outside it: that sequence's draft ends there (q would be all zero).
        partial = self.runner.vocab_size < self.target_vocab_size or not self.mapping.reads_target_tokens
        for i in range(max(ks, default=0)):
            rows = [j for j in active if ks[j] > i]
            if not rows:
                break
            logits = self._draft_logits([seqs[j].draft_state.kv_cache for j in rows], [feeds[j] for j in rows],
                                        [1] * len(rows))  # [len(rows), V_target]
            for row, j in enumerate(rows):
                seq = seqs[j]
                processed = seq.process(logits[row: row + 1].to(seq.device), tokens[j][:i], first_row=i)
                if partial and seq.grammar is not None and not bool(torch.isfinite(processed).any()):
                    ks[j], tokens[j] = i, tokens[j][:i]
                    probs[j] = probs[j][:i] if probs[j] is not None else None
                    continue
                if seq.noise_key is not None:
                    log_noise = seq.log_noise(len(seq.output_ids) + i, 1, processed.shape[-1])
                    token = sampling.scores_with_log_noise(processed, log_noise).argmax(-1)
                else:
                    token = sampling.sample(processed, seq.params, seq.generator)
                tokens[j][i] = token[0]
                if probs[j] is not None:
                    probs[j][i] = processed[0]
                feeds[j] = self.mapping.to_draft_tokens(token.reshape(1)).to(self.runner.device)
        return [Proposal(tokens[j], probs[j], catch_ups[j]) if ks[j] > 0 else Proposal.empty(seqs[j].device)
                for j in range(len(seqs))]

    def propose_tree_batch(self, seqs, budgets: list[TreeBudget]) -> list[Proposal]:
        """An EAGLE-2 tree for each sequence within its budget (module docstring): level 0 reads what each draft
        cache lacks (plain rows) and gives the root's children; level d writes the depth-d frontier as tree rows
        and gives their children; every level is one forward over all sequences. A grammar-constrained
        sequence drafts a chain of min(max_nodes, max_depth) tokens instead."""
        out = [Proposal.empty(seq.device) for seq in seqs]
        # The levels the draft's context leaves (a tree of depth d feeds d - 1 levels, as a chain of d tokens).
        depth = [min(b.max_nodes, b.max_depth, self.max_draft_tokens(seq)) if b.max_nodes > 0 else 0
                 for seq, b in zip(seqs, budgets)]
        chains = [j for j, seq in enumerate(seqs) if depth[j] > 0 and seq.grammar is not None]
        grown = [j for j, seq in enumerate(seqs) if depth[j] > 0 and seq.grammar is None]
        if chains:
            for j, proposal in zip(chains, self.propose_batch([seqs[j] for j in chains], [depth[j] for j in chains])):
                out[j] = proposal
        if not grown:
            return out
        caches = {j: seqs[j].draft_state.kv_cache for j in grown}
        feeds, catch_ups = {}, {}
        for j in grown:
            feeds[j], catch_ups[j] = self._catch_up_feed(seqs[j])
        trees = {j: DynamicTree(len(caches[j]) + len(feeds[j]), budgets[j].max_nodes, depth[j],
                                self.runner.max_len - len(caches[j]) - len(feeds[j]),
                                min_chance=budgets[j].min_chance) for j in grown}
        logits = self._draft_logits([caches[j] for j in grown], [feeds[j] for j in grown], [1] * len(grown))

        def forward_level(rows: list[int]) -> torch.Tensor:  # the frontiers as tree rows of one draft forward
            frontier = [torch.tensor([trees[j].tokens[n] for n in trees[j].frontier], dtype=torch.long) for j in rows]
            return self._draft_logits([caches[j] for j in rows],
                                      [self.mapping.to_draft_tokens(t).to(self.runner.device) for t in frontier],
                                      [len(t) for t in frontier], trees=[trees[j].attention() for j in rows])

        grow_trees(seqs, trees, logits, max(depth[j] for j in grown), forward_level)
        for j in grown:
            tree, state = trees[j], seqs[j].draft_state
            # The draft cache keeps the tree's most probable expanded path (its keys are those of the path's
            # tokens in a line), every other tree slot dropped: where verification accepts that path, the next
            # step's catch-up (cache.sync) reads only the bonus token instead of re-feeding the path. Measured on
            # the Qwen pair, a chain-shaped tree drafted ~10 ms a step slower than the chain when every tree
            # slot was dropped (the next step fed up to depth + 1 rows).
            caches[j].compact(tree.base, [tree.base + slot for slot in tree.top_path_slots()])
            state.tree_at, state.tree_depth = tree.base, max((tree.depth[n] for n in tree.best()), default=0)
            out[j] = tree_proposal(tree, seqs[j].device, catch_ups[j])
        return out

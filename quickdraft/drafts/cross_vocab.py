"""A draft model with another tokenizer than the target's, lossless: Token-Level Intersection (TLI; Timor et al.,
"Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies",
ICML 2025).

Tokens are compared by the bytes they stand for (a byte-level BPE's "Ġthe", a SentencePiece "▁the" and a
plain " the" are the same token). The draft proposes only tokens of the intersection of the two vocabularies:
its logits are kept on the intersection, moved to the target's ids, and processed there like the target's
(penalties with the target's history, temperature, top-k/p, min-p), so that the distribution q a token is
drawn from is a distribution over the target's vocabulary, zero outside the intersection. Verification is the
usual rejection sampling with that q (or greedy matching): the output follows the target's law exactly, as
with a same-tokenizer draft. What differs is the draft's context: the target's committed tokens are
translated into draft tokens one by one (an intersection token to its counterpart; any other token to the
longest-match draft tokens of its bytes; special tokens to the draft's special token of the same text, or to
nothing), incrementally, so a step costs the draft only the new tokens, as with a same-tokenizer draft.

The draft's cache is keyed by those draft tokens, not by the target's: its positions do not align with the
target's (prefix caching leaves it out; the KV budget reserves its own length).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.errors import QuickdraftError
from quickdraft.models.base import Runner
from quickdraft.token_bytes import token_bytes

def _by_bytes(table: dict[int, bytes], fallback: set[int], limit: int) -> dict[bytes, int]:
    """One id per byte string (ids < limit, the model's rows): a regular piece before a byte-fallback token of
    the same byte, then the lowest id."""
    best: dict[bytes, tuple[bool, int]] = {}
    for token_id, raw in table.items():
        if token_id >= limit or not raw:
            continue
        key = (token_id in fallback, token_id)
        if raw not in best or key < best[raw]:
            best[raw] = key
    return {raw: token_id for raw, (_, token_id) in best.items()}


class VocabMapping:
    """The two vocabularies' intersection and the translation of target tokens into draft tokens.

    target_ids / draft_ids: [n] the intersection, target_ids[i] and draft_ids[i] standing for the same bytes.
    target_to_draft: [V_target] the draft id of an intersection token, -1 elsewhere."""

    def __init__(self, target_tokenizer: Any, draft_tokenizer: Any, target_vocab_size: int, draft_vocab_size: int):
        target_table, target_fallback, target_special = token_bytes(target_tokenizer)
        draft_table, draft_fallback, draft_special = token_bytes(draft_tokenizer)
        target_by_bytes = _by_bytes(target_table, target_fallback, target_vocab_size)
        self.draft_by_bytes = _by_bytes(draft_table, draft_fallback, draft_vocab_size)
        common = sorted(set(target_by_bytes) & set(self.draft_by_bytes))
        if not common:
            raise QuickdraftError("the draft's and the target's vocabularies share no token; a draft with another "
                                  "tokenizer drafts over their intersection, which is empty here")
        self.target_ids = torch.tensor([target_by_bytes[raw] for raw in common], dtype=torch.long)
        self.draft_ids = torch.tensor([self.draft_by_bytes[raw] for raw in common], dtype=torch.long)
        self.target_vocab_size, self.draft_vocab_size = target_vocab_size, draft_vocab_size
        self.target_to_draft = torch.full((target_vocab_size,), -1, dtype=torch.long)
        self.target_to_draft[self.target_ids] = self.draft_ids
        self._direct = dict(zip(self.target_ids.tolist(), self.draft_ids.tolist()))
        self._target_table = target_table
        self._special = {target_special[text]: draft_special[text] for text in target_special
                         if text in draft_special and draft_special[text] < draft_vocab_size}
        self._longest = max(map(len, self.draft_by_bytes))
        self._translated: dict[int, tuple[int, ...]] = {}

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    def _longest_match(self, raw: bytes) -> tuple[int, ...]:
        """Draft tokens for a byte string, longest match first (bytes no draft token covers are skipped)."""
        out, start = [], 0
        while start < len(raw):
            for end in range(min(len(raw), start + self._longest), start, -1):
                token_id = self.draft_by_bytes.get(raw[start:end])
                if token_id is not None:
                    out.append(token_id)
                    start = end
                    break
            else:
                start += 1
        return tuple(out)

    def translate(self, target_token: int) -> tuple[int, ...]:
        """The draft tokens one target token reads as."""
        cached = self._translated.get(target_token)
        if cached is None:
            if target_token in self._direct:
                cached = (self._direct[target_token],)
            elif target_token in self._special:
                cached = (self._special[target_token],)
            else:
                cached = self._longest_match(self._target_table.get(target_token, b""))
            self._translated[target_token] = cached
        return cached

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[R, V_draft] -> [R, V_target]: the intersection's logits at the target's ids, -inf elsewhere."""
        out = torch.full((draft_logits.shape[0], self.target_vocab_size), float("-inf"), dtype=draft_logits.dtype,
                         device=draft_logits.device)
        if self.draft_ids.device != draft_logits.device:
            self.draft_ids, self.target_ids = self.draft_ids.to(draft_logits.device), self.target_ids.to(draft_logits.device)
        out[:, self.target_ids] = draft_logits[:, self.draft_ids]
        return out


class _Translation:
    """One sequence's target history translated so far: the draft tokens of its first `covered` tokens."""

    __slots__ = ("covered", "draft_ids", "__weakref__")

    def __init__(self) -> None:
        self.covered = 0
        self.draft_ids: list[int] = []


class CrossVocabDraftProposer(DraftModelProposer):
    """`draft_model` with a draft of another tokenizer (see the module doc)."""

    def __init__(self, runner: Runner, target_vocab_size: int, mapping: VocabMapping):
        super().__init__(runner, target_vocab_size)
        self.mapping = mapping
        # Per sequence, its translated history; dropped with the sequence.
        self._translations: "weakref.WeakKeyDictionary[Any, _Translation]" = weakref.WeakKeyDictionary()

    @property
    def draft_reads_target_tokens(self) -> bool:
        return False

    def draft_history(self, seq) -> list[int]:
        history = seq.token_ids
        state = self._translations.get(seq)
        if state is None or state.covered > len(history):
            state = self._translations[seq] = _Translation()
        for token in history[state.covered:]:
            state.draft_ids.extend(self.mapping.translate(token))
        state.covered = len(history)
        return state.draft_ids

    def draft_length(self, token_ids: list[int]) -> int:
        return sum(len(self.mapping.translate(token)) for token in token_ids)

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return self.mapping.to_target_logits(logits)

    def _to_draft_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.mapping.target_to_draft
        if table.device != tokens.device:
            table = self.mapping.target_to_draft = table.to(tokens.device)
        return table[tokens]

    def max_draft_tokens(self, seq) -> int:
        # A history that translates to no draft token at all (only special tokens the draft lacks) gives the
        # draft nothing to read: no drafts until it does.
        history = self.draft_history(seq)
        return self.runner.max_len - len(history) + 1 if history else 0

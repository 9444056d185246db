"""Structured outputs (a JSON schema, a regex, a choice of strings, a grammar) on llguidance, exact under
speculation.

The constrained law is plain constrained decoding's: at every position the target's logits outside the
grammar's allowed tokens are -inf before any other processing. Under speculation the same mask applies to
the target's row of each verified position and to the draft's row of each drafted one (both computed at the
grammar state after the same tokens), a drafted token that leaves the grammar ends the draft before
verification, and verification is the usual exact test: the output follows the target's constrained law
(tests/test_structured.py checks the joint law on a tiny model). Masks are computed once per state and kept
while the state's tokens stay (a step's drafts and its verification ask for the same states).

Why llguidance: it needs no other package (xgrammar pulls triton on Linux, outlines-core builds its index per
schema ahead of time), validates a draft in one call, rolls back rejected tokens, and computes a mask over a
150k-token vocabulary in tens of microseconds (measured in benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
from typing import Any

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.params import StructuredOutputs
from quickdraft.token_bytes import decoder_kinds, token_bytes

__all__ = ["StructuredOutputs", "GrammarState", "compile_matcher", "grammar_text", "grammar_tokenizer", "masked_rows"]

def grammar_text(constraint: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint."""
    import llguidance

    if constraint.json is not None:
        schema = json.loads(constraint.json) if isinstance(constraint.json, str) else constraint.json
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if constraint.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if constraint.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if constraint.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(list(constraint.choice)))
    return llguidance.grammar_from("grammar", constraint.grammar)


def _byte_table_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]):
    """An llguidance tokenizer from the bytes each token stands for (quickdraft's own table, which reads
    byte-level, SentencePiece and plain vocabularies): for tokenizers llguidance's HF reader does not take.
    A model without an EOS token gets a virtual one past its vocabulary (never allowed by its logits)."""
    import llguidance

    table, _, special = token_bytes(tokenizer)
    names = {token_id: text for text, token_id in special.items()}
    eos = eos_ids or [vocab_size]
    size = max(vocab_size, max(eos) + 1)
    by_bytes = {raw: token_id for token_id, raw in sorted(table.items(), reverse=True) if raw and token_id < size}
    longest = max(map(len, by_bytes), default=1)

    class _Tokens:
        eos_token_id = eos[0]
        bos_token_id = None
        tokens = [table.get(i, b"\xff[" + names.get(i, str(i)).encode() + b"]") for i in range(size)]
        special_token_ids = sorted(set(names) | set(eos) | {i for i in range(size) if i not in table})

        def __call__(self, text: str | bytes) -> list[int]:
            # Longest match over the table: the model's own tokenizer maps text it has no word for to <unk>,
            # which llguidance would read as standing for that text.
            raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
            out, start = [], 0
            while start < len(raw):
                for end in range(min(len(raw), start + longest), start, -1):
                    if raw[start:end] in by_bytes:
                        out.append(by_bytes[raw[start:end]])
                        start = end
                        break
                else:
                    start += 1  # a byte no token covers
            return out

    # A vocabulary without single-byte tokens (word-level) takes open grammars (a regex under *), but llguidance
    # fails finite ones on it ("NoExtensionBias"): compile_matcher reports that as a refusal.
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens()), n_vocab=size, eos_token=eos)


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: set[int]):
    """The llguidance tokenizer of a model (built once per LLM: about a second for a large vocabulary)."""
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise QuickdraftError("structured outputs need llguidance: pip install llguidance") from None
    if tokenizer is None:
        raise QuickdraftError("structured outputs need the model's tokenizer; this model has none")
    eos = sorted(t for t in eos_ids if t < vocab_size)
    # llguidance reads byte-level BPE and SentencePiece tokenizers itself; a plain one (word-level, a decoder
    # it does not know) it can misread, so those go through quickdraft's own byte table.
    if eos and decoder_kinds(tokenizer) & {"byte_level", "metaspace", "byte_fallback"}:
        try:
            return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except (ValueError, TypeError, AttributeError):
            pass
    return _byte_table_tokenizer(tokenizer, vocab_size, eos)


def compile_matcher(grammar_tokenizer_: Any, constraint: StructuredOutputs):
    """An llguidance matcher for `constraint`, or a QuickdraftError naming what is wrong with it."""
    import llguidance

    try:
        text = grammar_text(constraint)
    except (ValueError, json.JSONDecodeError) as exc:
        raise QuickdraftError(f"structured_outputs: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, grammar_tokenizer_)
    if is_error:
        raise QuickdraftError(f"structured_outputs: the grammar is invalid: {messages[0] if messages else ''}")
    matcher = llguidance.LLMatcher(grammar_tokenizer_, text, log_level=0)
    matcher.compute_bitmask()  # some failures show only once the first mask is asked for
    if matcher.is_error():
        raise QuickdraftError(f"structured_outputs: the constraint cannot be matched with this model's tokens: "
                              f"{matcher.get_error().splitlines()[0][:300]}")
    return matcher


class GrammarState:
    """One sequence's grammar: an llguidance matcher positioned on some output tokens, and the allowed-token
    mask of each state it has been at while those tokens stay.

    blocked(tokens): the tokens the grammar refuses after the output tokens `tokens` (a bool [V], True =
    refused), or None when `tokens` leave the grammar. valid_prefix(output, draft): how many of `draft` the grammar takes after
    `output`. Both move the matcher to the tokens asked for (rolling back what differs), so the draft, the
    verification and the next step can ask in any order."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed: list[int] = []  # the output tokens the matcher has taken
        self._masks: list[torch.Tensor | None] = [None]  # masks[i]: after consumed[:i]

    def _sync(self, tokens: list[int]) -> bool:
        """Move the matcher to the state after `tokens`; False when they leave the grammar (the matcher then
        stands at their longest valid prefix)."""
        common = 0
        limit = min(len(tokens), len(self.consumed))
        while common < limit and tokens[common] == self.consumed[common]:
            common += 1
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
            del self._masks[common + 1:]
        for token in tokens[common:]:
            if self.matcher.is_stopped() or not self.matcher.consume_token(token):
                if self.matcher.is_error():
                    raise QuickdraftError(f"structured outputs: the grammar matcher failed: {self.matcher.get_error()}")
                return False
            self.consumed.append(token)
            self._masks.append(None)
        return True

    def blocked(self, tokens: list[int]) -> torch.Tensor | None:
        if not self._sync(tokens):
            return None
        cached = self._masks[len(tokens)]
        if cached is None:
            import numpy as np

            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            refused = np.unpackbits(bits, bitorder="little")[: self.vocab_size] == 0
            cached = self._masks[len(tokens)] = torch.from_numpy(refused)
        return cached

    def stopped(self, tokens: list[int]) -> bool:
        """Whether the grammar takes no more after `tokens`: it is complete (only EOS would follow), or none
        of the model's tokens continues it (a dead end, which no row may be sampled at)."""
        if not self._sync(tokens):
            return False
        if self.matcher.is_stopped():
            return True
        blocked = self.blocked(tokens)
        return blocked is not None and bool(blocked.all())

    def valid_prefix(self, output: list[int], draft: list[int]) -> int:
        if not draft or not self._sync(output):
            return 0
        return int(self.matcher.validate_tokens(draft))

    def copy(self) -> "GrammarState":
        """A fresh state over a copy of the matcher at its start (the n completions of one request)."""
        matcher = self.matcher.deep_copy()
        matcher.reset()
        return GrammarState(matcher, self.vocab_size)


def masked_rows(logits: torch.Tensor, blocked: list[torch.Tensor | None]) -> torch.Tensor:
    """logits [n, V] with -inf where row j's `blocked[j]` ([V] bool) is True; a None row is left as it is (a
    state outside the grammar, which verification never reaches: drafts are cut before it)."""
    rows = [b if b is not None else torch.zeros(logits.shape[-1], dtype=torch.bool) for b in blocked]
    return logits.masked_fill(torch.stack(rows).to(logits.device), float("-inf"))

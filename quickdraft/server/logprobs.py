"""Log-probabilities in OpenAI's two wire formats, from the engine's per-token entries ({token id: Logprob},
the chosen token's and its alternatives'): the legacy completions object (tokens, token_logprobs,
top_logprobs, text_offset) and chat's content list (token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

from typing import Callable

from quickdraft.sequence import PositionLogprobs
from quickdraft.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

# The text a token adds after the token before it (None: nothing before it). Decoding a token alone drops a
# SentencePiece token's leading space and a word-level tokenizer's separator; with the token before, it does not.
TokenText = Callable[[int | None, int], str]


def _alternatives(entry: PositionLogprobs, top: int) -> list[tuple[int, float]]:
    """The `top` most likely tokens of a position, most likely first (the chosen token only if among them)."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(token, logprob.logprob) for token, logprob in ranked if logprob.rank <= top][:top]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def completion_logprobs(token_ids: list[int], entries: list[PositionLogprobs | None], top: int, text: TokenText,
                        before: int | None = None, offset: int = 0,
                        into: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Append token_ids' log-probabilities to `into` (a new object by default): `before` is the token before
    the first (None: none), offsets start at `offset`, the length of the choice text before these tokens."""
    out = into or CompletionLogprobs()
    for token, entry in zip(token_ids, entries):
        piece = text(before, token)
        out.tokens.append(piece)
        out.text_offset.append(offset)
        offset += len(piece)
        if entry is None:  # an echoed prompt's first token: nothing scored it
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(entry[token].logprob)
            out.top_logprobs.append({text(before, t): lp for t, lp in _alternatives(entry, top)} if top else {})
        before = token
    return out


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], top: int, text: TokenText,
                  before: int | None = None) -> ChatLogprobs:
    content = []
    for token, entry in zip(token_ids, entries):
        piece = text(before, token)
        alternatives = [TopLogprob(token=alt, logprob=lp, bytes=_bytes(alt))
                        for alt, lp in ((text(before, t), lp) for t, lp in _alternatives(entry, top))]
        content.append(ChatTokenLogprob(token=piece, logprob=entry[token].logprob, bytes=_bytes(piece),
                                        top_logprobs=alternatives))
        before = token
    return ChatLogprobs(content=content)

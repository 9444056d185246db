"""Incremental detokenization of one sequence, with stop strings.

vLLM semantics: the text ends before the stop string (after it with include_stop_str_in_output) and the
token ids end with the token that completed it. A stop string counts once it ends in the text a token
added; when one token completes several, the first of the stop list wins (vLLM's `check_stop_strings`).

A speculative step commits several tokens at once. `Detokenizer.update` replays them one at a time, so the
text, the tokens kept and the finish reason are exactly those of decoding one token per step: the stop
string that completes first ends the output, not the one that starts first.

A request without stop strings cannot be ended by its text, so its text need not be made on the engine's step
(vLLM detokenizes in another process): `Detokenizer.defer` takes the step's tokens and returns a `TextDelta`
whose text is decoded when it is first read (a server's event loop reads it; `generate` reads only the final
text), in the order the steps came, so what a stream shows is exactly what eager decoding shows.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.sequence import Sequence

_PARTIAL = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 character at the end of the text to


def _stable_length(text: str) -> int:
    """Length of the text that later tokens cannot change: all but a trailing incomplete UTF-8 character."""
    return len(text.rstrip(_PARTIAL))


def find_stop(previous: str, text: str, stop_list: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the stop string that the step from `previous` to `text` (one token) completed,
    or None. Only occurrences ending after the stable part of `previous` count (older ones would have
    stopped an earlier step); of several, the first in `stop_list` wins, at its first such occurrence."""
    stable = _stable_length(previous)
    for stop in stop_list:
        index = text.find(stop, max(0, stable - len(stop) + 1))
        if index >= 0:
            return index, stop
    return None


class TextDelta:
    """The text one step added to a sequence's stream, decoded when first read (`str(delta)` or `.text`):
    reading it decodes every earlier step of the sequence not read yet first, so deltas come out in step order
    whichever is read first (an earlier one read later is then empty: its text went out with the later one)."""

    __slots__ = ("_detokenizer", "upto", "finished", "_text")

    def __init__(self, detokenizer: "Detokenizer", upto: int, finished: bool):
        self._detokenizer, self.upto, self.finished = detokenizer, upto, finished
        self._text: str | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._detokenizer._render(self)
        return self._text

    def __str__(self) -> str:
        return self.text


@dataclass
class Detokenizer:
    """Incremental text for one sequence, with stop-string handling (see the module docstring)."""

    tokenizer: Any
    params: SamplingParams
    sent: int = 0  # characters already handed to a stream
    stop_reason: str | None = None  # the stop string that ended the text
    _text: str = ""
    _hold: int = field(init=False, default=0)
    _ids: list[int] = field(init=False, default_factory=list)  # the deferred tokens (defer)
    _pending: deque = field(init=False, default_factory=deque)  # TextDeltas not decoded yet, in step order
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    # Whether the text must be made as the tokens commit: stop strings end the sequence by its text. (Read for
    # every sequence every step: kept, not derived from params then.)
    eager: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.eager = bool(self.params.stop_list)
        if self.tokenizer is None and self.params.stop_list:
            raise QuickdraftError(
                f"stop strings {self.params.stop_list!r} need a tokenizer to find them in the text, and this "
                "model has none: pass stop_token_ids (the token ids to stop at) instead of stop, or load the "
                "model with a tokenizer")
        # A stop string may be split over steps: hold back what could be its beginning, which the text loses
        # if the stop string completes. With the stop string kept in the text nothing sent can be cut.
        if self.params.include_stop_str_in_output:
            self._hold = 0
        else:
            self._hold = max((len(s) for s in self.params.stop_list), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    @property
    def text(self) -> str:
        """The whole text so far (every deferred step decoded)."""
        if self._pending:
            self._render(None)
        return self._text

    def defer(self, token_ids: list[int], finished: bool) -> TextDelta | str:
        """A step's new tokens of a sequence without stop strings; its text is decoded when read (TextDelta)."""
        if self.tokenizer is None:
            return ""
        with self._lock:
            self._ids.extend(token_ids)
            delta = TextDelta(self, len(self._ids), finished)
            self._pending.append(delta)
        return delta

    def _render(self, until: TextDelta | None) -> None:
        """Decode the deferred steps up to `until` (None: all): the earlier ones' deltas are empty, `until`'s is
        everything since the last delta read (held back: a trailing incomplete UTF-8 character, until the
        sequence finishes)."""
        with self._lock:
            if until is not None and until._text is not None:
                return
            last = None
            while self._pending:
                last = self._pending.popleft()
                last._text = ""
                if last is until:
                    break
            if last is None:
                return
            text = self._decode(self._ids[:last.upto])
            self._text = text
            safe = len(text) if last.finished else _stable_length(text)
            if safe > self.sent:
                last._text, self.sent = text[self.sent: safe], safe

    def update(self, seq: Sequence, num_new: int) -> str:
        """Take the sequence's latest `num_new` tokens; truncate and finish it on a stop string; return the
        new text that is safe to show."""
        if self.tokenizer is None:
            return ""
        ids = seq.output_ids
        stop_list = self.params.stop_list
        if not stop_list:
            text = self._decode(ids)
        else:
            # One token at a time, as plain decoding would see them: the first token that completes a stop
            # string ends the output.
            text = self._text
            end = len(ids)
            for keep in range(end - num_new + 1, end + 1):
                previous, text = text, self._decode(ids[:keep])
                hit = find_stop(previous, text, stop_list)
                if hit is not None:
                    index, stop = hit
                    seq.truncate_output(keep, "stop")
                    self.stop_reason = stop
                    text = text[: index + (len(stop) if self.params.include_stop_str_in_output else 0)]
                    break
        self._text = text
        # Hold back what a stop string could still cut, and an incomplete UTF-8 character; all once finished.
        safe = len(text) if seq.finished else _stable_length(text) - self._hold
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent: safe], safe
        return delta

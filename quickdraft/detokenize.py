"""Incremental detokenization of one sequence, with stop strings.

vLLM semantics: the text ends before the stop string (after it with include_stop_str_in_output) and the
token ids end with the token that completed it. A stop string counts once it ends in the text a token
added; when one token completes several, the first of the stop list wins (vLLM's `check_stop_strings`).

A speculative step commits several tokens at once. `Detokenizer.update` replays them one at a time, so the
text, the tokens kept and the finish reason are exactly those of decoding one token per step: the stop
string that completes first ends the output, not the one that starts first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quickdraft.engine import Sequence
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams

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


@dataclass
class Detokenizer:
    """Incremental text for one sequence, with stop-string handling (see the module docstring)."""

    tokenizer: Any
    params: SamplingParams
    text: str = ""
    sent: int = 0  # characters already handed to a stream
    stop_reason: str | None = None  # the stop string that ended the text
    _hold: int = field(init=False, default=0)

    def __post_init__(self) -> None:
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
            text = self.text
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
        self.text = text
        # Hold back what a stop string could still cut, and an incomplete UTF-8 character; all once finished.
        safe = len(text) if seq.finished else _stable_length(text) - self._hold
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent: safe], safe
        return delta

"""SamplingParams: what a request asks of the sampler, validated on construction (vLLM's names), and the
StructuredOutputs constraint it may carry (compiled by quickdraft.structured)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from quickdraft.errors import QuickdraftError

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite int or float (not a bool, not nan or inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's StructuredOutputsParams names): exactly one of a JSON schema
    (`json`: a dict or its JSON text), a `regex`, a `choice` of strings, a `grammar` (Lark or GBNF), or
    `json_object` (any JSON object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise QuickdraftError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                                  f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise QuickdraftError("structured_outputs json must be a JSON schema (a dict or its JSON text)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise QuickdraftError("structured_outputs regex must be a string")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise QuickdraftError("structured_outputs choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise QuickdraftError("structured_outputs grammar must be a string (Lark or GBNF)")
        if not isinstance(self.json_object, bool):
            raise QuickdraftError("structured_outputs json_object must be true or false")

    @staticmethod
    def of(value: "StructuredOutputs | dict[str, Any]") -> "StructuredOutputs":
        if isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, dict):
            raise QuickdraftError(f"structured_outputs must be a StructuredOutputs or a dict with one of "
                                  f"{', '.join(STRUCTURED_KINDS)}, got {type(value).__name__}")
        unknown = sorted(set(value) - set(STRUCTURED_KINDS))
        if unknown:
            raise QuickdraftError(f"structured_outputs has unknown fields {unknown}; use one of {', '.join(STRUCTURED_KINDS)}")
        return StructuredOutputs(**value)


@dataclass
class SamplingParams:
    """How to sample one request. `temperature=0` means greedy.

    Penalties follow vLLM: `repetition_penalty` scales the logits of every token seen in the prompt or the
    output; `presence_penalty` and `frequency_penalty` subtract from the logits of tokens in the output.
    Under speculation every position is processed with the history that precedes it, draft tokens
    included, so all of them are exact.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as in vLLM) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    # quickdraft's own: at most this many draft tokens per step for this request (0: no speculation for it,
    # e.g. a creative high-temperature request where drafts are rarely accepted); None: the engine's K.
    num_speculative_tokens: int | None = None
    # Log-probabilities (vLLM's names): per output token, the target's log-probability of the token and of its
    # `logprobs` most likely alternatives (0: the token's own only); per prompt token, `prompt_logprobs` of
    # them. Raw: log_softmax of the target's logits before any processing, as vLLM's default logprobs_mode
    # ("raw_logprobs"); from the verification forward, so the same numbers with speculation on or off.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Added to the logits of these token ids (OpenAI's logit_bias, values in [-100, 100]) before penalties, in
    # the target's rows and the draft's alike, so that verification stays exact.
    logit_bias: dict[int, float] | None = None
    # The output must match this (a JSON schema, regex, choice or grammar: quickdraft.structured), exactly
    # under speculation: the grammar masks the target's rows and the draft's alike.
    structured_outputs: StructuredOutputs | dict | None = None
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1 and not isinstance(self.top_k, bool):
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop_list = list(self.stop)
        else:
            raise QuickdraftError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise QuickdraftError(f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (_is_real(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}"),
            (_is_real(self.top_p) and 0 < self.top_p <= 1,
             f"top_p must be a number in (0, 1], got {self.top_p!r}; use 1 to disable it"),
            (_is_int(self.top_k) and self.top_k >= 0,
             f"top_k must be an integer >= 0, got {self.top_k!r}; use 0 (or -1) to disable it"),
            (_is_real(self.min_p) and 0 <= self.min_p <= 1,
             f"min_p must be a number in [0, 1], got {self.min_p!r}; use 0 to disable it"),
            (_is_real(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}; use 1 to disable it"),
            (_is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be a number in [-2, 2], got {self.presence_penalty!r}"),
            (_is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be a number in [-2, 2], got {self.frequency_penalty!r}"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (all(isinstance(s, str) and s for s in self.stop_list),
             f"stop strings must be non-empty strings, got {self.stop_list!r}"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
             f"seed must be an integer in [-2**63, 2**64 - 1] or None, got {self.seed!r}"),
            (self.num_speculative_tokens is None or (_is_int(self.num_speculative_tokens)
                                                     and self.num_speculative_tokens >= 0),
             f"num_speculative_tokens must be an integer >= 0 (0 turns speculation off for this request) or None, "
             f"got {self.num_speculative_tokens!r}"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}"),
            (isinstance(self.include_stop_str_in_output, bool),
             f"include_stop_str_in_output must be true or false, got {self.include_stop_str_in_output!r}"),
            (isinstance(self.skip_special_tokens, bool),
             f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise QuickdraftError(message)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise QuickdraftError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (how many alternatives "
                                      f"to return besides each token's own) or None, got {value!r}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.of(self.structured_outputs)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise QuickdraftError(f"logit_bias must be a mapping of token ids to biases, got "
                                      f"{type(self.logit_bias).__name__}")
            bias = {}
            for token, value in self.logit_bias.items():
                token_id = int(token) if isinstance(token, str) and token.strip().isdigit() else token
                if not (_is_int(token_id) and token_id >= 0):
                    raise QuickdraftError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
                if not (_is_real(value) and -100 <= value <= 100):
                    raise QuickdraftError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for "
                                          f"token {token_id}")
                bias[token_id] = float(value)
            self.logit_bias = bias or None

    @property
    def greedy(self) -> bool:
        # As vLLM: temperatures this small are greedy (dividing logits by them would overflow float32).
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

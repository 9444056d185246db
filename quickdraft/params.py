"""SamplingParams: what a request asks of the sampler, validated on construction (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quickdraft.errors import QuickdraftError


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
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 means greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}; use 1 to disable it"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be an integer >= 0, got {self.top_k!r}; use 0 to disable it"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}; use 0 to disable it"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}; use 1 to disable it"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (all(isinstance(s, str) and s for s in self.stop_list), "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise QuickdraftError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

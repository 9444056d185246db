"""Per-request state that the engine, the drafts and the API all read: `Sequence` and its `RequestMetrics`.

Acceptance is counted from what is *emitted*: a draft token accepted by verification but dropped because an
earlier token ended the request (EOS, a stop id, max_tokens, a stop string) was never output and is not
counted. Every output token carries its provenance (an accepted draft at position i, the target's token
after a rejection at position i, or a bonus / plain token), so cutting the output also uncounts exactly what
it cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from quickdraft import adaptive, sampling
from quickdraft.cache import SequenceCache
from quickdraft.params import SamplingParams
from quickdraft.structured import GrammarState, masked_rows

# The provenance of an output token (Sequence.provenance): >= 0 is an accepted draft token at that draft
# position; TARGET_TOKEN is the target's own token with no rejection before it (a bonus after K accepted
# drafts, or plain decoding); <= -2 is the target's token after the draft at position -(code + 2) was
# rejected (the correction).
TARGET_TOKEN = -1


def correction_code(rejected_position: int) -> int:
    return -2 - rejected_position


@dataclass
class RequestMetrics:
    """What one request cost and how well the draft did (vLLM's definitions where it has them).

    acceptance_rate = accepted draft tokens / draft tokens proposed;
    mean_acceptance_length = 1 + accepted draft tokens / drafting steps (vLLM's "mean acceptance length");
    tokens_per_target_forward = output tokens / target forwards (the prefill forward included).
    Per position i: proposed (steps whose draft had a token at i), reached (steps where i was judged: every
    draft before it was accepted) and accepted; accepted[i] / reached[i] is the conditional acceptance that
    adaptive K and the bench's cost model use."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt positions copied from the prefix cache instead of computed
    num_generated_tokens: int = 0
    num_speculative_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    num_drafts: int = 0  # steps that proposed at least one draft token
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    reached_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    tree_steps: int = 0  # drafting steps that verified a token tree (their drafts count in proposed_tokens)
    accepted_path_lengths: list[int] = field(default_factory=list)  # tree steps by accepted path length
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0
    wall_time_s: float = 0.0
    first_token_time_s: float | None = None
    # Verified with the LOSSY relaxed acceptance (asked for by name: SpeculativeConfig acceptance="relaxed"): the
    # output is not distributed as the target's. Always False for exact verification.
    lossy: bool = False

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted draft tokens per drafting step: tokens a drafting step yields (up to K+1)."""
        return 1 + self.accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def tokens_per_target_forward(self) -> float | None:
        """Output tokens per target forward, every forward counted (1 for plain decoding)."""
        return self.num_generated_tokens / self.target_forwards if self.target_forwards else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """accepted[i] / reached[i]: the chance that draft position i is accepted given that it was judged."""
        return [a / r if r else None for a, r in zip(self.accepted_per_position, self.reached_per_position)]

    @property
    def tokens_per_s(self) -> float | None:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else None

    def spec_decode_fields(self) -> dict[str, Any]:
        """This request's speculation as the server's `spec_decode` and the batch output's name it (one
        definition for both faces); `lossy` is True only under the relaxed acceptance asked for by name."""
        return {"num_drafts": self.num_drafts, "draft_tokens": self.proposed_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "tokens_per_target_forward": self.tokens_per_target_forward,
                "accepted_per_position": list(self.accepted_per_position),
                "tree_steps": self.tree_steps, "accepted_path_lengths": list(self.accepted_path_lengths),
                "lossy": self.lossy}

    def _bump(self, name: str, position: int, delta: int) -> None:
        counts = getattr(self, name)
        if position >= len(counts):
            counts.extend([0] * (position + 1 - len(counts)))
        counts[position] += delta

    def count_proposed(self, k: int) -> None:
        if k > 0:
            self.num_drafts += 1
            self.proposed_tokens += k
            for i in range(k):
                self._bump("proposed_per_position", i, 1)

    def count_tree(self, num_nodes: int, max_depth: int, path_length: int) -> None:
        """A token tree step: num_nodes drafts proposed over max_depth depths (per position = per depth), and the
        length of the accepted path."""
        self.num_drafts += 1
        self.proposed_tokens += num_nodes
        self.tree_steps += 1
        for depth in range(max_depth):
            self._bump("proposed_per_position", depth, 1)
        self._bump("accepted_path_lengths", path_length, 1)

    def count_accepted(self, num_accepted: int) -> None:
        """Count accepted drafts at positions 0..num_accepted-1 (count_emitted of each, at once)."""
        if num_accepted:
            self.accepted_tokens += num_accepted
            for name in ("accepted_per_position", "reached_per_position"):
                self._bump(name, num_accepted - 1, 0)  # as long as the positions counted
                counts = getattr(self, name)
                for position in range(num_accepted):
                    counts[position] += 1

    def count_emitted(self, code: int, delta: int = 1) -> None:
        """Count (delta=1) or uncount (delta=-1) one output token of the given provenance."""
        if code >= 0:
            self.accepted_tokens += delta
            self._bump("accepted_per_position", code, delta)
            self._bump("reached_per_position", code, delta)
        elif code != TARGET_TOKEN:
            self._bump("reached_per_position", -2 - code, delta)
            self._bump("accepted_per_position", -2 - code, 0)  # same length as reached: a 0 is a count too

    @staticmethod
    def combine(parts: "list[RequestMetrics]", concurrent: bool = False) -> "RequestMetrics":
        """The pooled metrics of several generations (the n completions of a request, a benchmark's
        prompts): counts, times and per-position counts summed; wall time summed, or for generations that ran
        at the same time (concurrent) the longest of them."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return RequestMetrics()
        total = RequestMetrics(num_prompt_tokens=parts[0].num_prompt_tokens,
                               num_cached_tokens=parts[0].num_cached_tokens,
                               num_speculative_tokens=parts[0].num_speculative_tokens,
                               first_token_time_s=parts[0].first_token_time_s,
                               lossy=any(m.lossy for m in parts))
        for m in parts:
            for name in ("num_generated_tokens", "target_forwards", "draft_forwards", "num_drafts",
                         "proposed_tokens", "accepted_tokens", "draft_time_s", "target_time_s", "verify_time_s"):
                setattr(total, name, getattr(total, name) + getattr(m, name))
            total.wall_time_s = max(total.wall_time_s, m.wall_time_s) if concurrent else total.wall_time_s + m.wall_time_s
            for name in ("proposed_per_position", "reached_per_position", "accepted_per_position"):
                for i, v in enumerate(getattr(m, name)):
                    total._bump(name, i, v)
        return total

    def to_dict(self) -> dict[str, Any]:
        out = {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}
        out.update(acceptance_rate=self.acceptance_rate, mean_acceptance_length=self.mean_acceptance_length,
                   tokens_per_target_forward=self.tokens_per_target_forward,
                   acceptance_by_position=self.acceptance_by_position, tokens_per_s=self.tokens_per_s)
        return out


class DraftState:
    """What a draft keeps for one sequence (Sequence.draft_state), made by its proposer's `new_state` and ended
    by its `release` (drafts/base.py): a draft model's KV cache, a lookup's handle on its index, ...

    kv_cache: the draft model's KV cache of this sequence that the KV budget counts and prefix caching may
    share (None: the draft keeps none the budget counts). nbytes: the bytes the state's tensors take now."""

    kv_cache: SequenceCache | None = None

    @property
    def nbytes(self) -> int:
        return 0


@dataclass
class Logprob:
    """A token's log-probability under the target (vLLM's name and fields): rank 1 is the most likely token;
    decoded_token is filled by the API from the tokenizer."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position's log-probabilities: the chosen token's and its most likely alternatives', by token id.
PositionLogprobs = dict[int, Logprob]


class Sequence:
    """One request being generated: its tokens, sampling state, caches and metrics."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None,
                 device: torch.device, vocab_size: int, noise_key: int | None = None):
        self.prompt_ids = list(prompt_ids)
        # Seeded sampling: each output position draws from noise keyed by (noise_key, position), so the text
        # is the same with speculation on or off and whatever K (see verify). None: rejection sampling.
        self.noise_key = None if params.greedy else noise_key
        self.output_ids: list[int] = []
        self.provenance: list[int] = []  # one code per output token (see TARGET_TOKEN)
        self.params = params
        self.generator = generator
        self.device = device
        # The penalties' history (Engine.attach moves it into the engine's PenaltyTable, shared by its sequences).
        self.penalties = sampling.PenaltyHistory(prompt_ids, vocab_size, device) if params.uses_penalties else None
        self.target_cache: SequenceCache = SequenceCache()
        self.draft_state: DraftState | None = None  # the proposer's (new_state, release)
        self.acceptance = adaptive.AcceptanceStats()  # of the first draft kind it uses (see acceptance_for)
        self._acceptance_by_kind: dict[str, adaptive.AcceptanceStats] = {}
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(num_prompt_tokens=len(prompt_ids))
        # Verified with the LOSSY relaxed acceptance (set by the engine; mirrored in metrics.lossy).
        self.relaxed = False
        # SamplingParams.logprobs / prompt_logprobs: one entry per output token (kept aligned with output_ids),
        # and per prompt token (None for the first, which nothing scores) once the prompt has been read.
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        # SamplingParams.structured_outputs: the grammar's state (the LLM compiles it; None without one)
        self.grammar: GrammarState | None = None
        self._token_ids = list(prompt_ids)
        self._log_noise: dict[int, torch.Tensor] = {}  # output position -> log E [V] (see log_noise)
        # (cache, its length) as the engine's last commit left them: the cache then held token_ids[:length], and
        # commits only append, so while the same cache still has that length its tokens need no comparing
        # (truncate_output, the one edit that removes tokens, clears it).
        self.cache_mark: tuple[Any, int] | None = None

    def acceptance_for(self, kind: str, prior: adaptive.AcceptancePrior | None = None) -> adaptive.AcceptanceStats:
        """This sequence's acceptance estimates for drafts of `kind` (Proposer.draft_kind): a draft that takes
        lookups some steps and a model's tokens others keeps the two apart, as their acceptance differs.

        prior: the engine's AcceptancePrior of `kind` (Engine.acceptance_prior), which the estimates start from
        and feed; taken when the kind is first asked for (None: the fixed adaptive.PRIOR_ACCEPTANCE)."""
        stats = self._acceptance_by_kind.get(kind)
        if stats is None:
            if self._acceptance_by_kind:
                stats = adaptive.AcceptanceStats(prior)
            else:  # made with the sequence, before its first kind was known: no step has counted in it yet
                stats = self.acceptance
                stats.prior = prior
            self._acceptance_by_kind[kind] = stats
        return stats

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the committed output (do not mutate)."""
        return self._token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_length(self) -> int:
        """Prompt plus max_tokens: the most tokens the sequence holds when it ends (its caches' length hint)."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def needs_draft_probs(self) -> bool:
        """Whether verification reads the q a draft token was drawn from: sampled rows under rejection
        sampling, and seeded rows under the relaxed test p(x) >= threshold * q(x). Greedy rows, and seeded rows
        verified exactly (matching the target's own noise-keyed draws), need tokens only."""
        return not self.params.greedy and (self.noise_key is None or self.relaxed)

    def log_noise(self, first: int, count: int, vocab: int) -> torch.Tensor:
        """log E of output positions first .. first+count-1 (sampling.position_noise under this sequence's
        noise key), [count, vocab] float64. Rows are kept until their position is committed: a step verifies
        K + 1 positions and commits as few as one, and the draft model draws at the same positions, so each
        position's noise is generated once instead of once per step that reaches it."""
        prefetch_log_noise([(self, first, count)], vocab)
        return torch.stack([self._log_noise[p] for p in range(first, first + count)])

    def noise_rows(self, positions: list[int]) -> list[torch.Tensor]:
        """log E [V] of each of these output positions, made already (prefetch_log_noise)."""
        return [self._log_noise[p] for p in positions]

    def process(self, logits: torch.Tensor, pending: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Apply the request's sampling parameters to `logits` [n, V] whose row j is the position after
        token_ids + pending[:first_row + j]."""
        seen = counts = None
        if self.penalties is not None:
            seen, counts = self.penalties.rows(pending, first_row + logits.shape[0])
            seen, counts = seen[first_row:], counts[first_row:]
        if self.grammar is not None:
            logits = self.grammar_masked(logits, pending.tolist(), first_row)
        return sampling.process(logits, self.params, seen, counts)

    def grammar_masked(self, logits: torch.Tensor, pending: list[int], first_row: int = 0) -> torch.Tensor:
        """logits [n, V] with -inf outside the grammar's allowed tokens, row j at the state after the output
        and pending[:first_row + j] (the same states whether a draft or the target asks)."""
        return masked_rows(logits, [self.grammar.blocked(self.output_ids + pending[:first_row + j])
                                    for j in range(logits.shape[0])])

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the next forward must score every prompt row (asked for, and not read yet)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    def commit(self, drafts: list[int], num_proposed: int, token: int, eos_token_ids: set[int],
               max_len: int, logprobs: list[PositionLogprobs] | None = None) -> list[int]:
        """Append a verified step (the accepted drafts, then the target's token) up to the first token that
        ends the request; count what was appended, and keep the log-probabilities of what was appended
        (`logprobs`, one per step token, when the request asked for them). Returns the tokens appended."""
        params = self.params
        num_drafts = len(drafts)
        steps = [*drafts, token] if num_drafts else [token]
        # Where the step ends: the first token that stops the request (a stop or EOS token; the grammar complete),
        # else the one that fills max_tokens or the context. Checked in that order for each token.
        room = min(params.max_tokens - len(self.output_ids), max_len - len(self._token_ids))
        stops = params.stop_token_ids
        eos = () if params.ignore_eos else eos_token_ids
        count = len(steps)
        # The common case asked at once: room left, no stop token or grammar, no EOS among the tokens.
        if count >= room or stops or self.grammar is not None or not eos_token_ids.isdisjoint(steps):
            count = self._end_of_step(steps, room, stops, eos)
        taken = steps[:count] if count < len(steps) else steps
        # Provenance: draft position i for an accepted draft, then the target's token (a bonus or a correction).
        metrics = self.metrics
        if num_drafts:
            accepted = min(count, num_drafts)
            self.provenance.extend(range(accepted))
            metrics.count_accepted(accepted)
        if count > num_drafts:
            if num_drafts == num_proposed:  # the target's own token with no rejection before it counts nothing
                self.provenance.append(TARGET_TOKEN)
            else:
                code = correction_code(num_drafts)
                self.provenance.append(code)
                metrics.count_emitted(code)
        self.output_ids.extend(taken)
        self._token_ids.extend(taken)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(logprobs[:len(taken)])
        if self.penalties is not None:
            self.penalties.append(taken)
        metrics.num_generated_tokens = len(self.output_ids)
        return taken

    def _end_of_step(self, steps: list[int], room: int, stops: list[int], eos: Iterable[int]) -> int:
        """How many of a step's tokens the request keeps; where one ends it, finish_reason says why."""
        for i, t in enumerate(steps):
            if t in stops or t in eos:
                self.finish_reason = "stop"
            elif self.grammar is not None and self.grammar.stopped(self.output_ids + steps[:i + 1]):
                self.finish_reason = "stop"  # the grammar is complete and takes nothing more (vLLM does the same)
            elif i + 1 >= room:
                self.finish_reason = "length"
            if self.finish_reason:
                return i + 1
        return len(steps)

    def truncate_output(self, length: int, reason: str) -> None:
        """Keep the first `length` output tokens and finish (a stop string ended inside a step); the dropped
        tokens are uncounted from the acceptance metrics."""
        drop = len(self.output_ids) - length
        self.cache_mark = None
        if drop > 0:
            for code in self.provenance[length:]:
                self.metrics.count_emitted(code, -1)
            del self.provenance[length:]
            del self.output_ids[length:]
            if self.logprobs is not None:
                del self.logprobs[length:]
            del self._token_ids[len(self._token_ids) - drop:]
        self.metrics.num_generated_tokens = len(self.output_ids)
        self.finish_reason = reason


def prefetch_log_noise(wanted: list[tuple[Sequence, int, int]], vocab: int) -> None:
    """Make the noise rows of (sequence, first position, count) kept on each sequence, generating every
    missing one in one pass (sampling.log_noise_rows) rather than one small pass per sequence; rows of
    committed positions are dropped."""
    missing: list[tuple[Sequence, int]] = []
    for seq, first, count in wanted:
        rows = seq._log_noise
        for position in [p for p in rows if p < len(seq.output_ids)]:
            del rows[position]
        missing += [(seq, p) for p in range(first, first + count) if p not in rows]
    if not missing:
        return
    device = missing[0][0].device
    fresh = sampling.log_noise_rows([sampling.noise_seed(seq.noise_key, p) for seq, p in missing], vocab, device)
    for row, (seq, position) in zip(fresh, missing):
        seq._log_noise[position] = row

"""Adaptive K: each step, pick the draft length that maximises expected tokens per second.

Expected tokens of a step that verifies k drafts: 1 + sum_{i<k} prod_{j<=i} a_j, where a_j is the
probability that draft position j is accepted given that every earlier one was (estimated per request from
its own recent steps, so a prompt that copies a lot and one that does not each get their own K). The cost
of a step with k drafts is its wall time, measured while the engine runs (shared by all requests: it
belongs to the target and the proposer, not to a prompt). K = 0 is plain decoding; it wins where drafts are
rarely accepted. Estimates decay each step toward an optimistic prior, so a request that dropped to K = 0
tries speculation again after a while instead of never learning that the text turned repetitive.
"""

from __future__ import annotations

PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 1.0
DECAY = 0.9
# Before a step of some k has been timed, its cost relative to a plain step is extrapolated with this slope
# per draft token (in bf16 on an AMX CPU, verifying 8 tokens costs about 1.15x one: ~0.02 per token).
PRIOR_COST_SLOPE = 0.05


class StepCosts:
    """Moving averages of a step's wall time by the number of draft tokens it verified."""

    def __init__(self, max_k: int, smoothing: float = 0.2):
        self.seconds: list[float | None] = [None] * (max_k + 1)
        self.smoothing = smoothing

    def record(self, k: int, seconds: float) -> None:
        if k >= len(self.seconds):
            self.seconds.extend([None] * (k + 1 - len(self.seconds)))
        old = self.seconds[k]
        self.seconds[k] = seconds if old is None else old + self.smoothing * (seconds - old)

    def estimate(self, k: int) -> float | None:
        """The measured (or, between and beyond measured points, linearly inferred) time of a step."""
        if k < len(self.seconds) and self.seconds[k] is not None:
            return self.seconds[k]
        known = [(j, s) for j, s in enumerate(self.seconds) if s is not None]
        if not known:
            return None
        if len(known) == 1:
            j, s = known[0]
            return s * (1 + PRIOR_COST_SLOPE * k) / (1 + PRIOR_COST_SLOPE * j)
        below = [(j, s) for j, s in known if j < k]
        above = [(j, s) for j, s in known if j > k]
        if below and above:
            (j0, s0), (j1, s1) = below[-1], above[0]
        else:
            (j0, s0), (j1, s1) = (known[-2], known[-1]) if below else (known[0], known[1])
        slope = max(0.0, (s1 - s0) / (j1 - j0))
        return max(1e-9, s0 + slope * (k - j0))


class AcceptanceStats:
    """One request's decayed counts, per draft position, of reaching and of passing verification."""

    def __init__(self) -> None:
        self.reached: list[float] = []
        self.accepted: list[float] = []

    def update(self, proposed: int, accepted: int) -> None:
        self.reached = [r * DECAY for r in self.reached]
        self.accepted = [a * DECAY for a in self.accepted]
        if len(self.reached) < proposed:
            grow = proposed - len(self.reached)
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        # Position i was judged when all before it were accepted: i <= accepted (and i < proposed).
        for i in range(min(accepted + 1, proposed)):
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    def rate(self, position: int) -> float:
        reached = self.reached[position] if position < len(self.reached) else 0.0
        accepted = self.accepted[position] if position < len(self.accepted) else 0.0
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)

    def expected_tokens(self, k: int) -> float:
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.rate(i)
            total += survive
        return total


def choose_k(stats: AcceptanceStats, costs: StepCosts, max_k: int) -> int:
    """The k in [0, max_k] with the most expected tokens per second; max_k until costs are measured."""
    best_k, best_rate = max_k, 0.0
    for k in range(max_k + 1):
        seconds = costs.estimate(k)
        if seconds is None:
            return max_k
        rate = stats.expected_tokens(k) / seconds
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k

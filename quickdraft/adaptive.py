"""Adaptive K: each step, pick the draft length that maximises expected tokens per second.

Expected tokens of a step that verifies k drafts: 1 + sum_{i<k} prod_{j<=i} a_j, where a_j is the
probability that draft position j is accepted given that every earlier one was (estimated per request from
its own recent steps, so a prompt that copies a lot and one that does not each get their own K). The cost
of a step with k drafts is its wall time, measured while the engine runs (shared by all requests: it
belongs to the target and the proposer, not to a prompt). K = 0 is plain decoding; it wins where drafts are
rarely accepted. Estimates decay each step toward a prior, the engine's (AcceptancePrior, one per draft kind):
what every sequence's steps of that kind accepted lately, so a new request on an engine that has served others
starts from the model pair's acceptance, not from a guess. A request at K = 0 drafts one token now and then (a
probe, PROBE_INTERVAL) instead of never learning that its text turned repetitive.
The formulas are quickdraft/speedup_model.py's, which `quickdraft tune` and the bench share.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import numpy as np

from quickdraft.speedup_model import acceptance_chain, expected_tokens_per_step, monotone_fit


def _median(values) -> float:
    """statistics.median of a few numbers (a curve's window), without its checks: one sort."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 1.0
DECAY = 0.9
# The engine's prior (AcceptancePrior) remembers the last ~1 / (1 - ENGINE_PRIOR_DECAY) drafting steps of all
# sequences of a kind: the model pair's acceptance on the recent workload, not one prompt's. Until about
# ENGINE_PRIOR_WEIGHT of them reached a position, PRIOR_ACCEPTANCE weighs as much as they do.
ENGINE_PRIOR_DECAY = 0.99
ENGINE_PRIOR_WEIGHT = 4.0
# Before a step of some k has been timed, its cost relative to a plain step is extrapolated with this slope
# per draft token (measured in bf16: verifying 8 tokens costs about 1.15x one on a CPU with AMX, ~0.02 per
# token, and 1.5-1.7x one on AVX512-BF16 without AMX, ~0.08; the prior sits between until steps are timed).
PRIOR_COST_SLOPE = 0.05
# A request that has not drafted for this many steps drafts one token (a probe), whatever the estimates say.
# Its counts decay toward the engine's prior, which is what the kind's drafting steps accepted; where that rate
# does not pay for a draft, decaying alone never makes it draft again, so it would never see its text turn easy.
# The probes are also what keeps that prior learning where no request drafts by choice. One draft token every 16
# steps costs at most ~3% of a plain request's time (chosen, not tuned). In a batch (choose_batch_k) the interval
# stretches where a probe's row costs more than half of what a plain step spends per token, and probes stop
# where it costs as much (batch_probe_interval).
PROBE_INTERVAL = 16
# What an engine spends on one-sequence probes: at most this share of its plain steps' time (SpeculationPolicy's
# probe credit). A lookup's probe (~0.1 of a plain step) fits every PROBE_INTERVAL steps. A draft model's must first
# read what it missed while not drafting: on a 2-core CPU the Qwen 0.5B reads a token in ~0.08 of the 1.5B's plain
# step, so a probe after 16 plain steps cost ~1.9 steps, 12% of a request that drafted nothing, and short Spec-Bench
# requests ran at 0.87-0.93x plain decoding (benchmarks/RESULTS.md, session 39). Paid from the engine's credit, such
# probes come every few requests instead, and the engine's prior still learns from them.
PROBE_BUDGET = 0.03
# A draft token's cost once forgotten (StepCosts.draft_per_token): this share of its last measure.
FORGOTTEN_DRAFT_SHARE = 0.5
# StepCosts' speed is the median of this many steps' ratios of their time to their k's measured cost.
SPEED_WINDOW = 5
# OutputLengths remembers this many finished requests (a workload's answers change with its kind of prompt).
OUTPUT_LENGTH_WINDOW = 8


class _Curve:
    """A cost measured at integer points (rows in a step, drafts in a step): at each point the median of its
    last `window` samples, made non-decreasing in x (pool-adjacent-violators over the medians, weighted by
    their sample counts: more rows never cost less), linearly interpolated between points and extrapolated
    with the slope of the nearest two (never negative).

    Why medians and monotone: on a shared machine one step in a while is several times slower (another
    process, a page fault). A moving average drags such a step along for many steps, and a point that reads
    slower than its right neighbour makes adding rows look free, so a batch drafts where it should not. A
    point not measured in the last `max_age` records is dropped: it was measured at other context lengths
    and batch mixes, or in another hour of the machine's bandwidth."""

    def __init__(self, window: int = 9, max_age: int = 128, origin: bool = False, kept: int | None = None):
        self.window, self.max_age = window, max_age
        # kept: a point that never ages out (StepCosts' plain step, k = 0: see there why).
        self.kept = kept
        # origin: the cost at x = 0 is 0, known without measuring (a cost of x extra rows): it anchors the fit, and
        # one measured point extrapolates in proportion to x, not with the prior's slope.
        self.origin = origin
        self._samples: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}  # x -> the median of its samples
        self._last: dict[int, int] = {}  # x -> the record count when it was last measured
        self._records = 0
        self._oldest = 0  # at most the least of _last's values (tick scans for stale points only past it)
        self._fit: list[tuple[int, float]] | None = None  # sorted (x, fitted cost), recomputed after a record
        self._fit_arrays: tuple[np.ndarray, np.ndarray] | None = None  # the same as arrays (estimates)

    def record(self, x: int, seconds: float) -> None:
        samples = self._samples.setdefault(x, deque(maxlen=self.window))
        samples.append(seconds)
        median = _median(samples)  # the other points' medians stand
        # The fit changes with a point's median, and with its weight (its samples) until the window is full.
        if len(samples) < self.window or self._medians.get(x) != median:
            self._fit = self._fit_arrays = None
        self._medians[x] = median
        self._last[x] = self._records + 1
        self.tick()

    def tick(self) -> None:
        """Count a record of the engine's that measured no point of this curve (a plain step, for the cost of
        drafting): points age by the engine's steps, not by this curve's records, so a draft cost measured
        slow (a busy minute) that made adaptive K stop drafting is forgotten after max_age steps and drafting
        is tried again. Otherwise nothing would ever measure it anew."""
        self._records += 1
        if self._records - self._oldest <= self.max_age:  # nothing can be stale yet (a step's common case)
            return
        stale = [p for p, last in self._last.items() if self._records - last > self.max_age and p != self.kept]
        if stale:  # the fit changes only where a point went (or a sample came: record)
            for p in stale:
                del self._samples[p], self._last[p], self._medians[p]
            self._fit = self._fit_arrays = None
        self._oldest = min((last for p, last in self._last.items() if p != self.kept), default=self._records)

    @property
    def points(self) -> dict[int, float]:
        return dict(self._fitted())

    @property
    def measured_any(self) -> bool:
        return bool(self._samples)

    def measured(self, x: int) -> bool:
        return x in self._samples

    def _fitted(self) -> list[tuple[int, float]]:
        if self._fit is None:
            xs = sorted(self._samples)
            medians, weights = [self._medians[x] for x in xs], [float(len(self._samples[x])) for x in xs]
            if self.origin and xs:
                xs, medians, weights = [0] + xs, [0.0] + medians, [1e9] + weights  # the anchor outweighs any run
            values = monotone_fit(medians, weights)
            self._fit = list(zip(xs, values))
        return self._fit

    def estimate(self, x: int, prior_slope: float) -> float | None:
        known = self._fitted()
        if not known:
            return None
        position = bisect.bisect_left(known, (x, -math.inf))
        if position < len(known) and known[position][0] == x:
            return known[position][1]
        if len(known) == 1:
            x0, s0 = known[0]
            return max(1e-9, s0 * (1 + prior_slope * (x - x0)))
        if 0 < position < len(known):
            (x0, s0), (x1, s1) = known[position - 1], known[position]
        else:
            (x0, s0), (x1, s1) = (known[-2], known[-1]) if position else (known[0], known[1])
        slope = max(0.0, (s1 - s0) / (x1 - x0))
        return max(1e-9, s0 + slope * (x - x0))


    def least_slope(self, lo: int, hi: int, prior_slope: float) -> float:
        """A lower bound of what estimate adds a unit of x over [lo, hi] (its least segment slope there; 0 where
        unmeasured, or where the 1e-9 floor may flatten it)."""
        known = self._fitted()
        if not known:
            return 0.0
        if not self.origin and not self.estimate(lo, prior_slope) > 2e-9:  # non-decreasing: above the floor from lo on
            return 0.0
        if len(known) == 1:
            return max(0.0, known[0][1] * prior_slope)
        least = math.inf
        last = len(known) - 2
        for j, ((x0, s0), (x1, s1)) in enumerate(zip(known, known[1:])):
            # segment j prices x in (x0, x1]; the first one also every x below, the last every x above
            if (j == last or lo < x1) and (j == 0 or hi > x0):
                least = min(least, max(0.0, (s1 - s0) / (x1 - x0)))
        return least

    def estimates(self, xs: np.ndarray, prior_slope: float) -> np.ndarray | None:
        """estimate at every x of xs (int array) at once, by the same arithmetic (a batch's choice prices every
        number of rows it may verify)."""
        known = self._fitted()
        if not known:
            return None
        if self._fit_arrays is None:
            self._fit_arrays = (np.array([x for x, _ in known], dtype=np.int64),
                                np.array([v for _, v in known], dtype=np.float64))
        points, values = self._fit_arrays
        if len(known) == 1:
            return np.maximum(1e-9, values[0] * (1 + prior_slope * (xs - points[0])))
        position = np.searchsorted(points, xs, side="left")
        upper = np.clip(position, 1, len(known) - 1)  # the segment's right point: interior, else the nearest two
        x0, s0, x1, s1 = points[upper - 1], values[upper - 1], points[upper], values[upper]
        slope = np.maximum(0.0, (s1 - s0) / (x1 - x0))
        out = np.maximum(1e-9, s0 + slope * (xs - x0))
        exact = (position < len(known)) & (points[np.minimum(position, len(known) - 1)] == xs)
        return np.where(exact, values[np.minimum(position, len(known) - 1)], out)


class StepCosts:
    """A one-sequence step's wall time by the number of draft tokens k it verified, and its two parts where the
    engine times them: the drafting, and the rest (the target's forward over k + 1 rows, verification, commit).

    A k that was measured costs its (median) time. Any other k costs the rest's curve at k (its prior slope
    beyond the measured points) plus k draft tokens at the drafting's measured cost per token. Why the parts: a
    model draft's token costs a draft forward (~0.4 of the target's step for the Qwen 0.5B beside the 1.5B),
    which a slope prior for verification rows prices at almost nothing. With the step's whole time alone, an
    engine that had only run K = 4 priced plain decoding at 0.8x of that step instead of ~0.35x, so it never
    tried fewer drafts, and a prompt accepting 50% ran slower than plain (benchmarks/RESULTS.md, session 23);
    and two measured points fitted flat (a slow step at k - 1) priced every smaller k, K = 0 included, the same.

    The costs are kept in units of the machine's current speed (`speed`: the median ratio of the last few
    steps' times to what their k was measured to cost), so that k's measured minutes apart compare as if measured
    together: on a shared 2-core CPU the Qwen 1.5B's plain step read 26.0 ms in one minute and 32.5 ms in the next
    (benchmarks/RESULTS.md, session 39), more than a verification row costs, and a request that drafts for a while
    stops measuring the plain step. Without it a plain step last measured in a slow minute (36 ms where it cost
    26) made one draft token (43 ms) look worth it at ~0.55 acceptance, where it needs ~0.65. For the same reason
    the plain step (k = 0) is never forgotten (the other points are after max_age steps unmeasured, see _Curve):
    extrapolated down from the drafting steps' rest (verification of k + 1 rows, nearly flat in k between
    neighbours) it read 32-34 ms where it cost 26."""

    def __init__(self, max_k: int):
        self.curve = _Curve(kept=0)
        self.rest = _Curve(kept=0)   # the step less its drafting, by k
        self.draft = _Curve()  # the drafting alone, by k > 0
        self.catch_up: deque[float] = deque(maxlen=9)  # per history token a draft model read in a catch-up
        self._measured_per_token = 0.0  # _draft_per_token's last measure
        # The machine's speed now: seconds per unit of the curves (which hold seconds / speed at the time). Two
        # ratios of 1 to start with: a step's speed moves it only once another step agrees.
        self._speeds: deque[float] = deque([1.0, 1.0], maxlen=SPEED_WINDOW)
        self.speed = 1.0

    def record(self, k: int, seconds: float, draft_seconds: float | None = None) -> None:
        if self.curve.measured(k):  # this step against what its k costs: the machine's speed now
            self._speeds.append(seconds / self.curve.estimate(k, PRIOR_COST_SLOPE))
            self.speed = _median(self._speeds)
        speed = self.speed
        self.curve.record(k, seconds / speed)
        if draft_seconds is not None:
            self.rest.record(k, max(0.0, seconds - draft_seconds) / speed)
        if draft_seconds is not None and k > 0:
            self.draft.record(k, draft_seconds / speed)
        else:
            self.draft.tick()

    def record_catch_up(self, k: int, tokens: int, draft_seconds: float) -> None:
        """A drafting step that first read `tokens` of history it had missed (a prompt, or a stretch at K = 0):
        its drafting time less k draft tokens at their measured cost, per token read."""
        if tokens > 0:
            self.catch_up.append(max(0.0, draft_seconds / self.speed - k * self._draft_per_token()) / tokens)

    def catch_up_per_token(self) -> float:
        """What a draft model takes to read one token of history it missed (median of the last catch-ups; 0 before
        one was measured, when a catch-up is not priced)."""
        return _median(self.catch_up) * self.speed if self.catch_up else 0.0

    def draft_per_token(self) -> float:
        """The drafting's seconds per draft token at the machine's speed now (_draft_per_token)."""
        return self._draft_per_token() * self.speed

    def _draft_per_token(self) -> float:
        """The drafting's measured cost per draft token (the median over the k measured); 0 before any. Once no
        step has drafted for the curve's max_age steps, FORGOTTEN_DRAFT_SHARE of the last measure: low enough that
        a request whose drafts are accepted tries drafting again (a busy minute measured it at 3x), high enough
        that a draft model's long catch-up is not bought at no cost. (It was 0: after 128 plain steps on long
        prompts a RAG request drafted as if draft tokens were free, paying 1.3 s for the 0.5B to read 727 prompt
        tokens: 0.81x plain decoding; benchmarks/RESULTS.md, session 39.)"""
        points = self.draft.points
        if points:
            self._measured_per_token = _median([seconds / k for k, seconds in points.items()])
            return self._measured_per_token
        return FORGOTTEN_DRAFT_SHARE * self._measured_per_token

    def estimate(self, k: int) -> float | None:
        """A step's time with k drafts at the machine's speed now: measured, or from its parts (linearly inferred
        from the whole steps' times where the parts were never timed)."""
        if self.curve.measured(k) or not self.rest.measured_any:
            known = self.curve.estimate(k, PRIOR_COST_SLOPE)
            return None if known is None else known * self.speed
        return (self.rest.estimate(k, PRIOR_COST_SLOPE) + k * self._draft_per_token()) * self.speed


class _PositionCounts:
    """Decayed counts, per draft position, of reaching verification and of passing it."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.reached: list[float] = []
        self.accepted: list[float] = []

    def update(self, proposed: int, accepted: int) -> None:
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        if len(self.reached) < proposed:
            grow = proposed - len(self.reached)
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        # Position i was judged when all before it were accepted: i <= accepted (and i < proposed).
        for i in range(min(accepted + 1, proposed)):
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    def counts(self, position: int) -> tuple[float, float]:
        """(accepted, reached) at `position`; 0 for a position never proposed."""
        if position < len(self.reached):
            return self.accepted[position], self.reached[position]
        return 0.0, 0.0


class AcceptancePrior(_PositionCounts):
    """What a new request's drafts of one kind are expected to accept, per position: learned from the drafting
    steps of every sequence of that kind on one engine (Engine.acceptance_prior). One LLM serving many prompts
    has measured its step costs by the time a request arrives; a fixed guess of PRIOR_ACCEPTANCE a position then
    prices deep drafts below plain decoding on a pair that accepts ~0.8 (benchmarks/RESULTS.md, session 15), and
    every request started shallow and learned its depth slowly.

    rate(i) is PRIOR_ACCEPTANCE with no history, moving to the measured rate as steps reach position i
    (ENGINE_PRIOR_WEIGHT steps' worth of the guess). A position no step reached yet takes the rate of the one
    before it (acceptance by position is about flat or rising once a draft has been right, as in
    speedup_model.filled_rates): a pair learned at depth 2 is not priced at the guess at depth 6, so requests go
    deep and the prior learns those positions too.

    It falls as low as the steps show. It learns only from steps that draft, probes included (PROBE_INTERVAL):
    where drafting does not pay no request drafts by choice, and the probes keep it learning, so the engine still
    sees the workload change (to repetitive text, say). It used to be floored at PRIOR_ACCEPTANCE (an optimism
    floor, from before probes): every new request, and every request at K = 0 as its counts decayed, then priced
    drafts at 0.6 a position where n-gram lookups accept ~0.25, and drafted at a loss until its own failures
    outweighed the floor; at batch 4 on a 2-core CPU, where a draft row pays from ~0.6, that cost ngram 2-4% of
    plain decoding's tokens per second (benchmarks/RESULTS.md, session 38)."""

    def __init__(self) -> None:
        super().__init__(ENGINE_PRIOR_DECAY)
        self._rates: list[float] = []  # rate by position, up to the deepest asked since the last update

    def update(self, proposed: int, accepted: int) -> None:
        # A step that drafted nothing says nothing about acceptance; counting it would decay what the drafting
        # steps taught (a batch of plain-decoding requests would erase it within a step or two).
        if proposed > 0:
            super().update(proposed, accepted)
            self._rates = []

    def rates(self, count: int) -> list[float]:
        """rate(i) for i < count (the cached list itself: do not change it)."""
        if len(self._rates) < count:
            self.rate(count - 1)
        return self._rates

    def rate(self, position: int) -> float:
        # Cached: a batch's choice reads every position of every sequence between two updates.
        while len(self._rates) <= position:
            before = self._rates[-1] if self._rates else PRIOR_ACCEPTANCE
            accepted, reached = self.counts(len(self._rates))
            learned = (accepted + before * ENGINE_PRIOR_WEIGHT) / (reached + ENGINE_PRIOR_WEIGHT)
            self._rates.append(learned)
        return self._rates[position]


class AcceptanceStats(_PositionCounts):
    """One request's decayed counts, per draft position, of reaching and of passing verification.

    prior: the engine's AcceptancePrior of this draft kind; rate() starts from its rate instead of the fixed
    PRIOR_ACCEPTANCE, and as the counts decay the estimate returns toward it. Each update feeds it too (a tree
    step as a chain of its depth, like this request's own counts). None: the fixed PRIOR_ACCEPTANCE."""

    def __init__(self, prior: AcceptancePrior | None = None) -> None:
        super().__init__(DECAY)
        self.prior = prior
        self.steps_without_drafts = 0  # consecutive steps that drafted nothing (PROBE_INTERVAL)

    def update(self, proposed: int, accepted: int) -> None:
        super().update(proposed, accepted)
        self.steps_without_drafts = self.steps_without_drafts + 1 if proposed == 0 else 0
        if self.prior is not None:
            self.prior.update(proposed, accepted)

    @property
    def due_for_probe(self) -> bool:
        """Whether this request has gone PROBE_INTERVAL steps without drafting: its next step drafts one token."""
        return self.steps_without_drafts >= PROBE_INTERVAL

    def rates(self, count: int) -> list[float]:
        """The acceptance estimates of positions 0..count-1, in one pass (each leans on the one before it)."""
        # A position this request has rarely reached leans on what it showed one position earlier where that is
        # better than the prior (acceptance by position is about flat or rising once a draft has been right, as
        # for AcceptancePrior): a request accepting every single draft otherwise priced a second one at the
        # prior, drafted one a step for good and never learned its depth (benchmarks/RESULTS.md, session 24).
        # (Asked for every sequence of a batch every step: the counts and the prior's rates are read as lists.)
        rates: list[float] = []
        if count <= 0:
            return rates
        priors = [PRIOR_ACCEPTANCE] * count if self.prior is None else self.prior.rates(count)
        accepted, reached, known = self.accepted, self.reached, len(self.reached)
        last = None
        for i in range(count):
            prior = priors[i] if last is None else max(priors[i], last)
            a, r = (accepted[i], reached[i]) if i < known else (0.0, 0.0)  # a position never proposed: none
            last = (a + prior * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT)
            rates.append(last)
        return rates

    def rate(self, position: int) -> float:
        return self.rates(position + 1)[-1]

    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum_{i<k} prod_{j<=i} a_j (speedup_model.expected_tokens_per_step, every step proposing k)."""
        return expected_tokens_per_step(self.rates(k), None, k)


class OutputLengths:
    """How many tokens this engine's recent requests generated, for what a request may still generate: a draft
    model's reading of a prompt is paid once and earned back over those tokens (choose_k's `remaining`).

    max_tokens alone is an upper bound: Spec-Bench's qa and translation answers end after 11-49 of 64 tokens, and a
    request that spread the Qwen 0.5B's reading of a 40-80-token prompt (80-170 ms, 3-6 plain steps) over 64
    tokens drafted where it could not earn it back (qa 0.83-0.90x plain decoding; benchmarks/RESULTS.md, session 39).
    A request that ended at its max_tokens says only that it would have gone on: it counts as this request's own
    max_tokens. Nothing known (or no recent request ran longer than this one has): max_tokens."""

    def __init__(self, window: int = OUTPUT_LENGTH_WINDOW) -> None:
        self._lengths: deque[tuple[int, bool]] = deque(maxlen=window)  # (generated, ended at its max_tokens)

    def record(self, generated: int, at_max_tokens: bool) -> None:
        self._lengths.append((generated, at_max_tokens))

    def expected_remaining(self, generated: int, max_tokens: int) -> float:
        """The mean of min(L, max_tokens) - generated over the recent lengths L above `generated` (L = max_tokens
        for one that ended at its own)."""
        longer = [(max_tokens if at_max else min(length, max_tokens)) - generated
                  for length, at_max in self._lengths if length > generated]
        return sum(longer) / len(longer) if longer else float(max_tokens - generated)


def probe_seconds(costs: StepCosts, catch_up_s: float = 0.0) -> float:
    """What a probe (one draft token) adds to a request's plain step: a one-draft step over a plain one, and the
    reading a draft model must do first (catch_up_s: the history it missed while not drafting)."""
    one, plain = costs.estimate(1), costs.estimate(0)
    return max(0.0, (one or 0.0) - (plain or 0.0)) + catch_up_s


def choose_k(stats: AcceptanceStats, costs: StepCosts, max_k: int, catch_up_s: float = 0.0,
             remaining: float | None = None, probe_credit_s: float = math.inf) -> int:
    """The k in [0, max_k] with the most expected tokens per second; max_k until costs are measured; one draft
    (a probe) where that is 0 and the request is due for a probe (AcceptanceStats.due_for_probe).

    catch_up_s: what the draft must read before it can draft (a long prompt's prefill: 2-4 s for the Qwen 0.5B on
    ~700 tokens on 2 cores), paid once by the first drafting step and spread over the `remaining` tokens the
    request may still generate (OutputLengths.expected_remaining: what recent requests went on to generate).
    Every drafting k is charged its share per expected token. A probe is taken only where drafting could pay even
    so if every draft were accepted, and where its whole cost (probe_seconds, the catch-up included) is within
    probe_credit_s, what the engine may still spend on probes (SpeculationPolicy: PROBE_BUDGET of its plain steps'
    time)."""
    share = catch_up_s / remaining if catch_up_s > 0 and remaining else 0.0
    seconds = [costs.estimate(k) for k in range(max_k + 1)]
    if None in seconds:
        return max_k
    # E(k) for every k in one pass: the same running sums, in the same order, as expected_tokens_per_step(rates[:k])
    # (test_expected_tokens_and_choices_are_the_same_to_the_last_bit), without re-walking the chain for each k.
    chain = acceptance_chain(stats.rates(max_k), max_k)
    best_k, best_rate, tokens = max_k, 0.0, 1.0
    for k, step in enumerate(seconds):
        if k:
            tokens += chain[k - 1]
        rate = tokens / (step + (tokens * share if k else 0.0))
        if rate > best_rate:
            best_k, best_rate = k, rate
    if best_k or not stats.due_for_probe or max_k == 0:
        return best_k
    if probe_seconds(costs, catch_up_s) > probe_credit_s:
        return 0
    could_pay = any((k + 1) / (seconds[k] + (k + 1) * share) > 1 / seconds[0] for k in range(1, max_k + 1))
    return 1 if could_pay else 0


class BatchCosts:
    """What a batched step costs, measured while running: the target forward plus verification as a function
    of the rows in the step (all sequences' new tokens: a memory-bound forward costs about the same for 1 or
    30 rows, a compute-bound one grows with them), and the draft: per batched draft forward as a function of
    how many sequences draft (model drafts), or per drafting sequence (lookup drafts, no forwards).

    Draft rows are priced by what they were measured to add to the step they joined (`extra`): a drafting step's
    time less the plain step's cost at its base rows as measured then (the median of the latest plain steps, taken
    nearly every step). Why not the curve by rows alone: its points are measured at different times, the base
    (every plain step) at today's context lengths and machine, a drafting size (rare where drafts do not pay) up
    to max_age steps earlier; a step's cost drifts more than a row costs (at batch 4 on a 2-core CPU a plain step
    read 5.5 ms early in a run and 7.1 ms later, a row ~1.1 ms), so an old cheap sample one row above the base
    made that row look free, and requests accepting ~0.25 a draft drafted where a row pays from ~0.63
    (benchmarks/RESULTS.md, session 38). The added cost is kept per size class of the base rows (powers of 2: a
    memory-bound forward's rows are free up to a point that a larger batch reaches first); until a class has
    measured one, the curve by rows prices it."""

    def __init__(self) -> None:
        self.target = _Curve()
        self.draft_forward = _Curve()
        self.lookup = _Curve()
        self.extra: dict[int, _Curve] = {}  # base rows' bit_length -> seconds added by x draft rows

    def record(self, rows: int, target_seconds: float, drafting: int, draft_forwards: int,
               draft_seconds: float | None, draft_rows: int = 0) -> None:
        """One step: `rows` verified in `target_seconds`, draft_rows of them drafts (the rest, its base, one per
        sequence or a prompt)."""
        base = rows - draft_rows
        if draft_rows > 0 and self.target.measured(base):  # what the drafts added, against the base's cost now
            extra = self.extra.get(base.bit_length())
            if extra is None:
                # Aged by its own records only: a drift-free difference stays true while drafting pauses.
                extra = self.extra[base.bit_length()] = _Curve(origin=True)
            extra.record(draft_rows, target_seconds - self.target.estimate(base, PRIOR_COST_SLOPE))
        self.target.record(rows, target_seconds)
        # Each draft curve ages with every step (_Curve.tick), those that do not draft included.
        drafted_by_model = draft_seconds is not None and drafting > 0 and draft_forwards > 0
        drafted_by_lookup = draft_seconds is not None and drafting > 0 and draft_forwards == 0
        if drafted_by_model:
            self.draft_forward.record(drafting, draft_seconds / draft_forwards)
        else:
            self.draft_forward.tick()
        if drafted_by_lookup:
            self.lookup.record(1, draft_seconds / drafting)
        else:
            self.lookup.tick()

    def _extra_of(self, base_rows: int) -> "_Curve | None":
        extra = self.extra.get(base_rows.bit_length())
        return extra if extra is not None and extra.measured_any else None

    def target_seconds(self, rows: int, base_rows: int | None = None) -> float | None:
        """The target's forward and verification over `rows`, of which base_rows are the step's base (None: all):
        the base's cost plus what the rows beyond it add (`extra`; the curve by rows where that is unmeasured)."""
        extra = None if base_rows is None or rows == base_rows else self._extra_of(base_rows)
        if extra is None:
            return self.target.estimate(rows, PRIOR_COST_SLOPE)
        plain = self.target.estimate(base_rows, PRIOR_COST_SLOPE)
        return None if plain is None else plain + extra.estimate(rows - base_rows, 0.0)

    def least_row_seconds(self, base_rows: int, most_rows: int) -> float:
        """A lower bound of what one more row adds to a step of base_rows up to most_rows rows (0 where unknown)."""
        extra = self._extra_of(base_rows)
        if extra is None:
            return self.target.least_slope(base_rows, most_rows, PRIOR_COST_SLOPE)
        return extra.least_slope(0, most_rows - base_rows, 0.0)

    def steps_seconds(self, rows: np.ndarray, max_k: np.ndarray, drafting: np.ndarray, model_draft: bool,
                      base_rows: int | None = None) -> np.ndarray:
        """step_seconds at many (rows, max_k, drafting >= 1) at once (the target's cost must be measured)."""
        extra = None if base_rows is None else self._extra_of(base_rows)
        if extra is None:
            target = self.target.estimates(rows, PRIOR_COST_SLOPE)
        else:
            target = self.target.estimate(base_rows, PRIOR_COST_SLOPE) + extra.estimates(rows - base_rows, 0.0)
        if model_draft:
            per_forward = self.draft_forward.estimates(drafting, PRIOR_COST_SLOPE)
            return target + max_k * (per_forward if per_forward is not None else target)
        return target + drafting * (self.lookup.estimate(1, 0.0) or 0.0)

    def step_seconds(self, rows: int, max_k: int, drafting: int, model_draft: bool,
                     base_rows: int | None = None) -> float | None:
        """A step verifying `rows` (base_rows of them its base: target_seconds) with `drafting` sequences drafting
        up to max_k tokens each."""
        target = self.target_seconds(rows, base_rows)
        if target is None:
            return None
        if drafting == 0:
            return target
        if model_draft:
            per_forward = self.draft_forward.estimate(drafting, PRIOR_COST_SLOPE)
            # Unmeasured: assume a draft forward costs what the target's does (adaptive K then probes and learns).
            return target + max_k * (per_forward if per_forward is not None else target)
        per_seq = self.lookup.estimate(1, 0.0)
        return target + drafting * (per_seq or 0.0)


# Up to this many draft candidates a batch's choice is made in plain Python (_best_few), above it with numpy: the
# same arithmetic in the same order, so the same choice to the last bit. In the engine's loop (caches cold after the
# forward) numpy's ~35 calls a choice took ~0.26 ms at 4 sequences x 5 candidates (Python: ~0.09 ms, of a ~7 ms
# step) and ~0.37 ms at 16 x 5 (Python: ~0.23 ms), measured on this project's 2-core CPU.
FEW_CANDIDATES = 96


def _best_few(chances: list[float], owners: list[int], positions: list[int], batch: int, base_rows: int,
              costs: BatchCosts, model_draft: bool) -> list[int]:
    """choose_batch_k's pick over few candidates, one by one: best first (ties: the earlier position, then the
    earlier sequence), the number taken the one with the best tokens per second (the first of equals)."""
    order = sorted(range(len(chances)), key=lambda j: (-chances[j], positions[j], owners[j]))
    tokens, max_k, seen = float(batch), 0, set()
    best, best_rate = -1, -math.inf
    for m, j in enumerate(order):
        tokens += chances[j]
        max_k = max(max_k, positions[j] + 1)
        seen.add(owners[j])
        rate = tokens / costs.step_seconds(base_rows + m + 1, max_k, len(seen), model_draft, base_rows)
        if rate > best_rate:
            best, best_rate = m, rate
    chosen = [0] * batch
    if best_rate > batch / costs.step_seconds(base_rows, 0, 0, model_draft):
        for j in order[:best + 1]:
            chosen[owners[j]] = max(chosen[owners[j]], positions[j] + 1)
    return chosen


def batch_probe_interval(costs: BatchCosts, base_rows: int, batch: int, model_draft: bool) -> float:
    """After how many steps without drafts a sequence of this batch probes (drafts one token): PROBE_INTERVAL
    where a probe is cheap, longer as it nears what it could win, never (inf) where it cannot win anything.

    share = what a probe adds to the step (its verification row, and its draft) over what the plain step spends
    per token, priced as every sequence of the batch probing at once (what the step adds over `batch` more rows,
    per row: a slope over that span, not between two neighbouring points of the measured curve, which noise can
    make flat). A draft accepted every time saves at most 1 - share of a token's cost a row, so probing for an
    easy text pays only while share < 1: the interval is PROBE_INTERVAL * max(1, share / (1 - share)), as long as
    at share = 1/2 and growing to never as share reaches 1. Where verification competes for compute (a large batch
    on a CPU: a row costs about what a plain token does) a probe of every idle sequence every PROBE_INTERVAL steps
    slowed the batch by ~4% with nothing to find; where rows are nearly free (memory-bound) it stays
    PROBE_INTERVAL."""
    plain = costs.step_seconds(base_rows, 0, 0, model_draft)
    every = costs.step_seconds(base_rows + batch, 1, batch, model_draft, base_rows)
    if plain is None or every is None or plain <= 0:
        return float(PROBE_INTERVAL)
    share = (every - plain) / plain  # (every - plain) / batch a probe, over plain / batch a token
    if share >= 1:
        return math.inf
    return PROBE_INTERVAL * max(1.0, share / (1 - share))


def choose_batch_k(stats: list[AcceptanceStats], caps: list[int], base_rows: int, costs: BatchCosts,
                   model_draft: bool) -> list[int]:
    """Each sequence's k (at most caps[i]) maximising the whole batch's expected tokens per second.

    Every draft token a sequence could add is a candidate worth its chance of being emitted (the product of
    the acceptance rates up to it); candidates are taken best first (which keeps each sequence's positions in
    order, as those chances only fall), and the number taken is the one with the best tokens per second,
    where the step costs the target forward over all its rows plus the draft. Zero drafts when drafting would
    slow the batch down; every cap while the target's cost or a draft model's is not measured (try the largest K,
    then learn; a lookup's cost, a small share of a step, counts as nothing until a drafting step measures it); one
    draft for a sequence due for a probe that would draft none (batch_probe_interval)."""
    drafts_unmeasured = model_draft and not costs.draft_forward.points
    plain = costs.step_seconds(base_rows, 0, 0, model_draft)
    if plain is None or (drafts_unmeasured and any(caps)):
        return list(caps)
    # A candidate worth less than what its row costs in plain tokens cannot raise the batch's tokens per second: a
    # row adds at least `least` seconds (the target's least slope over the rows the candidates may add; drafting
    # only adds to it), and a set that gains tokens per second keeps gaining without a candidate whose chance is
    # below least * batch / plain (its tokens per second is below plain decoding's, so adding it lowers any rate
    # above that). Leaving those out (a margin of 1e-6 over rounding) leaves the choice as it was, to the last
    # bit, and spares pricing them: at 64 sequences on a CPU a row costs ~0.7 of a token, and most sequences
    # offer nothing above that.
    least = costs.least_row_seconds(base_rows, base_rows + sum(caps))
    floor = least * len(caps) / plain * (1 - 1e-6) if plain > 0 else 0.0
    chances, owners, positions = [], [], []
    # A request that has drafted nothing yet (no counts) is priced by its prior alone: one chain for all of them.
    fresh: dict[tuple[int, int], list[float]] = {}
    for i, (s, cap) in enumerate(zip(stats, caps)):
        if not cap:
            continue
        if not s.reached:
            key = (id(s.prior), cap)
            chain = fresh.get(key)
            if chain is None:
                chain = fresh[key] = acceptance_chain(s.rates(cap), cap)
        elif floor <= 0 or s.rates(1)[0] > floor:  # a chain's chances only fall: its first is its best
            chain = acceptance_chain(s.rates(cap), cap)
        else:
            continue
        worth = cap
        if floor > 0:
            while worth and chain[worth - 1] <= floor:
                worth -= 1
        chances += chain[:worth]
        owners += [i] * worth
        positions += range(worth)
    chosen = [0] * len(caps)
    if chances and len(chances) <= FEW_CANDIDATES:
        chosen = _best_few(chances, owners, positions, len(caps), base_rows, costs, model_draft)
    elif chances:
        # Candidates best first (ties: the earlier position, then the earlier sequence); after the m best, the
        # batch verifies base_rows + m rows, max_k the deepest taken, `drafting` the sequences with one.
        gain, owner, position = np.array(chances), np.array(owners), np.array(positions)
        order = np.lexsort((owner, position, -gain))
        gain, owner, position = gain[order], owner[order], position[order]
        tokens = np.cumsum(np.concatenate([[float(len(caps))], gain]))[1:]  # added one by one, from len(caps)
        count = np.arange(1, len(order) + 1)
        first = np.zeros(len(order), dtype=np.int64)
        first[np.unique(owner, return_index=True)[1]] = 1
        rates = tokens / costs.steps_seconds(base_rows + count, np.maximum.accumulate(position + 1), np.cumsum(first),
                                             model_draft, base_rows)
        best = int(np.argmax(rates))
        if rates[best] > len(caps) / costs.step_seconds(base_rows, 0, 0, model_draft):
            taken = np.zeros(len(caps), dtype=np.int64)
            np.maximum.at(taken, owner[:best + 1], position[:best + 1] + 1)
            chosen = taken.tolist()
    idle = max(s.steps_without_drafts for s in stats)
    if idle < PROBE_INTERVAL:  # the shortest interval (spares pricing a probe on most steps)
        return chosen
    interval = batch_probe_interval(costs, base_rows, len(caps), model_draft)
    if idle < interval:
        return chosen
    # A probe's draft forward costs the same for one sequence or several: the idle ones half-way to theirs probe
    # in the same step, and from then on in step with each other.
    return [min(1, cap) if k == 0 and s.steps_without_drafts >= interval // 2 else k
            for k, cap, s in zip(chosen, caps, stats)]


def choose_tree_nodes(chances: list[list[float]], base_rows: int, costs: BatchCosts,
                      base_tokens: float = 0.0, plain_rows: int | None = None) -> list[int]:
    """How many of each sequence's candidate tree nodes to verify (taken best first) besides the rows every
    sequence verifies anyway, maximising the whole batch's expected tokens per second of verification:
    choose_batch_k's rule with tree nodes as the candidates, priced by the target forward's measured cost by rows
    (the tree is drafted already: its draft forwards are spent whatever is kept; its depth was chosen before
    drafting, by choose_batch_k).

    chances[i][j]: the expected contribution of the j-th best candidate of sequence i's tree to the accepted path,
    i.e. the probability that the path passes through it (for DETERMINISTIC children, the product of the
    target's probabilities along its path; a proposer estimates it by the draft's, EAGLE-2's path confidence,
    times a measured calibration), best first. A node's chance is at most its parent's, so a sequence's best-first
    nodes (ties by node order) always form a subtree. base_rows: the rows verified whatever is chosen;
    base_tokens: the expected accepted tokens of the nodes among them (each sequence's step emits one more).
    plain_rows: the step's rows without drafts (BatchCosts.target_seconds' base; None: priced by rows alone).
    Every sequence keeps all its candidates while the target's cost is not measured; 0 where none pays."""
    if costs.step_seconds(base_rows, 0, 0, False, plain_rows) is None:
        return [len(c) for c in chances]
    candidates = sorted((-chance, j, i) for i, seq_chances in enumerate(chances) for j, chance in enumerate(seq_chances))
    tokens = float(len(chances)) + base_tokens
    best_rate = tokens / costs.step_seconds(base_rows, 0, 0, False, plain_rows)
    best_m = 0
    for m, (neg_gain, _, _) in enumerate(candidates, start=1):
        tokens -= neg_gain
        rate = tokens / costs.step_seconds(base_rows + m, 0, 0, False, plain_rows)  # the target's forward over the rows
        if rate > best_rate:
            best_rate, best_m = rate, m
    chosen = [0] * len(chances)
    for _, _, i in candidates[:best_m]:
        chosen[i] += 1
    return chosen


class TreeCalibration:
    """How a proposer's node chances compare with what verification accepts: accepted path lengths over the sum
    of the verified nodes' chances, decayed (a draft's confidence is not its acceptance; the ratio corrects the
    chances choose_tree_nodes reads). Starts at 1."""

    def __init__(self) -> None:
        self.accepted = PRIOR_WEIGHT
        self.predicted = PRIOR_WEIGHT

    def update(self, predicted: float, accepted: int) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.predicted = self.predicted * DECAY + predicted

    @property
    def factor(self) -> float:
        return self.accepted / self.predicted if self.predicted > 0 else 1.0

"""Adaptive K: the cost model, the acceptance estimate, the choice, and the engine using them."""

import math

import pytest

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft import adaptive
from quickdraft.adaptive import AcceptanceStats, StepCosts, choose_k


def test_step_costs_interpolate_and_extrapolate():
    costs = StepCosts(8)
    assert costs.estimate(3) is None
    costs.record(0, 10.0)
    assert costs.estimate(0) == 10.0 and costs.estimate(4) > 10.0  # one point: the prior slope
    costs.record(4, 14.0)
    assert abs(costs.estimate(2) - 12.0) < 1e-9 and abs(costs.estimate(8) - 18.0) < 1e-9
    costs.record(4, 24.0)  # a moving average, not the last value
    assert 14.0 < costs.estimate(4) < 24.0


def test_unmeasured_draft_lengths_cost_the_rest_plus_their_draft_tokens():
    """A model draft's token costs a draft forward: with only K = 4 run (158 ms, 80 of them drafting), plain decoding
    costs about the rest's 78 ms (its prior slope below), not 0.8x of the whole step, and one draft token 20 ms."""
    costs = StepCosts(4)
    for _ in range(3):
        costs.record(4, 0.158, 0.080)
    assert costs.estimate(4) == pytest.approx(0.158)
    assert costs.estimate(0) == pytest.approx(0.078 * (1 - 4 * adaptive.PRIOR_COST_SLOPE))
    assert costs.estimate(1) == pytest.approx(0.078 * (1 - 3 * adaptive.PRIOR_COST_SLOPE) + 0.020)
    assert costs.draft_per_token() == pytest.approx(0.020)
    stats = AcceptanceStats()  # the fixed prior (0.6 a position): 4 drafts do not pay at 20 ms each
    assert choose_k(stats, costs, 4) == 1
    old = StepCosts(4)  # the whole steps alone (drafting not timed): the slope prior, which kept K = 4
    for _ in range(3):
        old.record(4, 0.158)
    assert choose_k(stats, old, 4) == 4


def test_a_flat_fit_of_two_draft_lengths_does_not_price_plain_decoding_as_drafting():
    """A slow step at k = 3 fits the curve flat over 3 and 4; the smaller k still shed their draft tokens."""
    costs = StepCosts(4)
    for _ in range(3):
        costs.record(4, 0.150, 0.080)
        costs.record(3, 0.160, 0.060)
    assert costs.estimate(3) == costs.estimate(4)  # measured, fitted non-decreasing
    assert costs.estimate(0) < 0.100 < costs.estimate(3)
    bad = AcceptanceStats()
    for _ in range(20):
        bad.update(4, 0)
    assert choose_k(bad, costs, 4) == 0


def test_a_draft_cost_measured_slow_is_forgotten_after_plain_steps():
    """A busy minute measures drafting at 3x its cost: adaptive K stops drafting, and with it every measurement
    of drafting. The draft's cost ages with the engine's steps, so after max_age plain steps it is forgotten (priced
    at FORGOTTEN_DRAFT_SHARE of its last measure, not at nothing) and a request that accepts well drafts again
    (before, it stayed at K = 0 for good)."""
    costs = StepCosts(4)
    for _ in range(9):
        costs.record(0, 0.054, 0.0)
        costs.record(2, 0.054 + 0.010 + 0.120, 0.120)  # 60 ms a draft token instead of 20
    good = AcceptanceStats()
    for _ in range(10):
        good.update(2, 2)
    assert choose_k(good, costs, 4) == 0
    for step in range(adaptive._Curve().max_age + 1):
        assert choose_k(good, costs, 4) == 0 or step >= adaptive._Curve().max_age - 1
        costs.record(0, 0.054, 0.0)
    assert costs.draft_per_token() == pytest.approx(adaptive.FORGOTTEN_DRAFT_SHARE * 0.060)
    assert choose_k(good, costs, 4) > 0


def test_the_plain_step_is_not_forgotten_while_a_request_drafts():
    """A request drafting one token a step for longer than max_age steps: the plain step keeps its measured cost.
    (Forgotten, it was extrapolated down from the one-draft steps' rest, which verifies two rows: 31 ms beside a
    26 ms plain step, and drafting looked that much cheaper beside it.)"""
    costs = StepCosts(4)
    for _ in range(9):
        costs.record(0, 0.026, 0.0)
    for _ in range(2 * adaptive._Curve().max_age):
        costs.record(1, 0.043, 0.012)
    assert costs.estimate(0) == pytest.approx(0.026)
    assert costs.estimate(1) == pytest.approx(0.043)


def test_step_costs_measured_minutes_apart_compare_at_the_machines_speed_now():
    """The Qwen pair on a 2-core CPU: a plain step 26 ms and a one-draft step 43 ms in a fast minute, 36 and 59 ms
    in a slow one. Plain steps last measured in the slow minute, then a fast minute of one-draft steps: the plain
    step is priced at the speed now (~26 ms), and a request accepting 0.55 (where one draft needs 0.65) stops
    drafting. Compared as measured (36 ms beside 43) it drafted on."""
    costs = StepCosts(4)
    for _ in range(9):  # the slow minute
        costs.record(0, 0.036, 0.0)
        costs.record(1, 0.059, 0.0165)
    for _ in range(12):  # the fast minute: drafting only
        costs.record(1, 0.043, 0.012)
    assert costs.estimate(0) == pytest.approx(0.026, rel=0.02)
    assert costs.estimate(1) == pytest.approx(0.043, rel=0.02)
    assert costs.draft_per_token() == pytest.approx(0.012, rel=0.02)
    stats = AcceptanceStats()
    for i in range(200):  # 11 of every 20 drafts accepted, evenly spread
        stats.update(1, int(i * 11 % 20 < 11))
    assert 0.5 < stats.rate(0) < 0.6
    assert choose_k(stats, costs, 4) == 0
    as_measured = StepCosts(4)
    as_measured.speed = 1.0
    for k, seconds in ((0, 0.036), (1, 0.043)):
        for _ in range(9):
            as_measured.curve.record(k, seconds)
    assert choose_k(stats, as_measured, 1) == 1


def test_one_slow_step_does_not_move_the_speed():
    costs = StepCosts(4)
    for _ in range(9):
        costs.record(0, 0.026, 0.0)
    costs.record(0, 0.080, 0.0)  # another process, once
    assert costs.speed == pytest.approx(1.0)
    assert costs.estimate(0) == pytest.approx(0.026)


def test_a_forgotten_draft_cost_does_not_buy_a_long_catch_up():
    """After 128 plain steps on long prompts the draft's cost was forgotten and priced at nothing: a RAG request
    accepting well then paid 1.3 s for the Qwen 0.5B to read its 727-token prompt with 58 tokens left to earn it.
    Forgotten, a draft token costs FORGOTTEN_DRAFT_SHARE of its last measure, and that catch-up is not bought."""
    costs = StepCosts(5)
    for _ in range(9):
        costs.record(0, 0.026, 0.0)
        costs.record(5, 0.108, 0.059)
    costs.record_catch_up(1, 50, 0.012 + 50 * 0.0019)
    for _ in range(adaptive._Curve().max_age + 1):
        costs.record(0, 0.026, 0.0)
    assert costs.draft_per_token() == pytest.approx(FORGOTTEN := adaptive.FORGOTTEN_DRAFT_SHARE * 0.059 / 5)
    assert FORGOTTEN > 0
    good = AcceptanceStats()
    for _ in range(10):
        good.update(5, 5)
    assert choose_k(good, costs, 5, catch_up_s=727 * costs.catch_up_per_token(), remaining=58) == 0
    assert choose_k(good, costs, 5) == 5  # nothing to read: a request accepting well drafts again


def test_batch_draft_costs_age_with_steps_that_do_not_draft():
    from quickdraft.adaptive import BatchCosts

    costs = BatchCosts()
    costs.record(3, 0.060, 2, 2, 0.500)  # a slow draft forward, once
    for _ in range(adaptive._Curve().max_age + 1):
        costs.record(1, 0.050, 0, 0, 0.0)
    assert costs.draft_forward.points == {}
    assert costs.lookup.points == {}
    assert costs.target.points


def test_a_request_at_k0_probes_one_draft_every_probe_interval_steps():
    """Where the engine's prior does not pay for a draft, decaying toward it never made a request
    draft again: it now drafts one token after PROBE_INTERVAL steps without, and keeps drafting if that was
    accepted."""
    costs = StepCosts(4)
    for _ in range(9):  # the Qwen pair on a 2-core CPU: a draft token ~30 ms beside a 54 ms plain step
        costs.record(0, 0.054, 0.0)
        costs.record(2, 0.115, 0.060)
    stats = AcceptanceStats()  # the fixed prior, 0.6 a position
    for _ in range(5):
        stats.update(2, 0)
    ks = []
    for _ in range(2 * adaptive.PROBE_INTERVAL + 2):
        k = choose_k(stats, costs, 4)
        ks.append(k)
        stats.update(k, 0)  # nothing is ever accepted
    assert set(ks) == {0, 1}
    assert [i for i, k in enumerate(ks) if k] == [adaptive.PROBE_INTERVAL, 2 * adaptive.PROBE_INTERVAL + 1]
    assert choose_k(stats, costs, 0) == 0  # a sequence capped at 0 never probes
    for _ in range(adaptive.PROBE_INTERVAL):
        stats.update(0, 0)
    assert choose_k(stats, costs, 4) == 1
    stats.update(1, 1)  # the probe was accepted: the text turned easy
    for _ in range(5):  # drafting on without waiting for the next probe
        k = choose_k(stats, costs, 4)
        assert k >= 1
        stats.update(k, k)


def test_batch_probes_are_taken_together():
    from quickdraft.adaptive import BatchCosts, batch_probe_interval, choose_batch_k

    costs = BatchCosts()
    for rows in (3, 6, 9):
        for _ in range(3):
            costs.record(rows, 0.050 + 0.010 * rows, 3, 3, 0.009)  # a draft forward: 3 ms
    # A probe (a row, a draft forward) costs under half of what the plain step spends a token: the plain interval.
    assert batch_probe_interval(costs, 3, 3, model_draft=True) == adaptive.PROBE_INTERVAL
    stats = [AcceptanceStats() for _ in range(3)]
    for s in stats:
        for _ in range(10):
            s.update(3, 0)
    assert choose_batch_k(stats, [4, 4, 4], 3, costs, model_draft=True) == [0, 0, 0]
    for _ in range(adaptive.PROBE_INTERVAL):
        stats[0].update(0, 0)
    for _ in range(adaptive.PROBE_INTERVAL // 2):
        stats[1].update(0, 0)
    for _ in range(adaptive.PROBE_INTERVAL // 2 - 1):
        stats[2].update(0, 0)
    assert choose_batch_k(stats, [4, 0, 4], 3, costs, model_draft=True) == [1, 0, 0]  # sequence 1 is capped
    assert choose_batch_k(stats, [4, 4, 4], 3, costs, model_draft=True) == [1, 1, 0]


def test_a_batch_probes_only_where_a_draft_could_win_something():
    """A probe's row costs about what a plain token does where verification competes for compute (64 sequences on
    a CPU): no acceptance could pay for drafting there, so idle sequences do not probe at all (they did every
    PROBE_INTERVAL steps, ~4% of a batch's time on this CPU's 64-sequence steps); the interval stretches as a probe
    nears that cost, and stays PROBE_INTERVAL where rows are nearly free."""
    from quickdraft.adaptive import BatchCosts, batch_probe_interval, choose_batch_k

    compute_bound, memory_bound, halfway = BatchCosts(), BatchCosts(), BatchCosts()
    for _ in range(3):
        for rows in range(64, 72):
            compute_bound.record(rows, 0.002 + 0.0011 * rows, 1, 0, 0.0003)  # a row: 1.1 ms, a token: 1.1 ms
        for rows in range(4, 12):
            memory_bound.record(rows, 0.010 + 0.0005 * rows, 1, 0, 0.0003)
            halfway.record(rows, 0.010 + 0.002 * rows, 1, 0, 0.0003)
    assert batch_probe_interval(compute_bound, 64, 64, model_draft=False) == math.inf
    assert batch_probe_interval(memory_bound, 4, 4, model_draft=False) == adaptive.PROBE_INTERVAL
    assert adaptive.PROBE_INTERVAL < batch_probe_interval(halfway, 4, 4, model_draft=False) < math.inf
    idle = [AcceptanceStats() for _ in range(64)]
    for s in idle:
        for _ in range(10 * adaptive.PROBE_INTERVAL):
            s.update(0, 0)
    assert choose_batch_k(idle, [4] * 64, 64, compute_bound, model_draft=False) == [0] * 64
    assert min(choose_batch_k(idle[:4], [4] * 4, 4, memory_bound, model_draft=False)) >= 1


def test_an_unmeasured_lookup_cost_does_not_make_a_batch_draft_every_cap():
    """A lookup's cost is forgotten after max_age steps without drafts; the batch then weighs drafts by the
    target's measured cost (a lookup counted as free) instead of drafting every cap to measure it (64 sequences
    x 5 drafts: a step ~4x as long as a plain one on this CPU)."""
    from quickdraft.adaptive import BatchCosts, choose_batch_k

    costs = BatchCosts()
    for _ in range(3):
        for rows in range(64, 72):
            costs.record(rows, 0.002 + 0.0011 * rows, 0, 0, None)
    assert not costs.lookup.points
    assert choose_batch_k([_half() for _ in range(64)], [5] * 64, 64, costs, model_draft=False) == [0] * 64
    assert choose_batch_k([_half() for _ in range(4)], [5] * 4, 4, BatchCosts(), model_draft=False) == [5] * 4


def test_a_request_accepting_every_single_draft_tries_a_deeper_one():
    """Position 1 never reached leans on this request's rate at position 0 where that beats the prior: at K = 1
    with every draft accepted, a second draft is priced at ~that rate, not the prior's 0.6, and tried."""
    costs = StepCosts(4)
    for _ in range(9):
        costs.record(0, 0.054, 0.0)
        costs.record(1, 0.081, 0.027)
        costs.record(2, 0.100, 0.054)
    stats = AcceptanceStats()
    for _ in range(20):
        stats.update(1, 1)
    assert stats.rate(1) == pytest.approx(stats.rate(0), abs=0.05) and stats.rate(1) > 0.9
    assert choose_k(stats, costs, 4) >= 2
    fails_second = AcceptanceStats()  # and where the second draft is measured to fail, its counts say so
    for _ in range(20):
        fails_second.update(2, 1)
    assert fails_second.rate(0) > 0.9 and fails_second.rate(1) < 0.1
    assert choose_k(fails_second, costs, 4) == 1


def _qwen_pair_costs(plain: float = 0.054, row: float = 0.010, draft: float = 0.024, repeats: int = 3) -> StepCosts:
    """The Qwen 1.5B + 0.5B pair's one-sequence step costs on a 2-core CPU: by default a 54 ms plain step, ~10 ms a
    target row, 24 ms a draft token (benchmarks/RESULTS.md, session 24)."""
    costs = StepCosts(4)
    for _ in range(repeats):
        for k in range(5):
            costs.record(k, plain + k * (row + draft), k * draft)
    return costs


def test_a_catch_up_is_paid_by_drafting_only_where_the_request_can_still_earn_it():
    """A summarization prompt of ~700 tokens costs the draft ~3.4 s to read: with 128 tokens left, no acceptance
    earns that back (plain decoding); with 2048 left it does. Nothing to read: drafting as before."""
    costs = _qwen_pair_costs()
    good = AcceptanceStats()
    for _ in range(10):
        good.update(4, 4)
    assert choose_k(good, costs, 4) == 4
    assert choose_k(good, costs, 4, catch_up_s=3.4, remaining=128) == 0
    assert choose_k(good, costs, 4, catch_up_s=3.4, remaining=2048) == 4
    assert choose_k(good, costs, 4, catch_up_s=0.0, remaining=128) == 4


def test_what_a_request_may_still_generate_is_learned_from_recent_requests():
    """Spec-Bench's translation answers on the Qwen pair: 18, 32, 11 and 26 of 64 tokens. A new request is expected
    to generate their mean, one 20 tokens in the mean of what the longer ones went on to; one longer than all of
    them, and one with nothing known, its max_tokens. A request that ended at its max_tokens counts as this one's."""
    lengths = adaptive.OutputLengths()
    assert lengths.expected_remaining(0, 64) == 64
    for generated in (18, 32, 11, 26):
        lengths.record(generated, at_max_tokens=False)
    assert lengths.expected_remaining(0, 64) == pytest.approx((18 + 32 + 11 + 26) / 4)
    assert lengths.expected_remaining(20, 64) == pytest.approx(((32 - 20) + (26 - 20)) / 2)
    assert lengths.expected_remaining(40, 64) == 24
    assert lengths.expected_remaining(0, 16) == pytest.approx((16 + 16 + 11 + 16) / 4)  # capped by this one's
    lengths.record(64, at_max_tokens=True)
    assert lengths.expected_remaining(40, 256) == 256 - 40
    for _ in range(adaptive.OUTPUT_LENGTH_WINDOW):  # the window: only the latest requests count
        lengths.record(300, at_max_tokens=False)
    assert lengths.expected_remaining(0, 1000) == 300


def test_a_short_answers_catch_up_is_priced_over_what_it_may_still_generate():
    """The Qwen pair on a 2-core CPU (a 26 ms plain step, 12 ms a draft token, 5 ms a verified row, 2.1 ms a prompt
    token for the draft to read) and a qa prompt of 40 tokens, drafts accepted 0.8 of the time: spread over 64
    tokens the prompt's reading pays, over the ~20 that qa answers ran to it does not."""
    costs = _qwen_pair_costs(plain=0.026, row=0.005, draft=0.012, repeats=9)
    stats = AcceptanceStats()
    for i in range(100):  # 8 of every 10 single drafts accepted, evenly spread
        stats.update(1, int(i * 8 % 10 < 8))
    catch_up = 40 * 0.0021
    assert choose_k(stats, costs, 4, catch_up, remaining=64) > 0
    lengths = adaptive.OutputLengths()
    for generated in (24, 17, 17, 21):
        lengths.record(generated, at_max_tokens=False)
    assert choose_k(stats, costs, 4, catch_up, remaining=lengths.expected_remaining(0, 64)) == 0


def test_a_probe_does_not_pay_a_catch_up_that_no_acceptance_could_earn():
    costs = _qwen_pair_costs()
    idle = AcceptanceStats()
    for _ in range(5):
        idle.update(2, 0)
    for _ in range(adaptive.PROBE_INTERVAL):
        idle.update(0, 0)
    assert idle.due_for_probe
    assert choose_k(idle, costs, 4) == 1
    assert choose_k(idle, costs, 4, catch_up_s=3.4, remaining=100) == 0
    assert choose_k(idle, costs, 4, catch_up_s=0.05, remaining=100) == 1  # a short stretch to catch up on


def test_catch_up_cost_per_token_is_the_drafting_less_its_draft_tokens():
    costs = _qwen_pair_costs()
    assert costs.catch_up_per_token() == 0.0  # not measured: not priced
    costs.record_catch_up(3, 700, 3 * 0.024 + 700 * 0.0056)
    assert costs.catch_up_per_token() == pytest.approx(0.0056)


def test_acceptance_counts_positions_reached():
    stats = AcceptanceStats()
    assert abs(stats.expected_tokens(0) - 1.0) < 1e-12
    for _ in range(50):
        stats.update(proposed=4, accepted=4)
    assert stats.rate(0) > 0.95 and stats.expected_tokens(4) > 4.5
    for _ in range(50):
        stats.update(proposed=4, accepted=0)  # only position 0 was judged
    assert stats.rate(0) < 0.1
    assert stats.rate(3) > 0.5  # never reached since: back toward the prior, not down to 0


def test_choose_k_follows_acceptance_and_cost():
    costs = StepCosts(6)
    for k in range(7):
        costs.record(k, 10.0 + 0.2 * k)  # verifying is cheap, as in bf16 on AMX
    good, bad = AcceptanceStats(), AcceptanceStats()
    for _ in range(40):
        good.update(6, 6)
        bad.update(6, 0)
    assert choose_k(good, costs, 6) == 6
    expensive = StepCosts(6)
    for k in range(7):
        expensive.record(k, 10.0 + 8.0 * k)  # each draft token costs most of a target forward
    assert choose_k(bad, expensive, 6) == 0
    assert choose_k(AcceptanceStats(), StepCosts(6), 6) == 6  # nothing measured yet: try the largest K


def _record_cheap_drafts(costs: StepCosts, max_k: int = 4) -> StepCosts:
    """Step costs where a draft token costs 0.3 of a plain step (a full median window at every k, so they are the
    only costs it reads): at the fixed prior of 0.6 a position one draft pays best, at ~0.9 every one up to max_k."""
    for _ in range(9):
        for k in range(max_k + 1):
            costs.record(k, 1.0 + 0.3 * k)
    return costs


def test_acceptance_prior_is_the_fixed_guess_without_history():
    prior = adaptive.AcceptancePrior()
    assert [prior.rate(i) for i in range(6)] == [adaptive.PRIOR_ACCEPTANCE] * 6
    prior.update(0, 0)  # a plain step: no evidence, nothing learned or forgotten
    assert prior.reached == [] and prior.rate(0) == adaptive.PRIOR_ACCEPTANCE
    request = AcceptanceStats(prior)
    assert [request.rate(i) for i in range(6)] == [AcceptanceStats().rate(i) for i in range(6)]
    request.update(4, 4)  # one step: it feeds the prior, which moves by less than the request's own estimate
    assert adaptive.PRIOR_ACCEPTANCE < prior.rate(0) < 0.7 < request.rate(0)



def test_the_prior_falls_to_what_drafting_steps_accept_and_probes_keep_it_learning():
    """No optimism floor: a pair whose drafts are never accepted teaches the engine's prior so, a new request
    starts at K = 0 where a draft costs 0.3 of a step, and still probes one draft every PROBE_INTERVAL steps; an
    accepted probe feeds the prior (it learns from probes too)."""
    never = adaptive.AcceptancePrior()
    for _ in range(200):
        never.update(4, 0)
    assert all(never.rate(i) < 0.05 for i in range(6))
    costs = _record_cheap_drafts(StepCosts(4))
    fresh = AcceptanceStats(never)
    ks = []
    for _ in range(adaptive.PROBE_INTERVAL + 1):
        k = choose_k(fresh, costs, 4)
        ks.append(k)
        fresh.update(k, 0)
    assert ks == [0] * adaptive.PROBE_INTERVAL + [1]
    before = never.rate(0)
    for _ in range(3):
        AcceptanceStats(never).update(1, 1)  # probes that pass
    assert never.rate(0) > before


def test_a_new_request_after_high_acceptance_requests_starts_at_max_k():
    costs, prior = _record_cheap_drafts(StepCosts(4)), adaptive.AcceptancePrior()
    assert choose_k(AcceptanceStats(), costs, 4) == 1  # the fixed prior: a fresh request starts shallow
    assert choose_k(AcceptanceStats(prior), costs, 4) == 1  # nothing learned yet: the same
    for _ in range(20):  # earlier requests whose drafts were all accepted, two positions deep
        request = AcceptanceStats(prior)
        for _ in range(10):
            request.update(2, 2)
    assert prior.rate(0) > 0.95 and prior.rate(1) > 0.95
    assert prior.rate(5) == prior.rate(1)  # never reached: priced as the deepest learned position, not the guess
    assert choose_k(AcceptanceStats(prior), costs, 4) == 4
    # Its own drafts failing, a request still drops to plain decoding within a few steps.
    failing = AcceptanceStats(prior)
    for _ in range(5):
        failing.update(4, 0)
    assert choose_k(failing, costs, 4) == 0
    # Its counts decayed (steps at K = 0), it returns toward the learned prior and drafts again.
    for _ in range(40):
        failing.update(0, 0)
    assert choose_k(failing, costs, 4) == 4


def test_the_engine_learns_a_prior_per_draft_kind():
    """After requests whose drafts are all accepted (the draft is the target), a new request's first drafting
    step takes max K under costs where an engine with no history drafts one token; a kind the engine has not
    drafted keeps the fixed guess."""
    target = tiny_llama(seed=0)

    def engine():
        return LLM(target, speculative_config={"method": "draft_model", "model": target,
                                               "num_speculative_tokens": 4}).engine

    def first_drafting_step(engine, prompt):
        seq = engine.new_sequence(prompt, SamplingParams(temperature=0, max_tokens=40))
        engine.step(seq)  # the prompt: no drafts
        _record_cheap_drafts(engine.policy.step_costs)  # before every step: the choices do not depend on timing
        engine.step(seq)
        return seq, seq.metrics.proposed_tokens

    experienced = engine()
    for i in range(4):
        seq, _ = first_drafting_step(experienced, [2, 7, 1, 8 + i])
        while not seq.finished:
            _record_cheap_drafts(experienced.policy.step_costs)
            experienced.step(seq)
        assert seq.metrics.accepted_tokens == seq.metrics.proposed_tokens > 0
    prior = experienced.policy.acceptance_prior("model")
    assert prior.rate(0) > 0.9
    seq, drafted = first_drafting_step(experienced, [3, 1, 4, 1, 5])
    assert drafted == 4 and seq.acceptance_for("model").prior is prior
    assert first_drafting_step(engine(), [3, 1, 4, 1, 5])[1] == 1  # no history: the fixed prior of 0.6 a position
    assert experienced.policy.acceptance_prior("lookup").reached == []
    lookup = seq.acceptance_for("lookup", experienced.policy.acceptance_prior("lookup"))
    assert lookup.rate(0) == adaptive.PRIOR_ACCEPTANCE
    assert choose_k(lookup, _record_cheap_drafts(StepCosts(4)), 4) == 1


def test_engine_drops_to_plain_decoding_when_drafts_never_match():
    target = tiny_llama(seed=0)
    llm = LLM(target, speculative_config={"method": "draft_model", "model": tiny_llama(seed=9),
                                          "num_speculative_tokens": 4})
    for k in range(5):  # a draft step costs like a target step here, and the draft is a different model
        llm.engine.policy.step_costs.record(k, 1.0 + 1.0 * k)
    out = llm.generate({"prompt_token_ids": [3, 1, 4, 1, 5]}, SamplingParams(temperature=0, max_tokens=60))[0]
    m = out.metrics
    # Some steps still probe, as the estimates decay toward the prior, but most are plain.
    assert m.target_forwards > 0 and m.proposed_tokens < 4 * m.target_forwards / 2


def test_a_draft_catching_up_after_plain_steps_is_not_timed_as_the_cost_of_drafting():
    from quickdraft.engine import Engine

    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "draft_model", "model": tiny_llama(seed=1),
                                                      "num_speculative_tokens": 2, "adaptive": False})
    proposer = llm.proposer
    seq = llm.engine.new_sequence([3, 1, 4, 1, 5], SamplingParams(temperature=0, max_tokens=40))
    plain = Engine(llm.target, proposer, 0)  # steps that leave the draft behind
    llm.engine.step(seq)  # the prompt (the target alone)
    first = proposer.propose(seq, 2)
    assert first.catch_up == len(seq.token_ids) - 2  # a first proposal reads the whole history
    llm.engine.step(seq)
    assert proposer.propose(seq, 2).catch_up == 0  # in step: only what the last step committed
    for _ in range(4):
        plain.step(seq)
    assert proposer.propose(seq, 2).catch_up >= 2  # four plain steps missed: 3 or 4 tokens to read, 2 in step

    adaptive = Engine(llm.target, proposer, 2, adaptive_k=True)
    for _ in range(6):
        plain.step(seq)
    adaptive.policy.step_costs.record(0, 0.01)
    before = dict(adaptive.policy.step_costs.curve.points)
    adaptive.step(seq)  # max K with costs unmeasured -> drafts, after a catch-up: not recorded
    assert adaptive.policy.step_costs.curve.points == before


def _stats(proposed, accepted, times=40):
    stats = AcceptanceStats()
    for _ in range(times):
        stats.update(proposed, accepted)
    return stats


def _half(proposed=4):
    """A sequence whose first draft is accepted half of the time, and nothing after it."""
    stats = AcceptanceStats()
    for i in range(40):
        stats.update(proposed, i % 2)
    return stats


def _costs(per_row, base=10.0, rows=(1, 8, 64, 256)):
    from quickdraft.adaptive import BatchCosts

    costs = BatchCosts()
    for r in rows:
        costs.record(r, base + per_row * r, 0, 0, None)
    costs.lookup.record(1, 0.001)  # an n-gram lookup per drafting sequence
    return costs


def test_batch_k_drafts_while_rows_are_nearly_free():
    from quickdraft.adaptive import choose_batch_k

    good = [_stats(4, 4) for _ in range(16)]
    assert choose_batch_k(good, [4] * 16, 16, _costs(per_row=0.01), model_draft=False) == [4] * 16


def test_batch_k_stops_drafting_where_verification_competes_for_compute():
    from quickdraft.adaptive import choose_batch_k

    middling = [_half() for _ in range(64)]
    # Compute-bound: every row costs as much as the whole memory-bound base spread over 5 rows.
    assert choose_batch_k(middling, [4] * 64, 64, _costs(per_row=2.0), model_draft=False) == [0] * 64
    # Memory-bound at the same batch: drafting pays.
    assert min(choose_batch_k(middling, [4] * 64, 64, _costs(per_row=0.001), model_draft=False)) >= 1


def test_batch_k_gives_drafts_to_the_sequences_that_accept_them():
    from quickdraft.adaptive import choose_batch_k

    stats = [_stats(4, 4), _stats(4, 0), _stats(4, 4), _stats(4, 0)]
    ks = choose_batch_k(stats, [4, 4, 4, 0], 4, _costs(per_row=1.0), model_draft=False)
    assert ks[0] >= 3 and ks[1] == 0 and ks[3] == 0 and ks[2] >= 3
    from quickdraft.adaptive import BatchCosts
    assert choose_batch_k(stats, [4, 4, 2, 0], 4, BatchCosts(), model_draft=True) == [4, 4, 2, 0]  # unmeasured


def test_batch_k_counts_the_draft_model_forwards():
    from quickdraft.adaptive import choose_batch_k

    unmeasured = _costs(per_row=0.0)
    assert choose_batch_k([_half() for _ in range(4)], [4, 2, 0, 4], 4, unmeasured, model_draft=True) == [4, 2, 0, 4]
    costs = _costs(per_row=0.0)
    for drafting in (1, 4):
        costs.draft_forward.record(drafting, 9.0)  # a draft forward costs nearly a target forward
    middling = [_half() for _ in range(4)]
    assert choose_batch_k(middling, [4] * 4, 4, costs, model_draft=True) == [0] * 4
    cheap = _costs(per_row=0.0)
    cheap.draft_forward.record(4, 0.5)
    assert min(choose_batch_k(middling, [4] * 4, 4, cheap, model_draft=True)) >= 1


def test_one_slow_step_does_not_make_more_rows_look_cheaper():
    from quickdraft.adaptive import BatchCosts, _Curve, choose_batch_k

    curve = _Curve()
    for _ in range(8):
        curve.record(16, 0.045)
        curve.record(17, 0.047)
    curve.record(16, 0.400)  # a stall (another process): the median moves little
    assert curve.estimate(16, 0.0) == 0.045
    for _ in range(20):
        curve.record(16, 0.050)  # a base that really reads slower than its neighbour: pooled, monotone
    assert curve.estimate(17, 0.0) >= curve.estimate(16, 0.0) > 0.045
    assert curve.estimate(40, 0.0) >= curve.estimate(17, 0.0)

    costs = BatchCosts()
    for _ in range(7):
        costs.record(16, 0.045, 0, 0, None)  # 16 sequences decoding
        costs.record(17, 0.047, 1, 0, 0.0005)  # one of them drafting one token
        costs.record(20, 0.053, 1, 0, 0.0005)
    for _ in range(2):
        costs.record(16, 0.400, 0, 0, None)  # two stalls: a moving average would price 16 rows above 17
    middling = [_half() for _ in range(16)]  # first drafts accepted half of the time
    # A row costs ~2 ms against ~2.8 ms per token of the plain step: a half-accepted draft does not pay.
    assert choose_batch_k(middling, [4] * 16, 16, costs, model_draft=False) == [0] * 16


def test_points_not_measured_for_a_while_are_forgotten():
    from quickdraft.adaptive import _Curve

    curve = _Curve(max_age=20)
    curve.record(40, 0.050)  # measured once, long ago (a prefill of 40 rows, say)
    for _ in range(30):
        curve.record(16, 0.045)
        curve.record(20, 0.060)
    assert 40 not in curve.points
    assert curve.estimate(40, 0.0) == pytest.approx(0.045 + (0.060 - 0.045) / 4 * 24)  # extrapolated, not flat


def _random_stats(count=6, seed=7):
    """Requests with decayed counts from random steps (proposed 0..6, accepted up to proposed)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        stats = AcceptanceStats()
        for _ in range(30):
            proposed = rng.randint(0, 6)
            stats.update(proposed, rng.randint(0, proposed))
        out.append(stats)
    return out


def _random_batch_stats(rng, size: int) -> list[AcceptanceStats]:
    """A batch's requests sharing one engine prior, each with up to 30 random steps (proposed 0..5)."""
    prior = adaptive.AcceptancePrior()
    stats = []
    for _ in range(size):
        s = AcceptanceStats(prior)
        for _ in range(rng.randint(0, 30)):
            proposed = rng.randint(0, 5)
            s.update(proposed, rng.randint(0, proposed))
        stats.append(s)
    return stats


def test_expected_tokens_and_choices_are_the_same_to_the_last_bit():
    """Adaptive K takes its formulas from quickdraft/speedup_model.py: E(k) accumulated left to right as its own
    loops did before (commit e56b434), and the same K picked for the same inputs. The pinned figures are those since
    session 24, when a rarely reached position began to lean on the one before it (AcceptanceStats.rate)."""
    from quickdraft.adaptive import BatchCosts, choose_batch_k

    requests = _random_stats()
    for stats in requests:
        for k in range(9):
            total, survive = 1.0, 1.0  # e56b434's AcceptanceStats.expected_tokens
            for i in range(k):
                survive *= stats.rate(i)
                total += survive
            assert stats.expected_tokens(k).hex() == total.hex()
    assert [stats.expected_tokens(4).hex() for stats in requests] == [
        "0x1.236151dea9ce9p+1", "0x1.57c7699c87007p+1", "0x1.a56c7a84efd6ep+1", "0x1.6f35d62b71921p+1",
        "0x1.8dc6514783cdep+1", "0x1.8ad5387e18201p+1"]

    step_costs = StepCosts(8)
    for k, seconds in [(0, 0.010), (2, 0.0112), (5, 0.0135), (8, 0.0171), (2, 0.0109)]:
        step_costs.record(k, seconds)
    assert [choose_k(stats, step_costs, max_k) for stats in requests for max_k in (1, 4, 8)] == \
        [1, 3, 3, 1, 4, 5, 1, 4, 5, 1, 3, 3, 1, 4, 5, 1, 4, 5]

    lookup, model = BatchCosts(), BatchCosts()
    for rows, seconds, drafting, forwards, draft_s in [(6, 0.03, 0, 0, None), (12, 0.033, 6, 0, 0.0012),
                                                        (20, 0.041, 4, 0, 0.0009), (40, 0.06, 0, 0, None)]:
        lookup.record(rows, seconds, drafting, forwards, draft_s)
    for rows, seconds, drafting, forwards, draft_s in [(6, 0.03, 0, 0, None), (12, 0.033, 6, 3, 0.012),
                                                        (20, 0.041, 4, 4, 0.02)]:
        model.record(rows, seconds, drafting, forwards, draft_s)
    chosen = [choose_batch_k(requests, caps, 6, costs, model_draft) for caps in ([4] * 6, [8, 2, 0, 5, 3, 1])
              for costs, model_draft in ((lookup, False), (model, True))]
    assert chosen == [[1, 3, 4, 2, 3, 4], [1, 1, 2, 2, 2, 1], [1, 2, 0, 2, 3, 1], [1, 2, 0, 2, 2, 1]]


# --- token trees ("tree": "auto") --------------------------------------------------------------------------------
def _tree_costs(per_row: float, draft_per_forward: float = 0.0) -> "adaptive.BatchCosts":
    costs = adaptive.BatchCosts()
    for rows in range(1, 40):
        costs.record(rows, 1.0 + per_row * (rows - 1), 1, 0, draft_per_forward)  # a lookup draft
    return costs


def test_choose_tree_nodes_keeps_whole_trees_until_the_target_cost_is_measured():
    assert adaptive.choose_tree_nodes([[0.9, 0.5], [0.2]], 2, adaptive.BatchCosts()) == [2, 1]


def test_choose_tree_nodes_prices_rows_against_chances():
    chances = [[0.9, 0.6, 0.3, 0.05, 0.01]]
    # Rows nearly free: every node whose chance is above the cost of one more row pays (the draft is spent).
    assert adaptive.choose_tree_nodes(chances, 1, _tree_costs(0.001)) == [5]
    # A row costs 10% of a step: a node pays while its chance beats the marginal cost (0.05 and 0.01 do not).
    assert adaptive.choose_tree_nodes(chances, 1, _tree_costs(0.1)) == [3]
    # Rows as dear as a whole step: no tree at all.
    assert adaptive.choose_tree_nodes(chances, 1, _tree_costs(1.5)) == [0]


def test_choose_tree_nodes_takes_the_best_nodes_of_the_batch_first():
    chances = [[0.9, 0.1], [0.8, 0.7, 0.02]]
    assert adaptive.choose_tree_nodes(chances, 2, _tree_costs(0.05)) == [1, 2]


def test_tree_calibration_moves_toward_the_accepted_share():
    calibration = adaptive.TreeCalibration()
    assert calibration.factor == 1.0
    for _ in range(40):
        calibration.update(predicted=4.0, accepted=2)
    assert calibration.factor == pytest.approx(0.5, abs=0.01)


def test_choose_tree_nodes_weighs_extra_nodes_against_the_tokens_already_kept():
    # A row costs 10% of a step; a candidate of chance 0.3 pays while the kept nodes expect few tokens, not once
    # they expect 3 (a kept chain): 1.3 / 1.1 > 1 / 1, but 4.3 / 1.1 < 4 / 1.
    assert adaptive.choose_tree_nodes([[0.3]], 1, _tree_costs(0.1)) == [1]
    assert adaptive.choose_tree_nodes([[0.3]], 1, _tree_costs(0.1), base_tokens=3.0) == [0]


def test_a_batch_of_few_candidates_chooses_as_the_numpy_path_does(monkeypatch):
    """choose_batch_k picks among few candidates in plain Python (cheaper in the engine's loop) and among many with
    numpy: the same arithmetic in the same order, so the same choices on random batches, costs and draft kinds."""
    import random

    from quickdraft.adaptive import BatchCosts, choose_batch_k

    rng = random.Random(3)
    cases = []
    for _ in range(60):
        size = rng.randint(1, 8)
        stats = _random_batch_stats(rng, size)
        costs, model_draft = BatchCosts(), rng.random() < 0.5
        for _ in range(rng.randint(1, 40)):
            rows, drafting = rng.randint(1, 4 * size), rng.randint(0, size)
            costs.record(rows, 0.004 + 0.001 * rows * rng.uniform(0.5, 1.5), drafting,
                         drafting if model_draft else 0, 0.0002 * drafting * rng.uniform(0.5, 2) if drafting else None)
        cases.append((stats, [rng.choice([0, 1, 3, 5]) for _ in range(size)], size, costs, model_draft))
    monkeypatch.setattr(adaptive, "FEW_CANDIDATES", 10 ** 9)
    few = [choose_batch_k(*case) for case in cases]
    monkeypatch.setattr(adaptive, "FEW_CANDIDATES", 0)
    many = [choose_batch_k(*case) for case in cases]
    assert few == many and any(map(any, few)) and not all(map(all, few))


def test_leaving_out_candidates_below_a_rows_cost_leaves_the_batch_choice_as_it_was(monkeypatch):
    """choose_batch_k leaves out the draft candidates whose chance is below what their row costs in plain tokens
    (the target's least slope over the rows they may add, times the batch, over the plain step): the same choices,
    to the last bit, as pricing every candidate, on random batches and costs where rows are dear and cheap."""
    import random

    from quickdraft.adaptive import BatchCosts, _Curve, choose_batch_k

    rng = random.Random(5)
    cases, pruned = [], 0
    for _ in range(80):
        size = rng.randint(1, 24)
        stats = _random_batch_stats(rng, size)
        costs, model_draft = BatchCosts(), rng.random() < 0.3
        per_row = rng.choice([0.0002, 0.001, 0.004, 0.01])  # a row from ~2% to ~5x of a plain token's share
        for _ in range(rng.randint(1, 40)):
            rows, drafting = rng.randint(size, 6 * size), rng.randint(0, size)
            costs.record(rows, 0.01 + per_row * rows * rng.uniform(0.8, 1.2), drafting,
                         drafting if model_draft else 0, 0.0002 * drafting if drafting else None)
        caps = [rng.choice([0, 1, 3, 5]) for _ in range(size)]
        plain = costs.step_seconds(size, 0, 0, model_draft)
        floor = costs.target.least_slope(size, size + sum(caps), adaptive.PRIOR_COST_SLOPE) * size / plain
        pruned += sum(1 for s, cap in zip(stats, caps) if cap and s.rates(1)[0] <= floor)
        cases.append((stats, caps, size, costs, model_draft))
    chosen = [choose_batch_k(*case) for case in cases]
    monkeypatch.setattr(_Curve, "least_slope", lambda self, lo, hi, prior_slope: 0.0)  # price every candidate
    assert [choose_batch_k(*case) for case in cases] == chosen
    assert pruned > 20 and any(map(any, chosen)) and not all(map(all, chosen))


def test_draft_rows_are_priced_by_what_they_added_to_the_step_they_joined():
    """A step's cost drifts (longer contexts, the machine's hour) by more than a row costs. Priced by the curve by
    rows alone, a drafting size sampled early (cheap) sat beside a base measured late (dear), and the row between
    them looked free; priced by what the drafts added to the base as measured then, it costs what it did."""
    from quickdraft.adaptive import BatchCosts, choose_batch_k

    costs = BatchCosts()
    for _ in range(9):
        costs.record(4, 0.0055, 0, 0, None)  # 4 sequences decoding, early in their text
    costs.record(5, 0.0066, 1, 0, 0.00001, draft_rows=1)  # one drafts a token: +1.1 ms
    for _ in range(9):
        costs.record(4, 0.0071, 0, 0, None)  # later: the plain step reads 7.1 ms
    assert costs.target.estimate(5, 0.0) <= costs.target.estimate(4, 0.0)  # by rows alone: a free row
    plain = costs.target_seconds(4, 4)
    assert plain > 0.0070
    assert costs.target_seconds(5, 4) - plain == pytest.approx(0.0011)
    assert costs.least_row_seconds(4, 24) == pytest.approx(0.0011)
    # One measured size extrapolates in proportion (a cost of no extra rows is none), not with the prior's slope.
    assert costs.target_seconds(8, 4) - plain == pytest.approx(4 * 0.0011)
    # Acceptance 0.4 a draft: a row (1.1 ms) costs more than the 0.4 of a token it brings (1.8 ms a token).
    middling = []
    for _ in range(4):
        stats = AcceptanceStats()
        for _ in range(6):
            stats.update(5, 0)
            stats.update(5, 0)
            stats.update(5, 1)
        middling.append(stats)
    assert all(0.3 < s.rate(0) < 0.5 for s in middling)
    assert choose_batch_k(middling, [5] * 4, 4, costs, model_draft=False) == [0] * 4
    costs.extra.clear()  # priced by the curve by rows alone, as before: they draft
    assert any(choose_batch_k(middling, [5] * 4, 4, costs, model_draft=False))


def test_draft_rows_are_measured_per_size_class_of_the_base():
    """A memory-bound forward's rows are free up to a point a large batch reaches first: what drafts added at 4
    base rows does not price them at 64, where the curve by rows prices them until drafts are measured there."""
    from quickdraft.adaptive import BatchCosts

    costs = BatchCosts()
    for rows in (4, 64, 128):
        for _ in range(3):
            costs.record(rows, 0.010 + 0.0001 * max(0, rows - 64), 0, 0, None)  # flat up to 64 rows
    costs.record(8, 0.0101, 4, 0, 0.00001, draft_rows=4)
    assert costs.target_seconds(8, 4) == pytest.approx(0.0101)
    assert costs.target_seconds(96, 64) == pytest.approx(costs.target.estimate(96, 0.0))  # unmeasured at 64
    costs.record(68, 0.0200, 4, 0, 0.00001, draft_rows=4)  # dear there
    assert costs.target_seconds(68, 64) == pytest.approx(0.0200)
    assert costs.target_seconds(8, 4) == pytest.approx(0.0101)  # the small batch's class unchanged
    # A drafting step whose base was never measured teaches nothing about what drafts add.
    costs.record(40, 0.012, 4, 0, 0.00001, draft_rows=4)
    assert 36 .bit_length() not in costs.extra or costs.extra[36 .bit_length()] is costs.extra[64 .bit_length()]

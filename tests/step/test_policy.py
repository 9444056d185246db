"""step/policy.py: each sequence's draft length (its own cap, adaptive K alone and in a batch), and what a step
teaches the policy; per-request speculation control through the API (SamplingParams.num_speculative_tokens)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams, adaptive
from quickdraft.drafts import NgramProposer
from quickdraft.sequence import Sequence
from quickdraft.step.policy import SpeculationPolicy

CPU = torch.device("cpu")


class _Cache(list):
    """A target cache of some length (the policy reads only len())."""


def _decoding(params: SamplingParams, prompt=(1, 2, 3, 4, 5, 6, 1, 2)) -> Sequence:  # "1 2" matched: 6 to draft
    seq = Sequence(list(prompt), params, None, CPU, 32)
    seq.target_cache = _Cache([0] * (len(prompt) - 1))  # the prompt read: one token to feed
    return seq


def _policy(k=4, adaptive_k=True) -> SpeculationPolicy:
    return SpeculationPolicy(NgramProposer(), k, adaptive_k, None, 256)


def test_a_requests_own_cap_bounds_its_drafts_and_zero_turns_speculation_off():
    policy = _policy(adaptive_k=False)
    seqs = [_decoding(SamplingParams(max_tokens=50)), _decoding(SamplingParams(max_tokens=50, num_speculative_tokens=2)),
            _decoding(SamplingParams(max_tokens=50, num_speculative_tokens=0)),
            _decoding(SamplingParams(max_tokens=50, num_speculative_tokens=9)),  # above K: K
            _decoding(SamplingParams(max_tokens=3))]  # max_tokens leaves room for 2 drafts
    assert [policy.cap_k(seq) for seq in seqs] == [4, 2, 0, 4, 2]
    reading = Sequence([1, 2, 3, 4], SamplingParams(), None, CPU, 32)
    reading.target_cache = _Cache()
    assert policy.cap_k(reading) == 0  # a prompt goes through with no drafts


def test_adaptive_k_stops_drafting_where_a_draft_cannot_pay():
    """Measured costs where every verification row costs as much as a plain step and drafts are never accepted:
    the batch drafts nothing; a request alone whose drafts are rejected drafts nothing either."""
    policy = _policy()
    seqs = [_decoding(SamplingParams(max_tokens=50)) for _ in range(4)]
    kinds = ["lookup"] * len(seqs)
    for _ in range(9):
        for rows in range(4, 30):
            policy.batch_costs.record(rows, 0.01 * rows, 4, 0, 0.001)
    for seq in seqs:
        for _ in range(30):
            policy.acceptance(seq, "lookup").update(4, 0)
    assert policy.choose_ks(seqs, kinds) == [0, 0, 0, 0]
    good = _policy()
    for _ in range(9):
        for rows in range(4, 30):
            good.batch_costs.record(rows, 0.01 + 0.0001 * rows, 4, 0, 0.0001)
    for seq in seqs:
        for _ in range(30):
            good.acceptance(seq, "lookup").update(4, 4)
    assert good.choose_ks(seqs, kinds) == [4, 4, 4, 4]  # cheap rows, drafts all accepted: every cap

    alone = _policy()
    for _ in range(9):
        for k in range(5):
            alone.step_costs.record(k, 1.0 + 0.5 * k)
    seq = _decoding(SamplingParams(max_tokens=50))
    for _ in range(30):
        alone.acceptance(seq, "lookup").update(4, 0)
    assert alone.choose_ks([seq], ["lookup"]) == [0]


def test_a_kinds_classes_learn_their_acceptance_apart_and_share_its_step_costs():
    """ngram's 1-token matches ("lookup:1") rarely pass and its longer ones ("lookup") mostly do: one request, one
    set of lookup step costs, and adaptive K drafts on the one and not on the other."""
    policy = _policy()
    assert policy.step_costs_of("lookup:1") is policy.step_costs_of("lookup") is policy.step_costs_of("lookup:2")
    assert policy.acceptance_prior("lookup:1") is not policy.acceptance_prior("lookup")
    for _ in range(9):
        for k in range(5):
            policy.step_costs_of("lookup:1").record(k, 1.0 + 0.2 * k)
    seq = _decoding(SamplingParams(max_tokens=50))
    for _ in range(30):
        policy.acceptance(seq, "lookup:1").update(4, 0)
        policy.acceptance(seq, "lookup").update(4, 4)
    assert policy.acceptance(seq, "lookup:1").rate(0) < 0.2 and policy.acceptance(seq, "lookup").rate(0) > 0.8
    assert policy.choose_ks([seq], ["lookup:1"]) == [0]
    assert policy.choose_ks([seq], ["lookup"]) == [4]


def test_fixed_k_takes_each_cap_and_the_step_feeds_acceptance_only_when_adaptive():
    fixed = _policy(adaptive_k=False)
    seq = _decoding(SamplingParams(max_tokens=50, num_speculative_tokens=3))
    assert fixed.choose_ks([seq, _decoding(SamplingParams(max_tokens=50))], ["lookup"] * 2) == [3, 4]


def _plain(prompt, params):
    return LLM(tiny_llama(seed=0), dtype="float32").generate([{"prompt_token_ids": prompt}], params)[0]


def test_per_request_speculation_control_through_the_api():
    """SamplingParams.num_speculative_tokens through LLM.generate: 0 drafts nothing for that request, 2 drafts at
    most two a step; the default stays adaptive; every text is plain greedy text. (Whether adaptive K drafts at
    all depends on the measured costs, so the drafting itself is checked with K fixed.)"""
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    expected = _plain(prompt, SamplingParams(temperature=0, max_tokens=24)).outputs[0].token_ids
    for adaptive_k in (True, False):
        config = {"method": "ngram", "num_speculative_tokens": 4}
        llm = LLM(tiny_llama(seed=0), dtype="float32",
                  speculative_config=config if adaptive_k else {**config, "adaptive": False})
        assert llm.engine.adaptive_k == adaptive_k  # adaptive is the default
        outs = llm.generate([{"prompt_token_ids": prompt}] * 3, [SamplingParams(temperature=0, max_tokens=24,
                                                                                num_speculative_tokens=n)
                                                                 for n in (0, 2, None)])
        off, capped, default = (out.metrics for out in outs)
        assert [out.outputs[0].token_ids for out in outs] == [expected] * 3
        assert off.proposed_tokens == 0 and off.num_drafts == 0
        assert len(capped.proposed_per_position) <= 2
        if not adaptive_k:
            assert capped.proposed_tokens > 0 and default.proposed_tokens > 0
            assert len(default.proposed_per_position) > 2


class _ReadingProposer(NgramProposer):
    """A draft model as the policy sees it: `unread` tokens of history to read before it can draft."""

    def __init__(self, unread: int):
        super().__init__()
        self.unread = unread

    def unread_history(self, seq) -> int:
        return self.unread


def _idle_request(policy: SpeculationPolicy, kind: str, plain: float, one_draft: float, draft: float) -> Sequence:
    """policy's costs measured (a plain step, a one-draft step, its drafting; a catch-up of 2.1 ms a token) and a
    request whose drafts were all rejected: it decodes plainly and is due for probes."""
    costs = policy.step_costs_of(kind)
    for _ in range(9):
        costs.record(0, plain, 0.0)
        costs.record(1, one_draft, draft)
    costs.record_catch_up(1, 50, draft + 50 * 0.0021)
    seq = _decoding(SamplingParams(max_tokens=10_000))
    for _ in range(50):
        policy.acceptance(seq, kind).update(1, 0)
    return seq


def _probes(policy: SpeculationPolicy, seq: Sequence, kind: str, steps: int) -> list[int]:
    probes = []
    for step in range(steps):
        (k,) = policy.choose_ks([seq], [kind])
        if k:
            probes.append(step)
        policy.acceptance(seq, kind).update(k, 0)
    return probes


def test_probes_are_paid_from_a_budget_that_prices_a_draft_models_catch_up():
    """A request at K = 0 probes (drafts one token) where the engine's probe credit, PROBE_BUDGET of its plain steps'
    time, covers the probe: a draft model's whole cost, the history it must read first included. The Qwen pair on a
    2-core CPU: a 26 ms plain step, 43 ms with one 12 ms draft token, 2.1 ms a token of history read. A probe that
    reads a 56-token prompt costs ~5 plain steps: none in a 64-token request (every 16 steps before, 0.87-0.93x plain
    decoding on short Spec-Bench requests), and over a long run at most the budget. A lookup's probe (a tenth of a
    step, nothing to read) still comes every PROBE_INTERVAL steps."""
    model = SpeculationPolicy(_ReadingProposer(56), 4, True, None, 100_000)
    seq = _idle_request(model, "model", 0.026, 0.043, 0.012)
    probe = adaptive.probe_seconds(model.step_costs_of("model"), 56 * 0.0021)
    assert probe == pytest.approx(0.017 + 56 * 0.0021, rel=0.01)
    assert _probes(model, seq, "model", 64) == []
    steps = 64 + 1500
    probes = _probes(model, seq, "model", 1500)
    assert probes  # the engine's prior still learns, now and then
    assert len(probes) * probe <= adaptive.PROBE_BUDGET * 0.026 * steps + probe

    lookup = SpeculationPolicy(NgramProposer(), 4, True, None, 100_000)
    seq = _idle_request(lookup, "lookup", 0.026, 0.0285, 0.0005)
    probes = _probes(lookup, seq, "lookup", 4 * adaptive.PROBE_INTERVAL + 4)
    assert probes == [adaptive.PROBE_INTERVAL + i * (adaptive.PROBE_INTERVAL + 1) for i in range(4)]


def test_the_engine_tells_the_policy_how_long_finished_requests_ran():
    """A request ended by a stop token: the policy expects the next request to generate as many tokens (what a
    draft model's reading of a prompt is earned back over); one ended at its max_tokens says only that it would
    have gone on (it counts as the asker's max_tokens)."""
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    plain = _plain(prompt, SamplingParams(temperature=0, max_tokens=16)).outputs[0].token_ids
    # the first token of the tiny model's greedy text (seed 0) not seen before it: a stop token ending it there
    end = next(i for i in range(1, len(plain)) if plain[i] not in plain[:i])
    llm = LLM(tiny_llama(seed=0), dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    lengths = llm.engine.policy.output_lengths
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[plain[end]])
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert len(out.token_ids) == end + 1 and out.finish_reason == "stop"
    assert lengths.expected_remaining(0, 100) == end + 1
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16))
    assert lengths.expected_remaining(0, 100) == (end + 1 + 100) / 2

"""A sequence's draft state has an explicit lifecycle (drafts/base.py): the scheduler calls Proposer.release
exactly once per sequence when it finishes or is aborted, and once per preemption; after release a proposer holds
nothing of the sequence (no table keyed by sequences, nothing kept alive by the proposer: a suffix draft's text is
in its cache at once, a cross-vocabulary draft's translation is gone with the state)."""

from __future__ import annotations

import gc
import weakref
from collections import Counter

import pytest

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 3, 7, 5, 9, 3, 1, 2], [1, 2, 3], [4, 4, 8, 1, 5, 9, 3], [9, 9, 2], [3, 1, 5, 9, 3, 1]]


def _count_releases(monkeypatch, proposer) -> Counter:
    """{(sequence id, preempted): calls} of proposer.release, which still does its work."""
    calls: Counter = Counter()
    release = proposer.release

    def counted(seq, preempted=False):
        calls[(id(seq), preempted)] += 1
        release(seq, preempted)

    monkeypatch.setattr(proposer, "release", counted)
    return calls


@pytest.mark.parametrize("method", ["suffix", "ngram", "draft_model", "model_lookup"])
def test_release_is_called_once_per_finish_abort_and_preemption(monkeypatch, method):
    target = tiny_llama(seed=0)
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method in ("draft_model", "model_lookup"):
        config["model"] = tiny_llama(seed=1, layers=2)
    # Five blocks of 16 positions (target and draft model): each request fits alone, four together do not.
    per_block = 16 * LLM(target, speculative_config=config).kv_cache_estimate()["bytes_per_token"]
    llm = LLM(target, speculative_config=config, kv_cache_memory=5 * per_block)
    calls = _count_releases(monkeypatch, llm.proposer)
    scheduler = llm.new_scheduler(max_num_seqs=4)
    requests = [scheduler.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40 + 5 * i))
                for i, p in enumerate(PROMPTS)]
    steps = 0
    while scheduler.has_unfinished():
        if steps == 3:  # one running, and the last one still waiting
            assert scheduler.abort_request("1") and scheduler.abort_request("4")
        scheduler.step()
        steps += 1
    assert scheduler.num_preemptions > 0
    seqs = [seq for request in requests for seq in request.sequences]
    assert {seq.finish_reason for seq in seqs} >= {"abort", "length"}
    assert all(calls[(id(seq), False)] == 1 and seq.draft_state is None for seq in seqs)
    assert sum(calls[(id(seq), True)] for seq in seqs) == scheduler.num_preemptions
    assert sum(calls.values()) == len(seqs) + scheduler.num_preemptions
    if method == "suffix":  # every request's text is in the cache now, none still running
        index = llm.proposer.index
        assert len(index.docs) == len(PROMPTS) and all(doc.finished for doc in index.docs)


def test_engine_run_releases_its_sequence(monkeypatch):
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    calls = _count_releases(monkeypatch, llm.proposer)
    seq = llm.engine.new_sequence(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))
    for _ in llm.engine.run(seq):
        pass
    assert calls == Counter({(id(seq), False): 1}) and seq.draft_state is None
    assert all(doc.finished for doc in llm.proposer.index.docs)


def _released_state_is_unreachable(llm, prompt) -> None:
    """Step a sequence, release it, and check that nothing the proposer holds keeps its draft state alive."""
    seq = llm.engine.new_sequence(prompt, SamplingParams(temperature=0, max_tokens=20))
    for _ in range(3):
        llm.engine.step(seq)
    state = weakref.ref(seq.draft_state)
    llm.proposer.release(seq)
    assert seq.draft_state is None
    gc.collect()
    assert state() is None
    assert not [value for value in vars(llm.proposer).values()
                if isinstance(value, (dict, weakref.WeakKeyDictionary)) and seq in value]


def test_a_suffix_proposer_holds_no_state_for_a_released_sequence():
    llm = LLM(tiny_llama(seed=0), speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    _released_state_is_unreachable(llm, PROMPTS[0])
    (doc,) = llm.proposer.index.docs
    assert doc.finished and len(doc.tokens) > len(PROMPTS[0])  # its whole text, cached at release


def test_a_cross_vocabulary_proposer_holds_no_state_for_a_released_sequence():
    from test_cross_vocab import _cross_vocab_llm

    llm = _cross_vocab_llm()
    assert not llm.proposer.draft_reads_target_tokens  # drafting over the intersection
    _released_state_is_unreachable(llm, [1, 2, 0, 1, 2])

"""draft_model's own settings: draft_vocab_size (the draft scores a prefix of the vocabulary), refused where it
cannot apply, proposing only those ids with q zero elsewhere, and lossless (greedy equality here; the joint law
at T > 0 in tests/test_law.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.drafts import SpeculativeConfig
from quickdraft.errors import QuickdraftError

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PART = 64, 24


def _llm(**options) -> LLM:
    config = {"model": tiny_llama(seed=5, vocab_size=VOCAB, layers=2), "num_speculative_tokens": 3,
              "adaptive": False, **options}
    return LLM(tiny_llama(seed=0, vocab_size=VOCAB, layers=2), dtype="float32", device="cpu",
               speculative_config=config)


def _recorded(llm: LLM) -> list:
    """Every proposal the engine's draft makes from now on."""
    proposer, seen = llm.engine.proposer, []
    propose_batch = proposer.propose_batch

    def recording(seqs, ks):
        proposals = propose_batch(seqs, ks)
        seen.extend(proposals)
        return proposals

    proposer.propose_batch = recording
    return seen


def test_draft_vocab_size_is_checked():
    assert SpeculativeConfig.from_dict({"model": "m", "draft_vocab_size": 1000}).options.draft_vocab_size == 1000
    for bad in (0, -5, 2.5, True, "32k"):
        with pytest.raises(QuickdraftError, match="draft_vocab_size must be a positive number"):
            SpeculativeConfig.from_dict({"model": "m", "draft_vocab_size": bad})
    with pytest.raises(QuickdraftError, match="draft_vocab_size applies to methods draft_model"):
        SpeculativeConfig.from_dict({"method": "ngram", "draft_vocab_size": 100})


def test_a_draft_scoring_a_vocabulary_prefix_proposes_only_those_ids_and_stays_exact():
    plain = LLM(tiny_llama(seed=0, vocab_size=VOCAB, layers=2), dtype="float32", device="cpu")
    llm = _llm(draft_vocab_size=PART)
    assert llm.engine.proposer.runner.vocab_size == PART
    proposals = _recorded(llm)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 40, 33]}, {"prompt_token_ids": [60]}]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
    assert max(max(ids) for ids in expected) >= PART  # the target wrote ids the draft cannot propose
    sampled = _recorded(llm)
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    drafted = [p for p in proposals + sampled if len(p.tokens)]
    assert drafted and all(int(p.tokens.max()) < PART for p in drafted)
    with_q = [p for p in sampled if len(p.tokens) and p.probs is not None]
    assert with_q and all(float(p.probs[:, PART:].abs().sum()) == 0.0 for p in with_q)
    assert all(torch.allclose(p.probs.sum(-1), torch.ones(len(p.tokens))) for p in with_q)


def test_a_draft_vocab_size_past_the_vocabulary_keeps_the_whole_head():
    assert _llm(draft_vocab_size=10 * VOCAB).engine.proposer.runner.vocab_size == VOCAB


def test_a_prefix_draft_under_a_grammar_that_allows_none_of_its_ids_ends_its_draft():
    """Pieces a, b, c, ab; the draft scores only "a" (draft_vocab_size 1) and the regex never allows "a" after its
    first token: the draft's q would be zero everywhere, so its drafts end there (no NaN draw), and sampled
    output still matches the regex."""
    import re

    from drafts.test_cross_vocab import TARGET_PIECES, piece_tokenizer

    regex = "b(c|ab)*"
    config = {"model": tiny_llama(seed=5, vocab_size=4, layers=2), "tokenizer": piece_tokenizer(TARGET_PIECES),
              "num_speculative_tokens": 3, "adaptive": False, "draft_vocab_size": 1}
    llm = LLM(tiny_llama(seed=0, vocab_size=4, layers=2), tokenizer=piece_tokenizer(TARGET_PIECES), dtype="float32",
              device="cpu", speculative_config=config)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=8, structured_outputs={"regex": regex})
    for out in llm.generate([{"prompt_token_ids": [1, 2, 0]}] * 3, params):
        for completion in out.outputs:  # cut at max_tokens: a prefix of the language (maybe half of an "ab")
            text = "".join(TARGET_PIECES[t] for t in completion.token_ids)
            assert re.fullmatch(regex + "a?", text), completion.token_ids


def test_unread_history_is_the_prompt_until_the_draft_reads_it_and_adaptive_k_learns_its_cost():
    """What the draft has not read (adaptive K prices reading it): the whole history until the first drafting step
    (the first step reads the prompt into the target only), at most K rejected drafts' worth after it; the
    catch-up's cost per token is measured on that drafting step."""
    llm = _llm(adaptive=True)
    scheduler = llm.new_scheduler()
    scheduler.add_request("a", list(range(1, 30)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    proposer, costs = llm.engine.proposer, llm.engine.policy.step_costs_of("model")
    scheduler.step()
    seq = scheduler.running[0][0].sequences[0]
    assert proposer.unread_history(seq) == len(seq.token_ids) == 30
    assert not costs.catch_up
    scheduler.step()
    assert seq.metrics.proposed_tokens > 0 and proposer.unread_history(seq) <= 3
    assert len(costs.catch_up) == 1  # the drafting step that read the prompt: timed per token read
    while scheduler.has_unfinished():
        scheduler.step()

"""model_lookup (drafts/model_lookup.py): greedy output equals plain greedy output with both sources drafting,
adaptive K keeps the two sources' step costs and acceptance apart, and the configuration's spellings. Its exact
law at T > 0 is in tests/test_law.py."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.drafts import parse_draft
from quickdraft.errors import QuickdraftError

# Repeats, so the suffix lookup finds confident matches some steps; the rest the draft model drafts.
PROMPT = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9, 3, 7, 5, 9]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_greedy_equals_plain_greedy_with_both_sources(dtype, adaptive):
    target, draft = tiny_llama(seed=0).to(dtype), tiny_llama(seed=1).to(dtype)
    sp = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(target, speculative_config={"method": "none"}).generate({"prompt_token_ids": PROMPT}, sp)[0]
    llm = LLM(target, speculative_config={"method": "model_lookup", "model": draft, "num_speculative_tokens": 4,
                                          "adaptive": adaptive})
    out = llm.generate({"prompt_token_ids": PROMPT}, sp)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    proposer = llm.engine.proposer
    assert out.metrics.proposed_tokens > 0 and proposer.lookup_drafts > 0 and proposer.model_drafts > 0


def test_lookup_steps_cost_no_draft_forward_and_are_priced_apart():
    """A lookup step runs no draft forward; adaptive K records its steps' costs and acceptance under
    "lookup", the model's under "model" (so a free lookup step never prices the draft model's forwards)."""
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1)
    llm = LLM(target, dtype="float32", device="cpu",
              speculative_config={"method": "model_lookup", "model": draft, "num_speculative_tokens": 4})
    engine, proposer = llm.engine, llm.engine.proposer
    seq = engine.new_sequence(PROMPT, SamplingParams(temperature=0, max_tokens=60), None)
    kinds_seen = set()
    while not seq.finished:
        kind = proposer.draft_kind(seq)
        kinds_seen.add(kind)
        before = proposer.forwards
        engine.step(seq)
        if kind == "lookup":
            assert proposer.forwards == before  # free
    assert {"lookup", "model"} <= kinds_seen
    lookup_costs, model_costs = engine.policy.step_costs_of("lookup"), engine.policy.step_costs_of("model")
    assert lookup_costs is not model_costs and lookup_costs.curve.points and model_costs.curve.points
    assert seq.acceptance_for("lookup") is not seq.acceptance_for("model")
    # Each kind starts from (and feeds) its own engine-wide prior: a lookup's acceptance is not a model's.
    assert seq.acceptance_for("lookup").prior is engine.policy.acceptance_prior("lookup")
    assert seq.acceptance_for("model").prior is engine.policy.acceptance_prior("model")
    assert engine.policy.acceptance_prior("model") is not engine.policy.acceptance_prior("lookup")
    assert sum(seq.acceptance_for("lookup").reached) > 0 and sum(seq.acceptance_for("model").reached) > 0


def test_spellings_and_errors():
    assert parse_draft("lookup+qwen2.5-coder-0.5b", 4) == {"method": "model_lookup", "model": "qwen2.5-coder-0.5b",
                                                            "num_speculative_tokens": 4}
    with pytest.raises(QuickdraftError, match="'model_lookup' needs a draft model"):
        LLM(tiny_llama(), speculative_config={"method": "model_lookup"})

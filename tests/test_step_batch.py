"""The step's named layout (quickdraft/step_batch.py: flat drafts, cumulative offsets, row bounds) and the
acceptance rules of verify.py on the engine's real path: each rule the engine calls is spied on or planted
with a defect here, so that a unit test of verify.py is a test of what generation runs."""

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams, verify
from quickdraft.step import verification
from quickdraft.step_batch import StepBatch

V = 32
PROMPTS = [[5, 9, 3, 7, 5, 9, 3], [1, 2, 3, 1, 2], [4, 8, 15, 16, 23, 4]]

pytestmark = pytest.mark.usefixtures("one_thread")


def _empty():
    return torch.empty(0, dtype=torch.long)


def test_offsets_and_row_bounds_of_a_batch_mixing_k0_k3_and_k0():
    q = torch.softmax(torch.randn(5, V), -1)  # the proposal drafted 5; the step keeps 3
    batch = StepBatch.build([_empty(), torch.tensor([4, 7, 2]), _empty()], [None, q, None])
    assert batch.batch_size == 3 and batch.num_rows == 6
    assert batch.num_draft_tokens == [0, 3, 0]
    assert batch.cu_num_draft_tokens == [0, 0, 3, 3]
    assert batch.cu_num_rows == [0, 1, 5, 6]
    assert [batch.rows(i) for i in range(3)] == [(0, 1), (1, 5), (5, 6)]
    assert batch.draft_token_ids.tolist() == [4, 7, 2] and batch.draft_token_ids.dtype == torch.long
    assert batch.drafts(1).tolist() == [4, 7, 2] and batch.drafts(0).numel() == batch.drafts(2).numel() == 0
    assert batch.draft_probs[0] is None and batch.draft_probs[2] is None
    assert torch.equal(batch.draft_probs[1], q[:3])


def test_offsets_of_chains_of_several_lengths():
    drafts = [torch.tensor([1, 2]), torch.tensor([3]), _empty(), torch.tensor([4, 5, 6, 7])]
    batch = StepBatch.build(drafts, [None] * 4)
    assert batch.cu_num_draft_tokens == [0, 2, 3, 3, 7]
    assert batch.cu_num_rows == [0, 3, 5, 6, 11]
    assert [batch.drafts(i).tolist() for i in range(4)] == [d.tolist() for d in drafts]


def test_build_refuses_a_layout_it_cannot_name():
    with pytest.raises(ValueError, match="2 drafts but 1 draft probabilities"):
        StepBatch.build([_empty(), _empty()], [None])
    with pytest.raises(ValueError, match="at least one sequence"):
        StepBatch.build([], [])
    with pytest.raises(ValueError, match="sequence 0 has 3 drafts but probabilities for 2"):
        StepBatch.build([torch.tensor([1, 2, 3])], [torch.full((2, V), 1.0 / V)])


def _llm(**config):
    return LLM(tiny_llama(seed=0), dtype="float32", speculative_config={
        "method": "draft_model", "model": tiny_llama(seed=7), "num_speculative_tokens": 3, "adaptive": False,
        **config})


def _plain(prompts, sp):
    return [o.outputs[0].token_ids for o in LLM(tiny_llama(seed=0), dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], sp)]


def _spy(monkeypatch, name):
    calls, original = [], getattr(verify, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(verify, name, spy)
    return calls


@pytest.mark.parametrize("on_host", [False, True], ids=["tensors", "host"])
def test_a_step_mixing_a_prompt_three_drafts_and_a_finishing_sequence(monkeypatch, on_host):
    """One engine step over a sequence reading its prompt (k = 0), one drafting 3 and one whose max_tokens leave
    it one token (k = 0, it finishes): verify.greedy_accept sees that layout (greedy_accept_on_host where the CPU
    verifies greedy chains on the host), and every sequence's text is plain greedy text."""
    monkeypatch.setattr(verification, "GREEDY_CHAINS_ON_HOST", on_host)
    llm = _llm()
    engine = llm.engine
    drafting = engine.new_sequence(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    finishing = engine.new_sequence(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2))
    engine.step_batch([drafting, finishing])  # both read their prompts
    reading = engine.new_sequence(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20))
    calls = _spy(monkeypatch, "greedy_accept_on_host" if on_host else "greedy_accept")
    committed = engine.step_batch([reading, drafting, finishing])
    if on_host:
        (target_tokens, draft_tokens, cu_num_rows, cu_num_draft_tokens), = calls
        assert cu_num_draft_tokens == [0, 0, 3, 3] and cu_num_rows == [0, 1, 5, 6]
        assert len(target_tokens) == 6 and len(draft_tokens) == 3
    else:
        (target_tokens, draft_tokens, num_draft_tokens, passes), = calls
        assert num_draft_tokens == [0, 3, 0] and passes is None
        assert target_tokens.shape == (6,) and draft_tokens.shape == (3,)
    assert finishing.finished and finishing.finish_reason == "length" and len(committed[2]) == 1
    assert len(committed[0]) == 1 and 1 <= len(committed[1]) <= 4
    while not (reading.finished and drafting.finished):
        engine.step_batch([s for s in (reading, drafting) if not s.finished])
    sp = SamplingParams(temperature=0, max_tokens=20)
    assert [drafting.output_ids, reading.output_ids] == _plain([PROMPTS[0], PROMPTS[2]], sp)
    assert finishing.output_ids == _plain([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2))[0]


def test_greedy_and_seeded_sequences_share_one_greedy_accept_and_the_others_are_rejection_sampled(monkeypatch):
    llm = _llm()
    engine = llm.engine
    seqs = [engine.new_sequence(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12)),
            engine.new_sequence(PROMPTS[1], SamplingParams(temperature=0.8, max_tokens=12), None, noise_key=5),
            engine.new_sequence(PROMPTS[2], SamplingParams(temperature=0.8, max_tokens=12),
                                torch.Generator().manual_seed(1))]
    greedy_calls = _spy(monkeypatch, "greedy_accept")
    rejection_calls = _spy(monkeypatch, "rejection_sample_rows")
    steps = 0
    while not any(seq.finished for seq in seqs):
        engine.step_batch(seqs)
        steps += 1
    assert len(greedy_calls) == steps  # one per step, over the whole batch
    assert all(len(call[2]) == 3 for call in greedy_calls)
    assert len(rejection_calls) == steps  # the unseeded sampled sequence only
    layouts = [call[1] for call in rejection_calls]
    assert all(layout.num_draft_tokens.shape == (1,) for layout in layouts)  # [B=1]
    assert any(layout.max_k == 3 for layout in layouts)  # drafts were verified, not only prompts


def test_a_defect_planted_in_greedy_accept_reaches_the_output(monkeypatch):
    """The real path's greedy matching is verify.greedy_accept: accepting every draft (a defect) changes the text
    (the draft model has other weights), and the honest rule gives plain greedy text. (The tensor path: on the CPU
    greedy chains are verified on the host unless told otherwise, the next test.)"""
    monkeypatch.setattr(verification, "GREEDY_CHAINS_ON_HOST", False)
    sp = SamplingParams(temperature=0, max_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = _plain(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in _llm().generate(prompts, sp)] == plain

    def accept_everything(target_tokens, draft_tokens, num_draft_tokens, passes=None, layout=None):
        ks = torch.tensor(num_draft_tokens)
        bonus_rows = torch.cumsum(ks + 1, 0) - 1
        return ks, target_tokens[bonus_rows]

    monkeypatch.setattr(verify, "greedy_accept", accept_everything)
    assert [o.outputs[0].token_ids for o in _llm().generate(prompts, sp)] != plain


def test_a_defect_planted_in_greedy_accept_on_host_reaches_the_output(monkeypatch):
    """The CPU's greedy chains are matched by verify.greedy_accept_on_host: accepting every draft there changes
    the text, and the honest rule gives plain greedy text."""
    sp = SamplingParams(temperature=0, max_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = _plain(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in _llm().generate(prompts, sp)] == plain

    def accept_everything(target_tokens, draft_tokens, cu_num_rows, cu_num_draft_tokens):
        return [(hi - lo, target_tokens[cu_num_rows[i + 1] - 1])
                for i, (lo, hi) in enumerate(zip(cu_num_draft_tokens, cu_num_draft_tokens[1:]))]

    monkeypatch.setattr(verify, "greedy_accept_on_host", accept_everything)
    assert [o.outputs[0].token_ids for o in _llm().generate(prompts, sp)] != plain


def test_greedy_relaxed_acceptance_runs_verify_relaxed_greedy_accepts(monkeypatch):
    """acceptance='relaxed' on greedy requests tests each draft with verify.relaxed_greedy_accepts ([1, k, V]
    rows, k >= 1 only); a test that passes nothing leaves exactly plain greedy text."""
    sp = SamplingParams(temperature=0, max_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    calls = _spy(monkeypatch, "relaxed_greedy_accepts")
    relaxed = _llm(acceptance="relaxed", threshold=0.05)
    relaxed.generate(prompts, sp)
    assert calls and all(logits.shape[0] == 1 and logits.shape[1] == drafts.shape[1] >= 1 and threshold == 0.05
                         for logits, drafts, threshold in calls)
    monkeypatch.setattr(verify, "relaxed_greedy_accepts",
                        lambda logits, drafts, threshold: torch.zeros(drafts.shape, dtype=torch.bool))
    assert [o.outputs[0].token_ids for o in relaxed.generate(prompts, sp)] == _plain(PROMPTS, sp)

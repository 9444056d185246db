"""Request state and its metrics: acceptance counts only what is emitted, named as the field names them."""

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.bench.costs import draft_statistics
from quickdraft.sequence import RequestMetrics, Sequence

PROMPT = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9]
K = 5


class CharTokenizer:
    """Each token id decodes to one letter: stop strings can be placed on exact tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _self_draft_llm(target, tokenizer=None):
    # The target drafting for itself under greedy decoding: every draft is accepted, so each step after the
    # prompt's emits K drafts and then the bonus token (while max_tokens leaves room for K + 1).
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": K,
                                          "adaptive": False})
    llm.tokenizer = tokenizer
    return llm


def _expected_accepted(length: int) -> int:
    """Accepted drafts among the first `length` tokens: token 0 comes from the prompt's forward, then each
    step is K drafts and one bonus."""
    return sum(1 for i in range(1, length) if (i - 1) % (K + 1) < K)


def _check_consistent(m: RequestMetrics, length: int) -> None:
    assert m.num_generated_tokens == length
    assert m.accepted_tokens == _expected_accepted(length)
    assert sum(m.accepted_per_position) == m.accepted_tokens
    assert all(a <= r <= p for a, r, p in zip(m.accepted_per_position, m.reached_per_position,
                                              m.proposed_per_position))
    # Every output token is one forward's own token or an emitted accepted draft.
    assert m.target_forwards - 1 <= length - m.accepted_tokens <= m.target_forwards
    assert m.mean_acceptance_length == 1 + m.accepted_tokens / m.num_drafts
    assert m.tokens_per_target_forward == length / m.target_forwards


def test_accepted_drafts_after_eos_are_not_counted():
    """Failed before: the drafts accepted after the EOS token were counted (accepted 5 of 3 emitted)."""
    target = tiny_llama(seed=0)
    free = LLM(target).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12))[0]
    free = free.outputs[0].token_ids
    # inside the first drafting step (tokens 1..5 are its drafts), a token that did not come before
    eos_index = next(i for i in range(2, K) if free[i] not in free[:i])
    target.config.eos_token_id = free[eos_index]
    out = _self_draft_llm(target).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.outputs[0].token_ids == free[: eos_index + 1] and out.outputs[0].finish_reason == "stop"
    m = out.metrics
    assert m.proposed_tokens == K and m.num_drafts == 1 and m.target_forwards == 2
    assert m.accepted_tokens == eos_index and m.accepted_per_position == [1] * eos_index
    _check_consistent(m, eos_index + 1)


@pytest.mark.parametrize("stop_index", [2, 6, 9])
def test_a_stop_string_uncounts_the_tokens_it_cut(stop_index):
    """Failed before: truncate_output left the cut tokens' acceptance counted."""
    target = tiny_llama(seed=0)
    plain = LLM(target, tokenizer=CharTokenizer()).generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    stop = CharTokenizer().decode(plain.token_ids[stop_index - 1: stop_index + 1])
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop])
    expected = LLM(target, tokenizer=CharTokenizer()).generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    out = _self_draft_llm(target, CharTokenizer()).generate({"prompt_token_ids": PROMPT}, params)[0]
    assert out.outputs[0].token_ids == expected.token_ids and out.outputs[0].text == expected.text
    _check_consistent(out.metrics, len(expected.token_ids))


def test_max_tokens_caps_k_and_counts_what_was_kept():
    target = tiny_llama(seed=0)
    out = _self_draft_llm(target).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=9))[0]
    m = out.metrics
    # prompt -> 1 token; K=5 drafts + bonus -> 6; 2 left: K capped to 1, draft + bonus -> 2.
    assert m.num_generated_tokens == 9 and m.target_forwards == 3 and m.proposed_per_position == [2, 1, 1, 1, 1]
    assert m.accepted_tokens == 6 and m.accepted_per_position == [2, 1, 1, 1, 1]


def _run_steps(steps):
    """A sequence through which the engine's bookkeeping runs for steps (k proposed, n accepted)."""
    seq = Sequence([1, 2], SamplingParams(temperature=0, max_tokens=100), None, torch.device("cpu"), 32)
    for k, n in steps:
        seq.metrics.count_proposed(k)
        seq.commit([7] * n, k, 8, set(), 1000)
    return seq.metrics


def test_reached_positions_with_varying_k():
    """Failed before (bench/costs.py): with steps {k=1, n=1} and {k=2, n=0} the bench reported a per-token
    acceptance of 1/3; position 0 was judged twice and accepted once, position 1 never judged: 1/2."""
    m = _run_steps([(1, 1), (2, 0)])
    assert m.proposed_per_position == [2, 1] and m.reached_per_position == [2] and m.accepted_per_position == [1]
    assert draft_statistics([m])["alpha"] == pytest.approx(0.5)
    assert m.acceptance_by_position[0] == pytest.approx(0.5)
    m = _run_steps([(3, 3), (3, 1), (2, 0), (0, 0)])
    assert m.reached_per_position == [3, 2, 1] and m.accepted_per_position == [2, 1, 1]
    assert draft_statistics([m])["alpha"] == pytest.approx(4 / 6)
    assert m.acceptance_by_position == [pytest.approx(2 / 3), 0.5, 1.0]
    assert m.num_drafts == 3 and m.mean_acceptance_length == pytest.approx(1 + 4 / 3)


def test_combine_pools_per_position_counts():
    a, b = _run_steps([(1, 1)]), _run_steps([(3, 2)])
    total = RequestMetrics.combine([a, b])
    assert total.proposed_per_position == [2, 1, 1] and total.accepted_per_position == [2, 1, 0]
    assert total.acceptance_by_position == [1.0, 1.0, 0.0]
    assert total.reached_per_position == [2, 1, 1] and total.num_drafts == 2 and total.accepted_tokens == 3
    d = total.to_dict()
    assert d["mean_acceptance_length"] == total.mean_acceptance_length and "tokens_per_target_forward" in d

"""`ngram` (drafts/ngram.py) on hand-made histories: the continuation of the most recent earlier occurrence of the
longest suffix within [prompt_lookup_min, prompt_lookup_max], cut at k; nothing where nothing matches."""

from __future__ import annotations

import pytest
import torch

from quickdraft import SamplingParams
from quickdraft.drafts import NgramProposer, SpeculativeConfig
from quickdraft.errors import QuickdraftError
from quickdraft.sequence import Sequence


def _proposed(proposer: NgramProposer, history: list[int], k: int) -> list[int]:
    seq = Sequence(history, SamplingParams(temperature=0, max_tokens=8), None, torch.device("cpu"), 32)
    return proposer.propose(seq, k).tokens.tolist()


def test_the_most_recent_occurrence_of_the_longest_suffix_is_continued():
    history = [7, 1, 2, 8, 1, 2, 9, 1, 2]  # 1 2 occurred at 1 (then 8) and at 4 (then 9): the later one wins
    assert _proposed(NgramProposer(), history, 2) == [9, 1]
    assert _proposed(NgramProposer(), history, 10) == [9, 1, 2]  # the continuation runs to the end, no further
    # A longer suffix beats a more recent shorter one: 3 4 5 occurred once, early; 5 alone later.
    history = [3, 4, 5, 6, 0, 5, 2, 3, 4, 5]
    assert _proposed(NgramProposer(max_n=3), history, 3) == [6, 0, 5]
    assert _proposed(NgramProposer(max_n=1), history, 3) == [2, 3, 4]  # only the last token: its latest match


def test_no_draft_below_the_smallest_n_or_without_a_match():
    history = [7, 1, 2, 8, 1, 2, 9, 1, 2]
    assert _proposed(NgramProposer(min_n=3, max_n=4), history, 4) == []  # 9 1 2 never occurred before
    assert _proposed(NgramProposer(), [1, 2, 3, 4], 4) == []
    assert _proposed(NgramProposer(), [5], 4) == []  # a single token has nothing before it


def test_options_come_from_the_config_and_bad_sizes_are_refused():
    config = SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    proposer = NgramProposer.from_config(config, None)
    assert (proposer.min_n, proposer.max_n) == (2, 3)
    assert config.to_dict() == {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with pytest.raises(QuickdraftError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(QuickdraftError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 0})


def _seq(history: list[int]) -> Sequence:
    return Sequence(history, SamplingParams(temperature=0, max_tokens=8), None, torch.device("cpu"), 32)


def test_a_one_token_match_is_a_kind_of_its_own_and_a_draft_runs_to_the_historys_end():
    """Adaptive K learns 1-token matches' acceptance apart from longer ones' (draft_kind "lookup:1"), and a step's
    cap is what the history holds after the match (0 where nothing matches: the step does not draft)."""
    proposer = NgramProposer(max_n=6)
    cases = [  # history, kind, tokens after the match
        ([7, 1, 2, 8, 1, 2, 9, 5], "lookup", 0),  # 5 never occurred before
        ([7, 1, 2, 8, 9, 4, 1], "lookup:1", 5),  # 1 at position 1: 2 8 9 4 1 follow
        ([7, 1, 2, 8, 9, 4, 1, 2], "lookup", 5),
        ([7, 1, 2, 8, 9, 4, 7, 1, 2], "lookup", 6),  # 7 1 2 at 0: 8 9 4 7 1 2 follow
        ([3, 7, 1, 2, 8, 9, 3, 7, 1, 2], "lookup", 6),
        ([6, 3, 7, 1, 2, 8, 9, 6, 3, 7, 1, 2], "lookup", 7),  # 5 tokens matched
    ]
    for history, kind, after in cases:
        seq = _seq(history)
        assert proposer.draft_kind(seq) == kind, history
        assert proposer.max_draft_tokens(seq) == after, history
        assert proposer.propose(seq, 10).tokens.tolist() == history[len(history) - after:], history


def test_the_match_is_found_once_per_history_and_found_again_as_it_grows():
    proposer = NgramProposer()
    seq = _seq([7, 1, 2, 8, 1, 2])
    index = seq.draft_state = proposer.new_state(seq)
    assert proposer.propose(seq, 2).tokens.tolist() == [8, 1] and proposer.max_draft_tokens(seq) == 3
    index.latest = {n: {} for n in index.latest}  # every n-gram forgotten: this history's answer is kept
    assert proposer.max_draft_tokens(seq) == 3 and proposer.propose(seq, 2).tokens.tolist() == [8, 1]
    seq.commit([], 0, 8, set(), 64)  # a longer history is looked up anew: the tables hold only what 8 added
    assert seq.token_ids == [7, 1, 2, 8, 1, 2, 8] and proposer.max_draft_tokens(seq) == 0
    assert proposer.draft_kind(seq) == "lookup" and proposer.propose(seq, 4).tokens.tolist() == []
    fresh = _seq(seq.token_ids)  # the whole history indexed: "1 2 8" occurred at 1
    assert proposer.max_draft_tokens(fresh) == 3 and proposer.propose(fresh, 4).tokens.tolist() == [1, 2, 8]


def test_in_a_batch_nothing_is_looked_up_before_a_draft_is_asked_for():
    """Batched steps keep one kind ("lookup") and no bound, so the lookup's host time is spent only on the
    sequences that draft; a step alone again classifies."""
    proposer = NgramProposer()
    seqs = [_seq([7, 1, 2, 8, 9, 4, 1]), _seq([7, 1, 2, 8, 9, 4, 1, 2])]
    for seq in seqs:
        seq.draft_state = proposer.new_state(seq)
    proposer.prepare(seqs)
    assert [proposer.draft_kind(seq) for seq in seqs] == ["lookup", "lookup"]
    assert all(proposer.max_draft_tokens(seq) >= 1 << 20 for seq in seqs)
    assert all(not seq.draft_state.ids for seq in seqs)  # nothing indexed yet
    assert proposer.propose(seqs[0], 3).tokens.tolist() == [2, 8, 9]
    proposer.prepare(seqs[:1])
    assert proposer.draft_kind(seqs[0]) == "lookup:1" and proposer.max_draft_tokens(seqs[0]) == 5

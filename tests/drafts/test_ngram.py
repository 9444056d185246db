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

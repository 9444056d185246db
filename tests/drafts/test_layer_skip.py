"""`layer_skip` (drafts/layer_skip.py): the draft is the target's first N layers, its final norm and its head,
sharing the target's weights; its proposals are the greedy tokens of that truncated model, read through a KV
cache of its own."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.drafts import LayerSkipProposer
from quickdraft.errors import QuickdraftError

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 9, 3, 7, 5, 9, 3, 1, 2]


def _truncated_greedy(model, num_layers: int, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a copy of `model` cut after num_layers layers, each from a full forward."""
    cut = copy.deepcopy(model)
    cut.model.layers = cut.model.layers[:num_layers]
    cut.config.num_hidden_layers = num_layers
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(cut(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_the_draft_is_the_truncated_target(num_layers):
    target = tiny_llama(seed=0, layers=4)
    llm = LLM(target, runner="hf", dtype="float32", device="cpu",
              speculative_config={"method": "layer_skip", "num_layers": num_layers, "adaptive": False})
    proposer = llm.proposer
    assert isinstance(proposer, LayerSkipProposer) and proposer.num_layers == num_layers
    # A view: the embedding and the kept layers are the target's own tensors.
    draft_model = proposer.runner.model
    assert draft_model.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert draft_model.model.layers[0] is target.model.layers[0] and len(draft_model.model.layers) == num_layers
    seq = llm.engine.new_sequence(PROMPT, SamplingParams(temperature=0, max_tokens=16))
    proposal = proposer.propose(seq, 5)
    assert proposal.tokens.tolist() == _truncated_greedy(target, num_layers, PROMPT, 5)
    assert proposal.probs is None  # greedy: verification needs no q
    # Its own cache: the history and the first 4 drafts were read into it; the target's cache is untouched.
    assert len(seq.draft_state.kv_cache) == len(PROMPT) + 4 and len(seq.target_cache) == 0
    assert seq.draft_state.kv_cache is not seq.target_cache


def test_num_layers_is_checked():
    with pytest.raises(QuickdraftError, match="needs num_layers"):
        LLM(tiny_llama(), speculative_config={"method": "layer_skip", "num_layers": 0})
    with pytest.raises(QuickdraftError, match=r"num_layers must be in \[1, 4\]"):
        LLM(tiny_llama(), speculative_config={"method": "layer_skip", "num_layers": 5})

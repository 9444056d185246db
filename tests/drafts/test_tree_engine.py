"""The built-in tree proposers through the engine (issue 25) on a tiny bf16 target on quickdraft's CPU kernels:
ngram's, suffix's and a draft model's token trees give plain decoding's output token for token, greedy and
seeded, alone and batched, with bounded and "auto" trees; steps verify real trees (more nodes than depth)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama16
from quickdraft import LLM, SamplingParams
from quickdraft.kernels import cpu_linear

pytestmark = pytest.mark.skipif(cpu_linear() is None, reason="the CPU kernels need AVX512-BF16")

# Repetitive prompts: the lookups find several earlier continuations of their last tokens.
BASE = [5, 9, 3, 7, 5, 9, 4, 1, 5, 9, 3, 2, 5, 9, 4, 8, 5, 9, 3, 7, 5, 9]
PROMPTS = [{"prompt_token_ids": BASE[:n]} for n in (22, 14, 9)]


@pytest.fixture(scope="module")
def target():
    return tiny_llama16(seed=0).to(torch.bfloat16)


def _config(method: str, tree) -> dict:
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": False, "tree": tree}
    if method == "draft_model":
        config["model"] = tiny_llama16(seed=0).to(torch.bfloat16)  # the target itself: its trees are often right
    return config


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("tree", [{"max_nodes": 8, "max_depth": 4}, "auto"])
def test_tree_proposals_decode_as_plain_greedy_and_seeded(target, method, tree):
    plain = LLM(target, speculative_config={"method": "none"})
    llm = LLM(target, speculative_config=_config(method, tree))
    runs = [[SamplingParams(temperature=0, max_tokens=24)] * len(PROMPTS),
            [SamplingParams(temperature=0.8, max_tokens=16, seed=seed) for seed in range(len(PROMPTS))]]
    tree_steps = 0
    for params in runs:
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
        for batch in (1, 3):
            llm.max_num_seqs = batch
            out = llm.generate(PROMPTS, params)
            assert [o.outputs[0].token_ids for o in out] == want, (params[0], batch)
            tree_steps += sum(o.metrics.tree_steps for o in out)
    # Bounded trees are verified as trees; suffix's longest matches here have one continuation each (chains),
    # and "auto" may cut every tree (a draft as costly as the target is not worth one).
    if tree != "auto" and method != "suffix":
        assert tree_steps > 0

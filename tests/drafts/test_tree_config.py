"""speculative_config's "tree" (issue 25): its forms and their errors, the flat dict round trip, labels, the methods
that take it (the ones whose proposer proposes trees), and the LLM handing it to its engine."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_llama
from quickdraft import LLM
from quickdraft.drafts import PROPOSERS, SpeculativeConfig, TreeSettings, draft_label, tree_methods
from quickdraft.errors import QuickdraftError


def test_tree_forms_round_trip_through_the_flat_dict():
    bounded = SpeculativeConfig(method="ngram", tree={"max_nodes": 8, "max_depth": 4})
    assert bounded.tree == TreeSettings(8, 4)
    assert bounded.to_dict() == {"method": "ngram", "tree": {"max_nodes": 8, "max_depth": 4}}
    assert SpeculativeConfig.from_dict(json.loads(json.dumps(bounded.to_dict()))) == bounded
    auto = SpeculativeConfig(method="suffix", tree="auto")
    assert auto.tree == TreeSettings(auto=True) and auto.to_dict()["tree"] == "auto"
    assert SpeculativeConfig.from_dict(auto.to_dict()) == auto
    wide_auto = SpeculativeConfig(method="suffix", tree={"max_nodes": 32, "auto": True})
    assert wide_auto.tree == TreeSettings(32, 6, auto=True)
    assert wide_auto.to_dict()["tree"] == {"max_nodes": 32, "max_depth": 6, "auto": True}
    assert SpeculativeConfig.from_dict(wide_auto.to_dict()) == wide_auto
    assert SpeculativeConfig(method="ngram", tree=TreeSettings(4, 2)).tree == TreeSettings(4, 2)
    chains = SpeculativeConfig(method="ngram")
    assert chains.tree is None and "tree" not in chains.to_dict() and chains != bounded


def test_labels_name_the_tree():
    assert draft_label({"method": "ngram"}) == "ngram"
    assert draft_label({"method": "ngram", "tree": {"max_nodes": 16, "max_depth": 6}}) == "ngram --tree 16,6"
    assert draft_label({"method": "suffix", "tree": "auto"}) == "suffix --tree auto"
    assert TreeSettings(8, 3, auto=True).spelling == "auto:8,3"


@pytest.mark.parametrize("tree, message", [
    ("x", r'must be \{"max_nodes": N, "max_depth": D\}, "auto" or null'),
    (True, r"must be \{\"max_nodes\""),
    (16, r"must be \{\"max_nodes\""),
    ({"nodes": 4}, r"unknown keys \['nodes'\]; it takes max_nodes, max_depth and auto"),
    ({"max_nodes": 0}, r"\['max_nodes'\] must be an integer >= 1, got 0"),
    ({"max_nodes": 4, "max_depth": 2.5}, r"\['max_depth'\] must be an integer >= 1"),
    ({"max_nodes": 2, "max_depth": 3}, "max_depth 3 > max_nodes 2"),
    ({"auto": "yes"}, r"\['auto'\] must be true or false"),
])
def test_bad_trees_are_refused_with_what_to_give(tree, message):
    with pytest.raises(QuickdraftError, match=message):
        SpeculativeConfig(method="ngram", tree=tree)


def test_a_tree_is_refused_for_methods_that_propose_none_naming_those_that_do():
    takers = tree_methods()
    assert {"ngram", "suffix", "draft_model", "eagle"} <= set(takers)
    assert takers == [name for name, cls in PROPOSERS.items() if cls.proposes_trees]
    for method in ("none", "model_lookup"):
        assert method not in takers
        with pytest.raises(QuickdraftError, match=f"method '{method}' proposes no token trees.*" + ", ".join(takers)):
            SpeculativeConfig(method=method, tree="auto")


def test_the_llm_hands_its_tree_to_the_engine():
    target = tiny_llama(seed=0)
    llm = LLM(target, speculative_config={"method": "ngram", "tree": {"max_nodes": 6, "max_depth": 3}})
    assert llm.speculative_config.tree == TreeSettings(6, 3) and llm.engine.tree == TreeSettings(6, 3)
    other = llm.with_speculative_config({"method": "suffix", "tree": "auto"})
    assert other.engine.tree == TreeSettings(auto=True) and llm.engine.tree == TreeSettings(6, 3)
    assert llm.with_speculative_config({"method": "ngram"}).engine.tree is None

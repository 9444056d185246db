"""--tree N,D | auto (issue 25): one shared parser (quickdraft/cli_args.py) for generate, serve, batch, check, tune
and bench (and the Ray Serve builder's `tree` option), on top of --draft or --speculative-config; bad values
refused before any model loads."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from quickdraft.cli import build_parser, speculative_spec
from quickdraft.cli_args import tree_setting, with_tree_argument
from quickdraft.errors import QuickdraftError

COMMANDS = {"generate": ["hi"], "serve": [], "batch": ["--input", "in.jsonl", "--output", "out.jsonl"],
            "check": ["--prompts", "p.txt"], "tune": ["--prompts", "p.txt"], "bench": ["--dataset", "d.jsonl"]}


def _parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *COMMANDS[command], *argv])


def test_tree_setting_spellings():
    assert tree_setting(None) is None
    assert tree_setting("16,6") == {"max_nodes": 16, "max_depth": 6}
    assert tree_setting(" 8, 3 ") == {"max_nodes": 8, "max_depth": 3}
    assert tree_setting("auto") == tree_setting("AUTO") == "auto"
    assert tree_setting("auto:32,8") == {"max_nodes": 32, "max_depth": 8, "auto": True}
    assert with_tree_argument({"method": "ngram"}, None) == {"method": "ngram"}
    assert with_tree_argument({"method": "ngram"}, "4,2") == {"method": "ngram", "tree": {"max_nodes": 4, "max_depth": 2}}


@pytest.mark.parametrize("text", ["16", "16,6,2", "a,b", "0,1", "-1,2", "auto:", "auto:8", "tree", ""])
def test_bad_tree_spellings_say_what_to_give(text):
    with pytest.raises(QuickdraftError, match=r"--tree .*expected N,D .*auto, or auto:N,D"):
        tree_setting(text)


def test_every_command_takes_the_one_tree_argument():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = set()
    for command in COMMANDS:
        tree = next(a for a in subparsers.choices[command]._actions if "--tree" in a.option_strings)
        assert tree.default is None and tree.metavar == "N,D|auto"
        helps.add(tree.help)
        assert _parse(command, "--tree", "8,3").tree == "8,3"
    assert len(helps) == 1  # one definition


def test_generate_serve_and_batch_put_the_tree_on_their_speculative_config():
    for command in ("generate", "serve", "batch"):
        assert speculative_spec(_parse(command, "--tree", "16,6"))["tree"] == {"max_nodes": 16, "max_depth": 6}
        assert "tree" not in speculative_spec(_parse(command))
    spec = speculative_spec(_parse("generate", "--draft", "suffix", "--tree", "auto", "--fixed-k"))
    assert spec == {"method": "suffix", "num_speculative_tokens": 5, "adaptive": False, "tree": "auto"}
    # On top of --speculative-config too.
    spec = speculative_spec(_parse("generate", "--speculative-config", '{"method": "ngram"}', "--tree", "4,2"))
    assert spec == {"method": "ngram", "tree": {"max_nodes": 4, "max_depth": 2}}


def test_the_config_refuses_a_tree_before_loading():
    with pytest.raises(QuickdraftError, match="method 'none' proposes no token trees"):
        speculative_spec(_parse("generate", "--draft", "none", "--tree", "auto"))
    with pytest.raises(QuickdraftError, match="max_depth 6 > max_nodes 3"):
        speculative_spec(_parse("serve", "--tree", "3,6"))


def test_check_and_tune_take_the_tree():
    from quickdraft.tools.check.cli import speculative_config_from_args
    from quickdraft.tools.tune.cli import tree_candidates

    assert speculative_config_from_args(_parse("check", "--tree", "8,3"))["tree"] == {"max_nodes": 8, "max_depth": 3}
    assert "tree" not in speculative_config_from_args(_parse("check"))
    assert tree_candidates("ngram,suffix", 4, None) == "ngram,suffix"
    treed = tree_candidates("ngram,suffix", 4, "auto")
    assert [(c["method"], c["tree"]) for c in treed] == [("ngram", "auto"), ("suffix", "auto")]
    with pytest.raises(QuickdraftError, match="--tree '4': expected N,D"):
        tree_candidates("ngram", 4, "4")


def test_bench_applies_the_tree_to_the_methods_that_propose_trees():
    from quickdraft.bench.methods import _with_tree
    from quickdraft.bench.run import BenchConfig, run_bench

    assert _with_tree({"method": "ngram"}, "auto") == {"method": "ngram", "tree": "auto"}
    assert _with_tree({"method": "model_lookup"}, "auto") == {"method": "model_lookup"}  # decoded as chains
    assert _with_tree({"method": "ngram"}, None) == {"method": "ngram"}
    assert BenchConfig(dataset="d.jsonl", tree="8,3").tree == "8,3"
    with pytest.raises(QuickdraftError, match="--tree '8': expected N,D"):
        run_bench(BenchConfig(dataset="missing.jsonl", tree="8"), progress=False)


def test_the_ray_serve_builder_takes_the_tree():
    from quickdraft.server.ray_serve import app_settings

    llm_kwargs, _, _ = app_settings({"tree": "8,3"}, environ={})
    assert llm_kwargs["speculative_config"]["tree"] == {"max_nodes": 8, "max_depth": 3}
    llm_kwargs, _, _ = app_settings({}, environ={"QUICKDRAFT_TREE": "auto"})
    assert llm_kwargs["speculative_config"]["tree"] == "auto"


def test_a_bad_tree_exits_2_with_one_line():
    result = subprocess.run([sys.executable, "-m", "quickdraft.cli", "generate", "hi", "--tree", "x"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--tree 'x': expected N,D" in result.stderr
    assert "Traceback" not in result.stderr

"""A draft method is its file plus one registry entry: a tiny method defined here, in a test module, and
registered from it (drafts.register), runs through the config, `--draft` parsing, every command's help (the
--tree help too, where it proposes trees), labels, LLM.generate, bench, tune and check without any other change
to the package, each reading what the method declares (runs_a_model, proposes_trees), not its name. Also: the flat
vLLM-style dict keeps its keys, errors and round trip, each method validating its own options. Nothing here lists
the registered methods: a method added to the registry is tested with no edit here."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft import drafts
from quickdraft.drafts import (DraftOptions, Proposal, Proposer, SpeculativeConfig, draft_help, draft_label,
                               known_keys, parse_draft)
from quickdraft.errors import QuickdraftError

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class RepeatOptions(DraftOptions):
    """repeat_times: how many times the last token is proposed again (at most K)."""

    repeat_times: int = 2

    def __post_init__(self) -> None:
        if not (isinstance(self.repeat_times, int) and self.repeat_times >= 1):
            raise QuickdraftError(f"repeat_last: repeat_times must be an integer >= 1, got {self.repeat_times!r}")


class RepeatLastProposer(Proposer):
    """Proposes the sequence's last token again, repeat_times times."""

    name = "repeat_last"
    options = RepeatOptions
    spelling = "repeat"

    def __init__(self, times: int):
        super().__init__()
        self.times = times

    @classmethod
    def from_config(cls, config, context) -> "RepeatLastProposer":
        return cls(config.options.repeat_times)

    def propose(self, seq, k: int) -> Proposal:
        return Proposal(torch.tensor([seq.token_ids[-1]] * min(k, self.times), device=seq.device))


class EchoProposer(RepeatLastProposer):
    """repeat_last declared as a draft that runs a model and proposes trees: what bench, tune and the --tree help
    read of a method is its declaration (it runs no model and is only ever asked for chains here)."""

    name = "echo"
    spelling = "echo"
    runs_a_model = True
    proposes_trees = True


def _registered(proposer):
    drafts.register(proposer)
    try:
        yield proposer
    finally:
        del drafts.PROPOSERS[proposer.name]


@pytest.fixture
def repeat_last():
    yield from _registered(RepeatLastProposer)


@pytest.fixture
def echo():
    yield from _registered(EchoProposer)


def _help(command: str, capsys) -> str:
    """`quickdraft COMMAND --help`, its whitespace (argparse's wrapping) folded."""
    from quickdraft.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def _tree_help(text: str) -> str:
    """The --tree help's list of drafts (it ends with the catch-all spelling, a draft MODEL)."""
    start = text.index("for drafts that propose trees:")
    return text[start: text.index("a draft MODEL", start)]


def test_a_method_registered_from_outside_the_package_runs_everywhere(repeat_last):
    assert parse_draft("repeat", 3) == {"method": "repeat_last", "num_speculative_tokens": 3}
    assert "repeat |" in draft_help() and draft_help().endswith("a draft MODEL (default: ngram)")
    assert "repeat_times" in known_keys()
    config = SpeculativeConfig.from_dict({"method": "repeat_last", "repeat_times": 3})
    assert config.repeat_times == 3 and config.to_dict() == {"method": "repeat_last", "repeat_times": 3}
    assert SpeculativeConfig.from_dict(config.to_dict()) == config and draft_label(config) == "repeat_last"
    with pytest.raises(QuickdraftError, match="repeat_times must be an integer >= 1"):
        SpeculativeConfig.from_dict({"method": "repeat_last", "repeat_times": 0})
    with pytest.raises(QuickdraftError, match="repeat_times applies to method repeat_last; method 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "repeat_times": 3})

    target = tiny_llama(seed=0)
    plain = LLM(target, speculative_config={"method": "none"})
    llm = LLM(target, speculative_config={**parse_draft("repeat", 4), "repeat_times": 3, "adaptive": False})
    assert isinstance(llm.proposer, RepeatLastProposer) and llm.proposer.times == 3
    prompt = {"prompt_token_ids": [5, 9, 3, 7, 7, 7]}
    sp = SamplingParams(temperature=0, max_tokens=30)
    out = llm.generate(prompt, sp)[0]
    assert out.outputs[0].token_ids == plain.generate(prompt, sp)[0].outputs[0].token_ids
    assert out.metrics.proposed_tokens > 0 and len(out.metrics.proposed_per_position) == 3  # at most repeat_times


def test_every_command_help_names_a_registered_method_and_the_tree_help_one_that_proposes_trees(repeat_last, echo,
                                                                                                capsys):
    for command in ("generate", "serve", "batch", "check", "tune", "bench"):  # --draft, --drafts, --methods
        text = _help(command, capsys)
        assert re.search(r"\brepeat( \||,) echo\b", text), command
        trees = _tree_help(text)
        assert "echo" in trees and "repeat" not in trees, (command, trees)
        for method in drafts.tree_methods():  # eagle among them: the help names every method that takes a tree
            assert drafts.PROPOSERS[method].spelling in trees or drafts.PROPOSERS[method].spelling_catches_all


def test_bench_tune_and_check_run_a_registered_method_by_its_declaration(repeat_last, echo, tmp_path):
    """bench labels a draft's cost kind and tune costs it by what the proposer declares (runs_a_model): per step
    for a lookup, per draft token for a model; check checks it; all on a tiny target, greedy."""
    from quickdraft.bench.run import BenchConfig, run_bench
    from quickdraft.cli import build_parser
    from quickdraft.tools import check, tune
    from test_bench import WORDS, text, tiny_tokenizer, write_dataset

    dataset = write_dataset(tmp_path / "bench.jsonl", [
        {"question_id": 1, "category": "qa", "turns": [text(5, 6, 7, 5, 6, 7, 5)]},
        {"question_id": 2, "category": "qa", "turns": [text(8, 9, 8, 9, 8)]}])
    report = run_bench(BenchConfig(dataset=str(dataset), methods="repeat,echo", k="3", max_new_tokens=8,
                                   cost_repeats=1),
                       model=tiny_llama(seed=0, vocab_size=len(WORDS), layers=2), tokenizer=tiny_tokenizer(),
                       progress=False)
    assert report["costs"]["methods"]["repeat"]["draft_kind"] == "lookup"
    assert report["costs"]["methods"]["echo"]["draft_kind"] == "model forward"
    assert all(report["methods"][m]["overall"]["greedy_mismatches"] == 0 for m in ("repeat", "echo"))

    assert [c.is_model for c in tune.parse_candidates("repeat,echo", 3)] == [False, True]
    target = tiny_llama(seed=0, vocab_size=32, layers=2)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5, 4]]
    tuned = tune.tune(LLM(target, dtype="float32"), prompts, "repeat,echo", 2,
                      SamplingParams(temperature=0, max_tokens=12))
    by_label = {r.label: r for r in tuned.drafts}
    assert by_label["repeat"].draft_s_per_token == 0 and by_label["echo"].draft_s_per_step == 0
    assert by_label["echo"].kl is None  # no token-id draft runner to compare distributions with

    args = build_parser().parse_args(["check", "--draft", "repeat", "--k", "3", "--prompts", "unused.txt"])
    spec = check.speculative_config_from_args(args)
    assert spec["method"] == "repeat_last"
    assert check.check(LLM(target, dtype="float32", speculative_config=spec), prompts,
                       SamplingParams(temperature=0), max_tokens=12).passed


def test_every_registered_spelling_parses_back_to_its_method(repeat_last):
    """Each method's --draft spelling, as help writes it (placeholders filled in, optional parts left out), is
    read back as that method, whatever the registry holds."""
    for cls in drafts.PROPOSERS.values():
        example = re.sub(r"\[.*?\]", "", cls.spelling).replace("a draft MODEL", "some/model")
        example = example.replace("MODEL", "some/model").replace(":N", ":12")
        assert parse_draft(example, 4)["method"] == cls.name, (cls.spelling, example)


def test_the_flat_config_keeps_its_keys_errors_and_round_trip():
    # The built-in keys stay (a method added later adds its own), and every registered method's keys are known.
    assert {"acceptance", "adaptive", "draft_vocab_size", "eagle_lookup", "method", "model", "num_layers",
            "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "quantization",
            "suffix_decoding_max_cached_tokens", "suffix_decoding_max_spec_factor", "suffix_decoding_max_tree_depth",
            "suffix_decoding_min_token_prob", "threshold", "tokenizer", "tree"} <= set(known_keys())
    assert all(set(cls.options.keys()) <= set(known_keys()) for cls in drafts.PROPOSERS.values())
    assert known_keys() == sorted(known_keys())
    with pytest.raises(QuickdraftError, match=r"unknown speculative_config keys \[.bogus.\]; known keys: \[.accept"):
        SpeculativeConfig.from_dict({"method": "suffix", "bogus": 1})
    written = {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False, "suffix_decoding_max_tree_depth": 30,
               "suffix_decoding_min_token_prob": 0.2}
    config = SpeculativeConfig.from_dict(written)
    assert config.to_dict() == written and SpeculativeConfig.from_dict(config.to_dict()) == config
    assert config.options.suffix_decoding_max_tree_depth == 30 and config.suffix_decoding_max_tree_depth == 30
    # The keyword form of the same config, and a method's default filled in as before.
    assert SpeculativeConfig(**written) == config
    assert SpeculativeConfig.from_dict({"method": "quantized"}).to_dict() == {"method": "quantized",
                                                                           "quantization": "int8"}
    assert SpeculativeConfig.from_dict({"model": "some/model"}).method == "draft_model"
    # A method validates its own options; another method's key is refused unless at its default.
    with pytest.raises(QuickdraftError, match="max tree depth"):
        SpeculativeConfig.from_dict({"method": "eagle", "suffix_decoding_max_tree_depth": 1})
    with pytest.raises(QuickdraftError, match="quantization applies to methods draft_model, layer_skip"):
        SpeculativeConfig.from_dict({"method": "suffix", "quantization": "int8"})
    assert SpeculativeConfig.from_dict({"method": "suffix", "quantization": None}).to_dict() == {"method": "suffix"}
    with pytest.raises(AttributeError):
        _ = SpeculativeConfig.from_dict({"method": "suffix"}).num_layers


@pytest.mark.parametrize("draft, config", [
    ("none", {"method": "none"}),
    ("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
    ("suffix", {"method": "suffix", "num_speculative_tokens": 4}),
    ("layers:12", {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 4}),
    ("quantized:q4", {"method": "quantized", "quantization": "q4", "num_speculative_tokens": 4}),
    ("eagle:heads/x", {"method": "eagle", "model": "heads/x", "num_speculative_tokens": 4}),
    ("lookup+some/model", {"method": "model_lookup", "model": "some/model", "num_speculative_tokens": 4}),
    ("some/model", {"method": "draft_model", "model": "some/model", "num_speculative_tokens": 4}),
])
def test_every_spelling_parses_and_labels_back(draft, config):
    assert parse_draft(draft, 4) == config
    label = draft_label(config)
    assert label == {"layers:12": "layers:12", "some/model": "some/model", "quantized:q4": "quantized",
                     "eagle:heads/x": "eagle", "lookup+some/model": "model_lookup"}.get(draft, draft)


@pytest.mark.parametrize("draft, message", [
    ("layers:x", "layers:N with N a positive integer"),
    ("quantized:fp8", "quantized:SCHEME"),
    ("eagle:", "eagle:HEAD_DIR"),
])
def test_malformed_spellings_are_refused_by_their_method(draft, message):
    with pytest.raises(QuickdraftError, match=message):
        parse_draft(draft, 4)

"""`quickdraft tune`: its acceptance profiles and predictions on hand-computed numbers (the analytic model's formulas
themselves: tests/test_speedup_model.py), and the whole tool on tiny random Llamas (seconds). No assertion depends on
a timing: only counts, acceptance, divergences, structure and errors; the ranking and the speeds asserted are
measured on a clock that advances only in model forwards (`forward_clock`), so they are the same on any machine under
any load."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.drafts import SpeculativeConfig
from quickdraft.errors import QuickdraftError
from quickdraft.sequence import RequestMetrics
from quickdraft.tools import tune
from quickdraft.tools.tune import cli as tune_cli
from quickdraft.tools.tune import measure as tune_measure
from quickdraft.tools.tune import report as tune_report
from quickdraft.tools.tune import tuning as tune_tuning

pytestmark = pytest.mark.usefixtures("one_thread")

# Repetitive token-id prompts, so that the lookups find something to propose.
PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6],
           [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11, 12],
           [13, 14, 15, 16, 13, 14, 15, 16, 17, 18, 13, 14]]
# Token ids in no pattern: a draft that does not model the target has little to guess from.
RANDOM_PROMPTS = [[int(t) for t in torch.randint(32, (10,), generator=torch.Generator().manual_seed(seed))]
                  for seed in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


# --- the analytic model as tune uses it (its formulas: tests/test_speedup_model.py) ------------------------------

def test_acceptance_rates():
    assert tune.acceptance_rates([3, 1, 0], [4, 2, 0]) == [0.75, 0.5, None]
    assert tune.acceptance_rates([], []) == []
    with pytest.raises(QuickdraftError, match="accepted of"):
        tune.acceptance_rates([3], [2])
    with pytest.raises(QuickdraftError, match="differ in length"):
        tune.acceptance_rates([1, 1], [1])


def test_proposal_length_distribution():
    # 10 steps: 6 proposed >= 1 token, 4 proposed >= 2, 1 proposed 3.
    assert tune.proposal_length_distribution([6, 4, 1], 10, 3) == pytest.approx([0.4, 0.2, 0.3, 0.1])
    assert tune.proposal_length_distribution([6, 4, 1], 10, 4) == pytest.approx([0.4, 0.2, 0.3, 0.1, 0.0])
    assert tune.proposal_length_distribution([], 5, 2) == [1.0, 0.0, 0.0]
    assert tune.proposal_length_distribution([5, 5], 5, 2) == [0.0, 0.0, 1.0]
    for counts, steps, k_max, message in [([4, 6], 10, 2, "must not increase"), ([11], 10, 1, "must not increase"),
                                          ([1], 0, 1, "no decoding steps"), ([3, 2, 1], 5, 2, "longer than k_max")]:
        with pytest.raises(QuickdraftError, match=message):
            tune.proposal_length_distribution(counts, steps, k_max)


def test_prediction_hand_computed():
    # The analytic model's formulas are tested in tests/test_speedup_model.py; here tune's use of them.
    forward = {1: 10.0, 2: 12.0, 3: 14.0}
    lengths = [0.5, 0.0, 0.5]  # half the steps propose nothing, half propose 2
    prediction = tune.predict([0.5, 0.5], lengths, 2, forward, 1.0, 2.0)
    assert prediction.tokens_per_step == pytest.approx(1.375)
    assert prediction.step_s == pytest.approx(15.0)
    assert prediction.speedup == pytest.approx(1.375 * 10 / 15)
    # A free, always-right draft at K with flat forward costs: K + 1 times plain decoding.
    flat = {n: 1.0 for n in range(1, 6)}
    assert tune.predict([1.0] * 4, [0, 0, 0, 0, 1.0], 4, flat).speedup == pytest.approx(5.0)


def test_best_prediction_prefers_the_smaller_k_on_a_tie():
    predictions = [tune.Prediction(1, 1.5, 1.0, 1.2), tune.Prediction(2, 2.0, 1.0, 1.4),
                   tune.Prediction(3, 2.1, 1.0, 1.4)]
    assert tune.best_prediction(predictions).k == 2
    # Within 1% of the best is a tie too; beyond, the better K wins.
    near = [tune.Prediction(4, 2.0, 1.0, 1.270), tune.Prediction(6, 2.2, 1.0, 1.280)]
    assert tune.best_prediction(near).k == 4
    far = [tune.Prediction(4, 2.0, 1.0, 1.20), tune.Prediction(6, 2.2, 1.0, 1.28)]
    assert tune.best_prediction(far).k == 6


def test_profile_from_metrics():
    long_prompt = RequestMetrics(num_prompt_tokens=5, target_forwards=6, proposed_per_position=[4, 3],
                                 reached_per_position=[4, 2], accepted_per_position=[2, 1])
    one_token_prompt = RequestMetrics(num_prompt_tokens=1, target_forwards=3, proposed_per_position=[2],
                                      reached_per_position=[2], accepted_per_position=[2])
    profile = tune.AcceptanceProfile.from_metrics([long_prompt, one_token_prompt])
    # The 5-token prompt's first forward reads the prompt (no drafts): 5 decoding steps; the 1-token prompt's
    # first step may draft: 3.
    assert profile.steps == 8
    assert (profile.proposed, profile.reached, profile.accepted) == ([6, 3], [6, 2], [4, 1])
    assert profile.rates == [pytest.approx(4 / 6), 0.5]
    assert profile.draft_fraction == pytest.approx(6 / 8)
    assert profile.mean_draft_length == pytest.approx(9 / 6)
    assert profile.length_distribution(3) == pytest.approx([2 / 8, 3 / 8, 3 / 8, 0.0])


def test_distribution_divergence_hand_computed():
    p, q = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.25, 0.75]])
    kl, tv = tune.distribution_divergence(p.log(), q.log())
    assert kl.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    assert tv.item() == pytest.approx(0.25)
    same_kl, same_tv = tune.distribution_divergence(q.log(), q.log())
    assert same_kl.item() == pytest.approx(0.0, abs=1e-12) and same_tv.item() == pytest.approx(0.0, abs=1e-12)
    # Temperature divides the logits: logits x 2 at T=2 are the logits at T=1.
    logits_p, logits_q = torch.randn(4, 7), torch.randn(4, 7)
    at_two = tune.distribution_divergence(2 * logits_p, 2 * logits_q, temperature=2.0)
    at_one = tune.distribution_divergence(logits_p, logits_q)
    assert torch.allclose(at_two[0], at_one[0]) and torch.allclose(at_two[1], at_one[1])
    # A token the target can produce and the draft cannot: infinite KL, finite TV.
    kl, tv = tune.distribution_divergence(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -math.inf]]))
    assert math.isinf(kl.item()) and tv.item() == pytest.approx(0.5)


# --- rotation ----------------------------------------------------------------------------------------------------

def test_rotation_order(monkeypatch):
    calls = []

    def fake_generate(engine, prompt_ids, params):
        calls.append((engine, prompt_ids[0]))
        return RequestMetrics(num_prompt_tokens=1, num_generated_tokens=3, wall_time_s=1.0, first_token_time_s=0.5), [0]

    monkeypatch.setattr(tune_measure, "generate_once", fake_generate)  # what run_rotation calls
    totals = tune.run_rotation({"a": "A", "b": "B", "c": "C"}, [[0], [1], [2], [3]], GREEDY)
    assert calls == [("A", 0), ("B", 0), ("C", 0), ("B", 1), ("C", 1), ("A", 1), ("C", 2), ("A", 2), ("B", 2),
                     ("A", 3), ("B", 3), ("C", 3)]
    # Decode tokens (after the first) over decode seconds (after the first token), pooled.
    assert (totals["a"].tokens, totals["a"].seconds, totals["a"].tokens_per_s) == (8, 2.0, 4.0)


def test_measured_speedup_is_the_median_of_the_prompts_ratios():
    def totals(label, runs):
        out = tune.RunTotals(label)
        for tokens, seconds in runs:
            out.add(RequestMetrics(num_generated_tokens=tokens + 1, first_token_time_s=1.0, wall_time_s=1.0 + seconds),
                    [])
        return out

    # Prompt 3's plain run was caught in a burst (10x slower); a prompt that ended at once has no ratio.
    plain = totals("none", [(10, 1.0), (10, 1.0), (10, 10.0), (0, 0.0)])
    draft = totals("d", [(10, 0.5), (10, 0.8), (10, 0.5), (0, 0.0)])
    measurement = tune_report._measurement(draft, plain)
    assert measurement.speedup == pytest.approx(2.0)  # median of 2.0, 1.25, 20.0
    assert measurement.pooled_speedup == pytest.approx((30 / 1.8) / (30 / 12.0))
    assert measurement.tokens == 30 and measurement.seconds == pytest.approx(1.8)
    # Pooled 6.7x against 2.0x by the median prompt: noisy, so decisions take the median.
    assert measurement.noisy and measurement.decision_speedup == pytest.approx(2.0)
    # A quiet pass: decisions take the pooled ratio (what the workload gets, and what --sweep compares).
    quiet = tune_report._measurement(totals("d", [(10, 0.5), (10, 0.8), (10, 0.8)]),
                                     totals("none", [(10, 1.0), (10, 1.0), (10, 1.0)]))
    assert not quiet.noisy and quiet.decision_speedup == pytest.approx(3.0 / 2.1)
    assert quiet.speedup == pytest.approx(1.25)


def test_forward_times_are_sampled_in_rounds():
    llm = LLM(tiny_llama(seed=0, vocab_size=32, layers=2), dtype="float32")
    draft = llm.with_speculative_config({"method": "layer_skip", "num_layers": 1}).proposer.draft_runner
    times = tune.ForwardTimes({"target": (llm.target, [1, 2, 3]), "draft": (draft, [1])}, PROMPTS[0] * 2)
    times.sample(3)
    tune.run_rotation({"none": llm.engine}, PROMPTS, GREEDY, after_prompt=times.sample)
    assert {n: len(v) for n, v in times.samples["target"].items()} == {1: 4, 2: 4, 3: 4}  # before + each prompt
    assert len(times.samples["draft"][1]) == 4
    assert sorted(times.medians("target")) == [1, 2, 3] and times.medians("draft")[1] > 0


def test_sampled_runs_decode_the_same_text_in_every_configuration():
    target = tiny_llama(seed=0, vocab_size=32, layers=4)
    llm = LLM(target, dtype="float32")
    draft = llm.with_speculative_config({"method": "draft_model", "model": tiny_llama(seed=3, vocab_size=32, layers=2),
                                         "num_speculative_tokens": 3, "adaptive": False})
    engines = {"none": llm.with_speculative_config({"method": "none"}).engine,
               "ngram": llm.with_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                                     "adaptive": False}).engine,
               "draft": draft.engine}
    totals = tune.run_rotation(engines, PROMPTS, SamplingParams(temperature=0.8, max_tokens=16))
    assert totals["none"].outputs == totals["ngram"].outputs == totals["draft"].outputs
    assert len({tuple(o) for o in totals["none"].outputs}) == len(PROMPTS)  # each prompt its own seed


# --- tune on tiny models -----------------------------------------------------------------------------------------

@pytest.fixture
def forward_clock(monkeypatch):
    """A clock that only advances inside model forwards, by a fixed cost: layers x (1 + 0.02 x rows) units (a
    memory-bound forward: each layer's weights read once, a little more per row). Everything else is free, so
    every speed tune measures is a function of the forwards run, the same on any machine under any load."""
    import time

    from quickdraft.models.decoder import DecoderRunner

    now = [0.0]
    forward_batch = DecoderRunner.forward_batch

    def timed_forward_batch(self, caches, tokens, num_logits, **kwargs):
        rows = sum(int(torch.as_tensor(t).numel()) for t in tokens)
        now[0] += self.num_layers * (1 + 0.02 * rows)
        return forward_batch(self, caches, tokens, num_logits, **kwargs)

    monkeypatch.setattr(DecoderRunner, "forward_batch", timed_forward_batch)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    return now


def test_identical_draft_accepts_everything_and_ranks_above_a_random_one(forward_clock):
    target = tiny_llama(seed=0, vocab_size=32, layers=4)
    random_draft = tiny_llama(seed=7, vocab_size=32, layers=1)
    llm = LLM(target, dtype="float32")
    report = tune.tune(llm, RANDOM_PROMPTS, [{"method": "draft_model", "model": target}, {"model": random_draft}],
                       k_max=3, params=GREEDY)
    same = next(r for r in report.drafts if r.candidate.config["model"] is target)
    other = next(r for r in report.drafts if r.candidate.config["model"] is random_draft)
    assert same.label == "LlamaForCausalLM" and other.label == "LlamaForCausalLM#2"
    assert all(rate is not None and rate > 0.95 for rate in same.profile.rates)
    assert same.kl == pytest.approx(0.0, abs=1e-4) and same.tv == pytest.approx(0.0, abs=1e-3)
    assert same.divergence_positions > 0
    assert other.profile.rates[0] < 0.3 and other.kl > 0.05 and other.tv > 0.05
    assert report.drafts.index(same) < report.drafts.index(other)
    # The clock's forward costs come back as measured: 4 layers x (1 + 0.02 rows), and 1 layer for the draft.
    assert report.forward_s == pytest.approx({n: 4 * (1 + 0.02 * n) for n in range(1, 5)})
    assert report.forward_fit_s == pytest.approx(report.forward_s)
    assert other.draft_s_per_token == pytest.approx(1.02) and same.draft_s_per_token == pytest.approx(4.08)
    for result in report.drafts:
        assert result.draft_s_per_step == 0  # model drafts pay per draft token
        assert [p.k for p in result.predictions] == [1, 2, 3] and 1 <= result.best_k <= 3
        assert result.fixed.tokens > 0 and result.adaptive.tokens > 0
        # The analytic model leaves out only what this clock makes free and the draft's one read of the prompt
        # per request: prediction and measurement agree.
        assert result.fixed.pooled_speedup == pytest.approx(result.predicted_speedup, rel=0.1)
    # An always-right draft as costly as the target: K + 1 tokens for K + 1 forwards, just under plain decoding.
    assert same.predicted_speedup == pytest.approx(8 * 1.02 / (4 * 1.04 + 4 * 1.02))  # at K = 1, its best
    assert not any("noisy" in note for note in report.notes)  # on this clock, per prompt and pooled agree
    text = report.render()
    assert "LlamaForCausalLM#2" in text and "predicted speedup by K" in text and "1.00 1.00 1.00" in text


def test_recommended_config_round_trips(tmp_path):
    target = tiny_llama(seed=0, vocab_size=32, layers=4)
    llm = LLM(target, dtype="float32")
    drafts = ["ngram", {"method": "suffix"}, SpeculativeConfig(method="layer_skip", num_layers=2)]
    report = tune.tune(llm, PROMPTS, drafts, k_max=3, params=GREEDY)
    assert [r.label for r in sorted(report.drafts, key=lambda r: r.label)] == ["layers:2", "ngram", "suffix"]
    for result in report.drafts:
        assert len(result.profile.rates) <= 3
        if result.label == "layers:2":
            assert result.kl is not None and result.draft_s_per_token > 0
        else:  # lookups: no probabilities, a propose time per step
            assert result.kl is None and result.tv is None and result.draft_s_per_token == 0
    top = report.drafts[0]
    if report.recommended_config == {"method": "none"}:
        assert top.measured_speedup < 1.0 and "note: no draft beat plain decoding" in report.render()
    else:
        assert report.recommended_config == top.config
        assert report.recommended_config["num_speculative_tokens"] == top.best_k
        assert report.recommended_config["adaptive"] == (top.mode == "adaptive")
    path = tmp_path / "tuned.json"
    path.write_text(report.recommended_json)
    for config in [json.loads(path.read_text())] + [json.loads(json.dumps(r.config)) for r in report.drafts]:
        spec = SpeculativeConfig.from_dict(config)
        assert spec.method in ("none", "ngram", "suffix", "layer_skip")
        tuned = LLM(target, speculative_config=config, dtype="float32")
        out = tuned.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0, max_tokens=8))
        assert len(out[0].outputs[0].token_ids) == 8


def test_sweep_measures_every_configuration_and_the_pick():
    llm = LLM(tiny_llama(seed=0, vocab_size=32, layers=4), dtype="float32")
    adaptive_pick = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": True}
    report = tune.sweep(llm, PROMPTS, "ngram,suffix", k_max=2, params=GREEDY, pick=adaptive_pick)
    assert {row.label for row in report.rows} == {"none", "ngram K=1", "ngram K=2", "suffix K=1", "suffix K=2",
                                                  "pick: ngram adaptive K<=2"}
    assert all(row.tokens > 0 and row.tokens_per_s for row in report.rows)
    assert report.best_tokens_per_s == max(row.tokens_per_s for row in report.rows)
    assert 0 < report.pick_fraction <= 1 and 0 < report.pick_median_fraction <= 1
    assert next(row for row in report.rows if row.label == "none").median_speedup == pytest.approx(1.0)
    assert "tuned pick: pick: ngram adaptive K<=2" in report.render()
    # A fixed pick that is one of the grid's configurations is that configuration, not measured twice.
    fixed = tune.sweep(llm, PROMPTS, ["suffix"], k_max=2, params=GREEDY,
                       pick={"method": "suffix", "num_speculative_tokens": 1, "adaptive": False})
    assert fixed.pick_label == "suffix K=1" and len(fixed.rows) == 3
    plain = tune.sweep(llm, PROMPTS, ["suffix"], k_max=1, params=GREEDY, pick={"method": "none"})
    assert plain.pick_label == "none" and len(plain.rows) == 2


def test_prompts_that_end_at_once_are_reported():
    target = tiny_llama(seed=0, vocab_size=32, layers=2)
    plain = LLM(target, dtype="float32")
    first = [plain.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1))[0]
             .outputs[0].token_ids[0] for p in PROMPTS]
    ending = next(i for i in range(len(PROMPTS)) if first.count(first[i]) == 1)
    target.config.eos_token_id = first[ending]  # that prompt's first token ends it
    report = tune.tune(LLM(target, dtype="float32"), PROMPTS, "ngram", 2, GREEDY)
    assert f"note: 1 of {len(PROMPTS)} prompts ended at their first token" in report.render()
    assert report.drafts[0].fixed.tokens > 0


def test_noisy_measurements_are_flagged(monkeypatch):
    measurement = tune_report._measurement

    def with_a_burst(totals, plain):  # a plain run caught in someone else's work: the pooled ratio triples
        out = measurement(totals, plain)
        if totals.label != "none":
            out.pooled_speedup = 3 * out.speedup
        return out

    monkeypatch.setattr(tune_tuning, "_measurement", with_a_burst)  # what tune() calls
    report = tune.tune(LLM(tiny_llama(seed=0, vocab_size=32, layers=2), dtype="float32"), PROMPTS, "ngram", 2, GREEDY)
    assert "note: the measured speedups are noisy (ngram: " in report.render()


# --- prompts, drafts and errors ----------------------------------------------------------------------------------

def test_parse_candidates():
    candidates = tune.parse_candidates("ngram, suffix,layers:3,quantized", 4)
    assert [c.label for c in candidates] == ["ngram", "suffix", "layers:3", "quantized"]
    assert all(c.config["num_speculative_tokens"] == 4 and c.config["adaptive"] is False for c in candidates)
    assert [c.is_model for c in candidates] == [False, False, True, True]
    # Costed as their proposers declare (runs_a_model), whatever their names: eagle and model_lookup run models.
    model_drafts = tune.parse_candidates(["eagle", {"method": "model_lookup", "model": tiny_llama(seed=1, layers=1)}], 4)
    assert [c.is_model for c in model_drafts] == [True, True]
    assert candidates[2].config["num_layers"] == 3
    assert [c.label for c in tune.parse_candidates(["ngram", "ngram", {"method": "ngram"}], 2)] == \
        ["ngram", "ngram#2", "ngram#3"]
    model = tiny_llama(seed=1, layers=1)
    (inferred,) = tune.parse_candidates([{"model": model}], 2)
    assert inferred.method == "draft_model" and inferred.label == "LlamaForCausalLM"


@pytest.mark.parametrize("drafts, k_max, message", [
    ("no-such-draft-model", 4, "unknown draft 'no-such-draft-model'"),
    ("ngram,none", 4, "baseline"),
    ("ngram,,suffix", 4, "empty entry"),
    ("layers:x", 4, "layers:N"),
    ([{"method": "ngram", "prompt_lookup": 2}], 4, "unknown speculative_config keys"),
    ([{"method": "telepathy"}], 4, "unknown speculative method"),
    ([], 4, "no drafts given"),
    ([3], 4, "a draft is a --draft string"),
    ("ngram", 0, "k_max must be an integer >= 1"),
])
def test_bad_drafts(drafts, k_max, message):
    with pytest.raises(QuickdraftError, match=message):
        tune.parse_candidates(drafts, k_max)


def test_bad_tune_input():
    llm = LLM(tiny_llama(seed=0, vocab_size=32, layers=1, max_len=16), dtype="float32")
    with pytest.raises(QuickdraftError, match="prompt 2 has 20 tokens but the context holds 16"):
        tune.tune(llm, [[1, 2], list(range(20))], "ngram", 2, GREEDY)
    with pytest.raises(QuickdraftError, match="has no tokenizer"):
        tune.tune(llm, ["a text prompt"], "ngram", 2, GREEDY)
    with pytest.raises(QuickdraftError, match="max_tokens must be >= 2"):
        tune.tune(llm, [[1, 2]], "ngram", 2, SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(QuickdraftError, match="no prompts given"):
        tune.tune(llm, [], "ngram", 2, GREEDY)


# --- the command line --------------------------------------------------------------------------------------------

def _save_tiny_model(directory) -> None:
    """A tiny Llama with a word-level tokenizer and a chat template, saved as a transformers model directory."""
    from test_bench import WORDS, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tiny_llama(seed=0, vocab_size=len(WORDS), layers=2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _tune_args(argv: list[str]) -> argparse.Namespace:
    """`quickdraft tune ...` parsed by this tool's own subparser (the CLI's parser adds the same one)."""
    parser = argparse.ArgumentParser(prog="quickdraft")
    tune.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["tune", *argv])


def _tiny_tune_run(tmp_path, prompts_text: str, *argv: str):
    """A tiny model saved, prompts written, and `quickdraft tune` run on them with ngram,suffix at K <= 2 (and
    argv): (the model's directory, the --out path)."""
    model_dir = tmp_path / "tiny"
    _save_tiny_model(model_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(prompts_text)
    out = tmp_path / "tuned.json"
    args = _tune_args(["--model", str(model_dir), "--prompts", str(prompts), "--drafts", "ngram,suffix", "--k-max",
                       "2", "--max-tokens", "12", "--out", str(out), "--dtype", "float32", "--threads", "1", *argv])
    assert args.func(args) == 0
    return model_dir, out


def test_cli_writes_the_config_and_prints_the_table(tmp_path, capsys):
    model_dir, out = _tiny_tune_run(tmp_path, "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6\nw9 w10 w11 w9 w10 w11 w9\n", "--chat",
                                    "--sweep")
    printed = capsys.readouterr()
    config = json.loads(out.read_text())
    spec = SpeculativeConfig.from_dict(config)
    assert spec.method in ("ngram", "suffix", "none")
    if spec.method != "none":
        assert set(config) == {"method", "num_speculative_tokens", "adaptive"}
        assert 1 <= config["num_speculative_tokens"] <= 2
    for needle in ("rank", "acceptance by position", "ngram", "suffix", "predicted speedup by K", "sweep:",
                   "tuned pick:", "recommended speculative_config",
                   f"wrote the recommended speculative_config to {out}"):
        assert needle in printed.out, needle
    assert "[tune] loading" in printed.err
    LLM(str(model_dir), speculative_config=config, dtype="float32")  # the file configures an LLM as it is


def test_cli_tunes_drafts_with_the_tree(tmp_path, capsys):
    """--tree goes on every draft tune measures, and on the config it recommends."""
    model_dir, out = _tiny_tune_run(tmp_path, "w5 w6 w7 w8 w5 w6 w9 w8 w5 w6\nw9 w10 w11 w9 w10 w12 w9\n",
                                    "--tree", "4,2")
    printed = capsys.readouterr().out
    assert "ngram --tree 4,2" in printed and "suffix --tree 4,2" in printed
    config = json.loads(out.read_text())
    if config["method"] != "none":
        assert config["tree"] == {"max_nodes": 4, "max_depth": 2}
    LLM(str(model_dir), speculative_config=config, dtype="float32")


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "{tmp}/missing.txt"], "does not exist"),
    (["--prompts", "{tmp}/prompts.txt", "--tree", "x"], "--tree 'x': expected N,D"),
    (["--prompts", "{tmp}/prompts.txt", "--tree", "3,6"], "max_depth 6 > max_nodes 3"),
    (["--prompts", "{tmp}/prompts.txt", "--drafts", "ngram,no-such-model"], "unknown draft"),
    (["--prompts", "{tmp}/prompts.txt", "--k-max", "0"], "k_max must be"),
    (["--prompts", "{tmp}/prompts.txt", "--max-tokens", "1"], "--max-tokens must be >= 2"),
    (["--prompts", "{tmp}/prompts.txt", "--temperature", "-1"], "--temperature"),
    (["--prompts", "{tmp}/prompts.txt", "--out", "{tmp}"], "is a directory"),
    (["--prompts", "{tmp}/prompts.txt", "--out", "{tmp}/nowhere/x.json"], "does not exist"),
    (["--prompts", "{tmp}/prompts.txt", "--threads", "0"], "--threads must be >= 1"),
])
def test_cli_checks_input_before_loading(tmp_path, argv, message, monkeypatch):
    (tmp_path / "prompts.txt").write_text("a prompt\n")

    def no_loading(args):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(tune_cli, "load_llm", no_loading)  # what run_tune calls
    args = _tune_args(["--model", "smollm2-135m", *[a.format(tmp=tmp_path) for a in argv]])
    with pytest.raises(QuickdraftError, match=message):
        args.func(args)


def test_recommended_json_holds_a_tree_and_refuses_a_model_object():
    """A tree's settings are a dict JSON holds (a tuned tree draft's config used to be refused: the tree test
    failed whenever a draft beat plain decoding); a draft given as a model object is refused by name."""
    def report(config):
        return tune_report.TuneReport("m", 1, 1, 2, 0.0, 0, {}, {}, None, [], config)

    config = {"method": "ngram", "num_speculative_tokens": 2, "tree": {"max_nodes": 4, "max_depth": 2}}
    assert json.loads(report(config).recommended_json) == config
    with pytest.raises(QuickdraftError, match="'model' is a Linear object"):
        _ = report({"method": "draft_model", "model": torch.nn.Linear(2, 2)}).recommended_json

"""`quickdraft bench` on a tiny random Llama with a word-level tokenizer and chat template (seconds), and its
errors for bad input. No timing assertions: only structure, counts and exactness."""

from __future__ import annotations

import json
import math

import pytest

from conftest import tiny_llama
from quickdraft.bench.run import BenchConfig, run_bench
from quickdraft.errors import QuickdraftError

WORDS = ["<unk>", "<s>", "</s>", "<user>", "<assistant>"] + [f"w{i}" for i in range(59)]  # 64 tokens
CATEGORIES = ("writing", "qa")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tokenizer


def write_dataset(path, lines):
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


def text(*ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def tiny_dataset(tmp_path):
    return write_dataset(tmp_path / "bench.jsonl", [
        {"question_id": 1, "category": "writing", "turns": [text(1, 2, 3, 4, 1, 2, 3), text(5, 6, 7)]},
        {"question_id": 2, "category": "writing", "turns": [text(8, 9, 10, 8, 9, 10, 8)]},
        {"question_id": 3, "category": "qa", "turns": [text(11, 12, 13, 11, 12)]},
        {"question_id": 4, "category": "qa", "turns": [text(14, 15, 16, 17)]},
        {"question_id": 5, "category": "math", "turns": [text(1)]},
    ])


def test_bench_smoke(tiny_dataset, tmp_path):
    model = tiny_llama(vocab_size=len(WORDS), layers=2)
    cfg = BenchConfig(dataset=str(tiny_dataset), methods="ngram,layers:1,hf,hf-lookup", k="1,3",
                      max_new_tokens=10, categories="writing,qa", out=str(tmp_path / "out" / "results.json"),
                      plots=str(tmp_path / "plots"), cost_repeats=2)
    report = run_bench(cfg, model=model, tokenizer=tiny_tokenizer(), progress=False)

    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(saved) == {"config", "methods", "costs", "k_sweep"}
    assert saved["methods"].keys() == report["methods"].keys()
    config = saved["config"]
    assert config["methods"] == ["none", "ngram", "layers:1", "hf", "hf-lookup"]  # none added as the reference
    assert config["k"] == [1, 3] and config["n_prompts"] == 4 and config["n_turns"] == 5
    assert config["categories"] == list(CATEGORIES) and "chat template" in config["prompt_format"]
    assert config["cpu"] and config["quant_kernel"] is None  # which machine; a bf16 model keeps no GGUF blocks

    methods = saved["methods"]
    assert set(methods) == {"none", "ngram", "layers:1", "hf", "hf-lookup"}
    for name, m in methods.items():
        for stats in [m["overall"], *m["categories"].values()]:
            for key in ("tokens_per_s", "tokens_per_s_median", "speedup_vs_none", "speedup_vs_hf",
                        "speedup_vs_llamacpp", "acceptance_rate", "mean_acceptance_length",
                        "tokens_per_target_forward", "acceptance_by_position",
                        "n_prompts", "greedy_mismatches"):
                assert key in stats, (name, key)
            assert stats["tokens_per_s"] > 0 and stats["speedup_vs_hf"] > 0
            assert stats["speedup_vs_llamacpp"] is None  # llama.cpp did not run
        # The categories, and the later turns of the multi-turn records as their own group (one record here).
        assert set(m["categories"]) == {*CATEGORIES, "second turns"}
        assert m["categories"]["second turns"]["n_prompts"] == 1 and m["categories"]["second turns"]["n_turns"] == 1
        assert m["categories"]["second turns"]["generated_tokens"] == 10
        assert m["overall"]["n_prompts"] == 4 and m["categories"]["writing"]["n_prompts"] == 2
        assert m["overall"]["n_turns"] == 5 and len(m["prompts"]) == 4
        # No EOS in the tiny model: every turn generates max_new_tokens, both turns of the multi-turn record count.
        assert m["overall"]["generated_tokens"] == 5 * 10
    assert methods["none"]["overall"]["speedup_vs_none"] == 1.0
    assert methods["hf"]["overall"]["speedup_vs_hf"] == 1.0
    for name in ("none", "hf", "hf-lookup"):
        assert methods[name]["overall"]["acceptance_rate"] is None
        assert methods[name]["overall"]["mean_acceptance_length"] is None
        assert methods[name]["overall"]["tokens_per_target_forward"] is None
    for name in ("ngram", "layers:1"):
        overall = methods[name]["overall"]
        assert methods[name]["k"] in (1, 3)
        assert 0 <= overall["acceptance_rate"] <= 1
        assert all(0 <= r <= 1 for r in overall["acceptance_by_position"] if r is not None)
        assert 1 <= overall["tokens_per_target_forward"] <= methods[name]["k"] + 1
        assert 1 <= overall["mean_acceptance_length"] <= methods[name]["k"] + 1
        assert overall["time_per_step"]["target_ms"] > 0
    assert methods["layers:1"]["overall"]["acceptance_by_position"]

    # Greedy exactness in float32: any divergence must be reported as a near-tie (float noise), never hidden.
    for name, m in methods.items():
        assert m["overall"]["greedy_mismatches"] == len({(d["k"], d["question_id"]) for d in m["divergences"]})
        for d in m["divergences"]:
            assert d["near_tie"], (name, d)
    assert methods["ngram"]["overall"]["greedy_mismatches"] == 0 or methods["ngram"]["divergences"]

    costs = saved["costs"]
    assert set(costs["target_forward_ms"]) == {"1", "2", "3", "4"} and costs["context_tokens"] > 0
    assert {"ngram k=1", "ngram k=3", "layers:1 k=1", "layers:1 k=3"} <= set(costs["methods"])
    for entry in costs["methods"].values():
        assert entry["predicted_speedup"] is None or entry["predicted_speedup"] > 0
        assert entry["alpha"] is None or 0 <= entry["alpha"] <= 1

    sweep = saved["k_sweep"]
    assert set(sweep) == {"ngram", "layers:1", "hf-lookup"}
    for s in sweep.values():
        assert s["k"] == [1, 3] and s["best_k"] in (1, 3) and len(s["measured_speedup"]) == 2
        assert all(v is not None and v > 0 for v in s["measured_speedup"])
    assert all(p is not None and math.isfinite(p) for p in sweep["layers:1"]["predicted_speedup"])
    assert sweep["hf-lookup"]["predicted_speedup"] == [None, None]

    plots = {p.rsplit("/", 1)[-1] for p in config["plots"]}
    assert {"tokens_per_s.png", "speedup_vs_none.png", "acceptance_by_position.png", "k_sweep.png",
            "time_per_step.png"} <= plots
    for name in plots:
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_raw_prompts_without_chat_template(tiny_dataset):
    from quickdraft import LLM
    from quickdraft.bench.dataset import PromptFormat

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    prompts = PromptFormat(LLM(tiny_llama(vocab_size=len(WORDS), layers=2), tokenizer=tokenizer))
    assert not prompts.chat and "no chat template" in prompts.description
    assert prompts.prompt_ids(["w1 w2"], []) == tokenizer("w1 w2")["input_ids"]
    assert prompts.prompt_ids(["w1 w2", "w5"], ["w3 w4"]) == tokenizer("w1 w2\n\nw3 w4\n\nw5")["input_ids"]


@pytest.mark.parametrize("lines, message", [
    (['{"question_id": 1, "category": "qa", "turns": ["w1"]}\n', '{"question_id": 2, "category": \n'],
     "line 2: not valid JSON"),
    ([{"question_id": 1, "turns": ["w1"]}], "lacks 'category'"),
    ([{"question_id": 1, "category": "qa", "turns": []}], "'turns' must be a non-empty list"),
    ([{"question_id": 1, "category": "qa", "turns": "w1"}], "'turns' must be a non-empty list"),
    (["[1, 2]\n"], "expected a JSON object"),
    (["\n"], "holds no records"),
])
def test_bad_dataset(tmp_path, lines, message):
    path = write_dataset(tmp_path / "bad.jsonl", lines)
    with pytest.raises(QuickdraftError, match=message):
        run_bench(BenchConfig(dataset=str(path)), progress=False)


@pytest.mark.parametrize("options, message", [
    ({"dataset": "/nonexistent/spec_bench.jsonl"}, "does not exist"),
    ({"categories": "qa,poetry"}, r"unknown category poetry; the dataset has: writing, qa, math"),
    ({"limit_per_category": 0}, "limit-per-category must be >= 1"),
    ({"methods": "ngram,bogus"}, r"unknown method 'bogus'"),
    ({"methods": "ngram,layers:x"}, r"layers:N with N a positive integer"),
    ({"methods": "ngram,ngram"}, "more than once"),
    ({"methods": "ngram,"}, "comma list of methods"),
    ({"methods": "hf-assist:"}, "needs an assistant model"),
    ({"k": "1,x"}, "comma list of positive integers"),
    ({"k": "0"}, "comma list of positive integers"),
    ({"max_new_tokens": 0}, "max-new-tokens must be"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
])
def test_bad_options(tiny_dataset, options, message):
    # Bad input fails before any model is loaded (no model is given here).
    with pytest.raises(QuickdraftError, match=message):
        run_bench(BenchConfig(**{"dataset": str(tiny_dataset), **options}), progress=False)


def test_llamacpp_missing_says_how_to_install(tiny_dataset, monkeypatch):
    from quickdraft.bench import methods

    monkeypatch.setattr(methods, "llama_cpp_available", lambda: False)
    with pytest.raises(QuickdraftError, match=r"llama-cpp-python.*quickdraft\[bench\]"):
        methods.parse_methods("none,llamacpp-lookup")


def test_cli_reports_bad_input(tmp_path, capsys):
    from quickdraft.cli import main

    assert main(["bench", "--dataset", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_greedy_divergence_is_explained():
    from quickdraft.bench import greedy

    model = tiny_llama(vocab_size=len(WORDS), layers=2)
    prompt = [5, 6, 7, 5, 6]
    reference = [(prompt, [7, 8, 9]), ([1, 2], [3])]
    assert greedy.check(model, reference, reference) is None
    found = greedy.check(model, [(prompt, [7, 10, 9]), ([1, 2], [3])], reference, note="n")
    assert found["turn"] == 0 and found["index"] == 1 and found["note"] == "n"
    assert found["method_token"] == 10 and found["reference_token"] == 8
    assert found["top2_gap"] >= 0 and len(found["top2_tokens"]) == 2
    assert isinstance(found["near_tie"], bool)
    # A later turn is compared only when the earlier ones agreed; a shorter output diverges where it ends.
    found = greedy.check(model, [(prompt, [7, 8, 9]), ([1, 2], [])], reference)
    assert (found["turn"], found["index"], found["method_token"]) == (1, 0, None)


def test_analytic_model():
    from quickdraft.bench import costs

    # Leviathan et al.: E = (1 - alpha^(K+1)) / (1 - alpha); alpha = 1 gives K + 1; no draft at all gives 1.
    assert costs.expected_tokens_per_step(0.5, 3) == pytest.approx((1 - 0.5 ** 4) / 0.5)
    assert costs.expected_tokens_per_step(1.0, 4) == 5
    assert costs.expected_tokens_per_step(0.9, 4, f=0.0) == 1
    forward = {1: 0.010, 2: 0.011, 3: 0.012, 4: 0.013, 5: 0.014}
    stats = {"alpha": 0.5, "draft_fraction": 1.0, "mean_draft_length": 4.0, "draft_s_per_step": 4 * 0.001}
    predicted = costs.predict(stats, forward)
    expected = (1 - 0.5 ** 5) / 0.5 * 0.010 / (0.014 + 4 * 0.001)
    assert predicted["predicted_speedup"] == pytest.approx(expected)
    assert costs.predict({**stats, "alpha": None}, forward)["predicted_speedup"] is None


def test_hf_assisted_runner_is_exact():
    from quickdraft import LLM, SamplingParams
    from quickdraft.bench.methods import MethodSpec, Target, TransformersRunner
    from quickdraft.models.hf import HFRunner

    model = tiny_llama(vocab_size=len(WORDS), layers=2)
    target = Target(HFRunner(model), None, "tiny", None, set())
    plain = TransformersRunner(MethodSpec("hf", "hf"), None, "hf", target)
    assisted = TransformersRunner(MethodSpec("hf-assist:x", "hf-assist", "x"), 3, "hf-assist:x k=3", target,
                                  assistant=tiny_llama(seed=1, vocab_size=len(WORDS), layers=1))
    reference = LLM(model, speculative_config={"method": "none"})
    expected = reference.generate({"prompt_token_ids": [5, 6, 7, 5, 6]},
                                  SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    for runner in (plain, assisted):
        out = runner.generate([5, 6, 7, 5, 6], 12, 0.0, seed=0)
        assert out.token_ids == expected and out.seconds > 0 and out.metrics is None


def test_bench_sampling(tiny_dataset):
    """temperature > 0: no greedy check (null), every method still runs and counts its tokens."""
    model = tiny_llama(vocab_size=len(WORDS), layers=2)
    cfg = BenchConfig(dataset=str(tiny_dataset), methods="ngram,hf", k="2", max_new_tokens=4, temperature=0.8,
                      limit_per_category=1, cost_repeats=1)
    report = run_bench(cfg, model=model, tokenizer=tiny_tokenizer(), progress=False)
    assert report["config"]["n_prompts"] == 3 and report["config"]["k_sweep"] is False
    for m in report["methods"].values():
        assert m["overall"]["greedy_mismatches"] is None and m["divergences"] == []
        assert m["overall"]["generated_tokens"] == 4 * 4  # 3 records, one of them with two turns
    assert set(report["k_sweep"]) == {"ngram"} and report["k_sweep"]["ngram"]["k"] == [2]


def test_shuffle_runs_the_records_in_a_seeded_order_across_categories(tiny_dataset):
    """--shuffle SEED: the same records (limits taken in file order first), in a random order of that seed, so
    categories interleave (a mixed workload); the report says the seed and lists the prompts as they ran."""
    from quickdraft.bench import dataset
    records = dataset.load_records(tiny_dataset)
    in_file_order = [r.question_id for r in dataset.select(records, limit_per_category=2)]
    orders = {seed: [r.question_id for r in dataset.select(records, limit_per_category=2, shuffle=seed)]
              for seed in range(6)}
    assert all(sorted(order) == sorted(in_file_order) for order in orders.values())
    assert orders[3] == [r.question_id for r in dataset.select(records, limit_per_category=2, shuffle=3)]
    assert any(order != in_file_order for order in orders.values())
    model = tiny_llama(vocab_size=len(WORDS), layers=2)
    cfg = BenchConfig(dataset=str(tiny_dataset), methods="ngram", k="2", max_new_tokens=3, cost_repeats=1,
                      shuffle=3)
    report = run_bench(cfg, model=model, tokenizer=tiny_tokenizer(), progress=False)
    assert report["config"]["shuffle"] == 3
    ran = [prompt["question_id"] for prompt in report["methods"]["ngram"]["prompts"]]
    assert ran == [r.question_id for r in dataset.select(records, shuffle=3)]


def test_batch_sweep(tiny_dataset, tmp_path):
    """--batch-sizes: every method at every batch size over the same prompts; greedy outputs equal batch 1's
    and none's; hf as padded batches; JSON and the speedup plot."""
    model = tiny_llama(vocab_size=len(WORDS), layers=2)
    cfg = BenchConfig(dataset=str(tiny_dataset), methods="ngram,layers:1,hf", k="3", max_new_tokens=8,
                      out=str(tmp_path / "sweep.json"), plots=str(tmp_path / "plots"), cost_repeats=1,
                      batch_sizes="1,2,8")
    report = run_bench(cfg, model=model, tokenizer=tiny_tokenizer(), progress=False)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    sweep = saved["batch_sweep"]
    assert sweep["batch_sizes"] == [1, 2, 8] and sweep["n_prompts"] == 5
    assert set(sweep["methods"]) == {"none", "ngram", "layers:1", "hf"}
    for label, rows in sweep["methods"].items():
        assert set(rows) == {"1", "2", "8"}
        for row in rows.values():
            assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["speedup_vs_none"] > 0
            if label != "hf":
                assert row["differs_from_smallest_batch"] == 0 and row["differs_from_none"] == 0
                assert row["ttft_s"] is not None and row["per_request_tokens_per_s"] > 0
    assert sweep["methods"]["none"]["8"]["speedup_vs_none"] == 1.0
    assert sweep["methods"]["ngram"]["1"]["acceptance_rate"] is not None
    assert (tmp_path / "plots" / "batch_speedup_vs_none.png").is_file()
    assert report["batch_sweep"]["methods"].keys() == sweep["methods"].keys()


def test_batch_sweep_bad_input(tiny_dataset):
    model = tiny_llama(vocab_size=len(WORDS), layers=2)
    for kwargs, word in ((dict(batch_sizes="1,x"), "batch-sizes"), (dict(batch_sizes="1", k="1,2"), "one --k"),
                         (dict(batch_sizes="2", methods="hf-lookup"), "drop hf-lookup")):
        with pytest.raises(QuickdraftError, match=word):
            run_bench(BenchConfig(dataset=str(tiny_dataset), cost_repeats=1, **kwargs), model=model,
                      tokenizer=tiny_tokenizer(), progress=False)


def test_bench_with_token_trees(tiny_dataset):
    """--tree goes to the methods that propose trees, the report's config says so, and their greedy output still
    equals the reference's."""
    model = tiny_llama(vocab_size=len(WORDS), layers=2)
    cfg = BenchConfig(dataset=str(tiny_dataset), methods="ngram,layers:1", k="3", max_new_tokens=10,
                      categories="writing", cost_repeats=2, tree="6,3")
    report = run_bench(cfg, model=model, tokenizer=tiny_tokenizer(), progress=False)
    assert report["config"]["tree"] == "6,3"
    for name in ("ngram", "layers:1"):
        assert report["methods"][name]["overall"]["greedy_mismatches"] == 0, name


def test_the_default_prompt_set_ships_with_the_package_and_is_the_default(monkeypatch):
    """`quickdraft bench` without --dataset runs the prompt set in quickdraft/bench/data/ (a clone has no other):
    it loads, covers Spec-Bench's categories, states its license beside it and is in the package data."""
    import fnmatch
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path

    from quickdraft.bench import cli as bench_cli
    from quickdraft.bench import run as bench_run
    from quickdraft.bench.dataset import DEFAULT_DATASET, categories_of, load_records
    from quickdraft.cli import main

    records = load_records(DEFAULT_DATASET)
    categories = categories_of(records)
    assert len(categories) == 13 and all(sum(r.category == c for r in records) >= 2 for c in categories)
    assert any(len(r.turns) == 2 for r in records) and len({r.question_id for r in records}) == len(records)
    assert "Apache-2.0" in (DEFAULT_DATASET.parent / "README.md").read_text()
    package = Path(bench_cli.__file__).parents[1]
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["quickdraft"]
    for path in (DEFAULT_DATASET, DEFAULT_DATASET.parent / "README.md"):
        assert any(fnmatch.fnmatch(path.relative_to(package).as_posix(), glob) for glob in shipped), path

    assert BenchConfig().dataset == str(DEFAULT_DATASET)
    seen = []
    monkeypatch.setattr(bench_run, "run_bench", lambda cfg: seen.append(cfg))
    assert main(["bench", "--methods", "ngram"]) == 0
    assert seen[0].dataset == str(DEFAULT_DATASET)


def test_the_table_and_the_bar_say_what_they_count(tiny_dataset, capsys):
    """The table's title counts prompts (and their turns) that every method ran; the bar counts runs, prompts x
    methods, and says so."""
    import io

    from rich.console import Console

    out = io.StringIO()
    cfg = BenchConfig(dataset=str(tiny_dataset), methods="ngram", k="2", max_new_tokens=3, categories="writing",
                      cost_repeats=1)
    run_bench(cfg, model=tiny_llama(vocab_size=len(WORDS), layers=2), tokenizer=tiny_tokenizer(),
              console=Console(file=out, width=300))
    assert "2 prompts (3 turns) run by each method" in out.getvalue()
    assert "4/4 runs (2 prompts x 2 methods)" in capsys.readouterr().err


def _prompt_result(question_id, category: str, tokens: int, seconds: float):
    from quickdraft.bench.dataset import Record
    from quickdraft.bench.methods import Generation
    from quickdraft.bench.report import PromptResult, Turn

    return PromptResult(Record(question_id, category, ("x",)), [Turn([1], Generation([0] * tokens, seconds))])


def test_a_groups_speedup_comes_with_its_interval_over_its_prompts():
    """speedup_interval: the central 95% of the group's speedup (mean tokens/s over none's) when its prompts are
    resampled in pairs (a prompt's two runs together). Equal ratios give no spread; a spread of ratios gives an
    interval about the speedup, inside the prompts' least and greatest ratios; the same results give the same
    interval; fewer than two paired prompts give none."""
    from quickdraft.bench.report import speedup_interval

    none = [_prompt_result(q, "qa", 64, seconds) for q, seconds in enumerate([1.0, 2.0, 1.5, 0.5])]
    same = [_prompt_result(q, "qa", 64, seconds / 1.1) for q, seconds in enumerate([1.0, 2.0, 1.5, 0.5])]
    low, high = speedup_interval(same, none)
    assert low == pytest.approx(1.1) and high == pytest.approx(1.1)

    spread = [_prompt_result(q, "qa", 64, seconds / ratio)
              for q, (seconds, ratio) in enumerate(zip([1.0, 2.0, 1.5, 0.5, 1.0, 1.0], [0.85, 1.2, 0.95, 1.0, 0.9, 1.1]))]
    reference = [_prompt_result(q, "qa", 64, seconds) for q, seconds in enumerate([1.0, 2.0, 1.5, 0.5, 1.0, 1.0])]
    low, high = speedup_interval(spread, reference)
    point = (sum(r.tokens_per_s for r in spread) / 6) / (sum(r.tokens_per_s for r in reference) / 6)
    assert 0.85 < low < point < high < 1.2 and high - low > 0.05
    assert speedup_interval(spread, reference) == [low, high]
    assert speedup_interval(list(reversed(spread)), reference) == pytest.approx([low, high], abs=0.02)  # paired by id
    assert speedup_interval(spread[:1], reference) is None
    assert speedup_interval(spread, reference[:1]) is None  # one prompt ran by both


def test_the_report_gives_each_groups_interval(tiny_dataset):
    """The report's groups carry speedup_vs_none_interval (none's own: None), and the table shows it."""
    import io

    from rich.console import Console

    out = io.StringIO()
    cfg = BenchConfig(dataset=str(tiny_dataset), methods="ngram", k="2", max_new_tokens=4,
                      categories="writing,qa", cost_repeats=1)
    report = run_bench(cfg, model=tiny_llama(vocab_size=len(WORDS), layers=2), tokenizer=tiny_tokenizer(),
                       console=Console(file=out, width=300), progress=False)
    ngram, none = report["methods"]["ngram"], report["methods"]["none"]
    low, high = ngram["overall"]["speedup_vs_none_interval"]
    assert low <= ngram["overall"]["speedup_vs_none"] <= high
    assert all(len(ngram["categories"][c]["speedup_vs_none_interval"]) == 2 for c in CATEGORIES)
    assert none["overall"]["speedup_vs_none_interval"] is None
    assert f"[{low:.2f}, {high:.2f}]" in out.getvalue() and "95% interval" in out.getvalue()

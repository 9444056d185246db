"""`quickdraft batch` (quickdraft/offline.py): a JSONL file of prompts, chats and token ids through one continuous
batch, locally as a subprocess over a tiny model saved to disk (no Ray), and on Ray Data in process with a pool of
two actors on a local Ray instance; outputs equal LLM.generate's, in input order. Bad input fails before the model
loads, naming the line and the problem."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quickdraft import SamplingParams
from quickdraft.cli import main
from quickdraft.errors import QuickdraftError
from quickdraft.offline import RayBatchPredictor, generate_records, parse_record, read_records, summary_line

sys.path.insert(0, str(Path(__file__).parent / "server"))
from tiny_server import TIMEOUT_S, tiny_llm, tiny_model, tiny_tokenizer, words  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),  # tiny models: see conftest.one_thread
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]  # Ray Data's own deprecations

PROMPT = words(1, 2, 3, 4, 1, 2, 3, 4, 1)
MESSAGES = [{"role": "user", "content": words(8, 9, 10, 8, 9)}]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
MODEL_ARGS = ["--dtype", "float32", "--device", "cpu", "--k", "4", "--fixed-k", "--max-tokens", "12"]
RECORDS = [
    {"id": "text", "prompt": PROMPT},
    {"messages": MESSAGES, "max_tokens": 8},  # no id: its line number
    None,  # a blank line: skipped
    {"id": 7, "prompt_token_ids": [1, 2, 3, 4, 1, 2, 3], "max_tokens": 5},
    {"id": "seeded", "prompt": words(5, 6, 7), "temperature": 0.9, "top_p": 0.95, "seed": 3},
    {"id": "stopped", "prompt": PROMPT, "max_tokens": 30, "stop": ["w32"], "num_speculative_tokens": 2},
]
EXPECTED_IDS = ["text", 2, 7, "seeded", "stopped"]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join("\n" if r is None else json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def expected(model_dir) -> list[dict]:
    """Each record generated alone by LLM.generate / LLM.chat over the saved model, with the command's defaults."""
    from quickdraft import LLM

    llm = LLM(str(model_dir), dtype="float32", device="cpu", speculative_config=SPEC)
    out = []
    for record in [r for r in RECORDS if r is not None]:
        fields = {k: v for k, v in record.items() if k not in ("id", "prompt", "messages", "prompt_token_ids")}
        params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **fields})
        if "messages" in record:
            result = llm.chat(record["messages"], params)[0]
        elif "prompt_token_ids" in record:
            result = llm.generate({"prompt_token_ids": record["prompt_token_ids"]}, params)[0]
        else:
            result = llm.generate(record["prompt"], params)[0]
        completion = result.outputs[0]
        out.append({"text": completion.text, "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason, "prompt_tokens": len(result.prompt_token_ids)})
    return out


def check_results(results: list[dict], expected: list[dict]) -> None:
    assert [r["id"] for r in results] == EXPECTED_IDS  # input order, ids kept (or the line number)
    for result, want in zip(results, expected):
        assert result["text"] == want["text"] and result["token_ids"] == want["token_ids"], result["id"]
        assert result["finish_reason"] == want["finish_reason"]
        usage = result["usage"]
        assert usage["prompt_tokens"] == want["prompt_tokens"]
        assert usage["completion_tokens"] == len(want["token_ids"])
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert set(result["spec_decode"]) == {"num_drafts", "draft_tokens", "accepted_tokens", "acceptance_rate",
                                              "mean_acceptance_length", "tokens_per_target_forward",
                                              "accepted_per_position", "tree_steps", "accepted_path_lengths",
                                              "lossy"}
        assert result["spec_decode"]["lossy"] is False
    by_id = {r["id"]: r for r in results}
    assert by_id["text"]["finish_reason"] == "length" and by_id["text"]["usage"]["completion_tokens"] == 12
    assert by_id[7]["usage"]["completion_tokens"] == 5
    assert by_id["stopped"]["finish_reason"] == "stop" and by_id["stopped"]["text"].startswith("w16 w25")
    assert by_id["text"]["spec_decode"]["draft_tokens"] > 0  # the repetitive prompt gives n-gram drafts


def test_batch_local_subprocess(tmp_path, model_dir, expected):
    """As a user runs it: no Ray, one process, one continuous batch."""
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    output = tmp_path / "out.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "quickdraft.cli", "batch", "--input", str(source), "--output",
                           str(output), "--model", str(model_dir), *MODEL_ARGS],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    check_results(read_jsonl(output), expected)
    assert "5 records" in done.stderr and "Traceback" not in done.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # the temporary file is gone


def test_generate_records_names_the_record_a_model_refuses():
    llm = tiny_llm()
    ok = parse_record({"id": "a", "prompt": words(1, 2)}, 1, {"max_tokens": 2, "temperature": 0})
    bad_ids = parse_record({"id": "b", "prompt_token_ids": [1, 999]}, 2, {})
    too_long = parse_record({"prompt_token_ids": [1] * 200}, 3, {})
    bad_chat = parse_record({"messages": [{"role": "user", "content": ""}]}, 4, {"max_tokens": 1})
    assert [r["id"] for r in generate_records(llm, [ok, bad_chat])] == ["a", 4]  # an empty message is fine
    with pytest.raises(QuickdraftError, match=r"record 'b' \(line 2\): prompt_token_ids must be ids in \[0, 64\)"):
        generate_records(llm, [ok, bad_ids])
    with pytest.raises(QuickdraftError, match=r"line 3\): the prompt has 200 tokens but the context holds 128"):
        generate_records(llm, [too_long])


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "w1"}', '{"prompt": "w1"'], "in.jsonl:2: not valid JSON"),
    (['{"prompt": "w1", "foo": 1}'], "in.jsonl:1: unknown field 'foo'"),
    (['{"prompt": "w1", "n": 2}'], "n is not supported"),
    (['{"prompt": "w1", "messages": []}'], "in.jsonl:1: give exactly one of 'prompt', 'messages' or "
                                           "'prompt_token_ids'; got prompt, messages"),
    (['{"id": "x"}'], "in.jsonl:1: give exactly one of"),
    (['["w1"]'], "in.jsonl:1: a record is a JSON object, got list"),
    (['{"prompt": ""}'], "in.jsonl:1: prompt must be a non-empty string"),
    (['{"messages": [{"role": "user"}]}'], "in.jsonl:1: messages must be"),
    (['{"prompt_token_ids": [1, -2]}'], "in.jsonl:1: prompt_token_ids must be"),
    (['{"prompt": "w1"}', '{"prompt": "w2", "temperature": -1}'], "in.jsonl:2: temperature must be"),
    (['{"prompt": "w1", "max_tokens": 0}'], "in.jsonl:1: max_tokens must be"),
    (['{"id": "a", "prompt": "w1"}', '', '{"id": "a", "prompt": "w2"}'], "in.jsonl:3: id 'a' is already used on "
                                                                          "line 1"),
    (['{"id": [1], "prompt": "w1"}'], "in.jsonl:1: id must be a string or an integer"),
    (['', '  '], "no records"),
])
def test_bad_input_fails_before_loading_naming_the_line(tmp_path, capsys, lines, message):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    code = main(["batch", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--model", "no/such-model"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("args, message", [
    (["--input", "{tmp}/missing.jsonl"], "--input {tmp}/missing.jsonl: no such file"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}/nodir/out.jsonl"], "does not exist"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}/in.jsonl"], "is the input file"),
    (["--input", "{tmp}/in.jsonl", "--replicas", "2"], "--replicas and --batch-size go with --ray"),
    (["--input", "{tmp}/in.jsonl", "--ray", "--replicas", "0"], "--replicas must be >= 1"),
    (["--input", "{tmp}/in.jsonl", "--temperature", "-1"], "--temperature: temperature must be"),
    (["--input", "{tmp}/in.jsonl", "--draft", "layers:x"], "layers:N"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, args, message):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "w1"}])
    args = [a.format(tmp=tmp_path) for a in args]
    if "--output" not in args:
        args += ["--output", str(tmp_path / "out.jsonl")]
    assert main(["batch", *args, "--model", "no/such-model"]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err, err


def test_ray_missing_says_install_the_extra(tmp_path, capsys, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "w1"}])
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code = main(["batch", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--ray",
                 "--model", "no/such-model"])
    err = capsys.readouterr().err
    assert code == 2 and "install quickdraft[ray]" in err, err


def test_read_records_defaults_and_overrides(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    records = read_records(source, {"max_tokens": 12, "temperature": 0.0, "seed": 5})
    assert [r.id for r in records] == EXPECTED_IDS and [r.line for r in records] == [1, 2, 4, 5, 6]
    assert records[0].params().max_tokens == 12 and records[0].params().seed == 5
    assert records[3].params().temperature == 0.9 and records[3].params().seed == 3
    assert records[4].params().stop == ["w32"] and records[4].params().num_speculative_tokens == 2


# --- Ray Data -------------------------------------------------------------------------------------------------
RAY_MISSING = importlib.util.find_spec("ray") is None


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance for this module's Ray tests: 2 CPUs (one per actor), no dashboard."""
    if RAY_MISSING:
        pytest.skip("ray is not installed: pip install 'quickdraft[ray]' to run the Ray Data tests")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield ray
    finally:
        ray.shutdown()


def test_batch_on_ray_data_with_two_actors(tmp_path, model_dir, expected, local_ray, capsys):
    """The command in process on the module's Ray instance: 2 actors, each its own LLM, the same outputs."""
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    output = tmp_path / "out.jsonl"
    code = main(["batch", "--input", str(source), "--output", str(output), "--model", str(model_dir), *MODEL_ARGS,
                 "--ray", "--replicas", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    check_results(read_jsonl(output), expected)
    assert "on Ray Data, 2 actors" in err  # both actors took a batch


def test_ray_actor_returns_a_bad_record_as_its_batch_error(model_dir):
    """What a Ray Data actor does with a batch, in process: results as JSON, or the QuickdraftError's message as
    the batch's `error` (which run_ray raises on the driver as it is)."""
    records = [parse_record({"id": "fine", "prompt": PROMPT}, 1, {"max_tokens": 2}),
               parse_record({"id": "bad", "prompt_token_ids": [1, 999]}, 2, {})]
    predictor = RayBatchPredictor(dict(model=str(model_dir), dtype="float32", device="cpu", speculative_config=SPEC))
    batch = {"index": [5, 6], "record": [json.dumps(r.to_json()) for r in records]}
    out = predictor(batch)
    assert out["index"] == [5, 6] and out["result"] == ["", ""] and out["worker"][0] == predictor.worker
    assert out["error"] == ["record 'bad' (line 2): prompt_token_ids must be ids in [0, 64); got [999]"] * 2
    good = predictor({"index": [0], "record": [json.dumps(records[0].to_json())]})
    assert good["error"] == [""] and json.loads(good["result"][0])["id"] == "fine"


def test_a_relaxed_llm_says_lossy_in_every_output_and_the_summary():
    """The relaxed acceptance is lossy by name: each batch output line of such an LLM says so (as the server's
    spec_decode does), and so does the summary; an exact LLM's lines and summary do not."""
    records = [parse_record({"id": i, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}, i) for i in range(2)]
    relaxed = generate_records(tiny_llm({**SPEC, "acceptance": "relaxed", "threshold": 0.5}), records)
    assert [r["spec_decode"]["lossy"] for r in relaxed] == [True, True]
    assert "LOSSY: 2 of 2 records" in summary_line(relaxed, 1.0, "out.jsonl")
    exact = generate_records(tiny_llm(SPEC), records)
    assert [r["spec_decode"]["lossy"] for r in exact] == [False, False]
    assert "LOSSY" not in summary_line(exact, 1.0, "out.jsonl")

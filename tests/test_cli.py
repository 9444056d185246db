"""The CLI: bad input gives one clear line and exit code 2, no traceback; a real run prints JSON."""

import json
import os
import subprocess
import sys

import pytest

from quickdraft.errors import QuickdraftError


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "quickdraft.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, word", [
    (["generate", "", "--draft", "none"], "prompt is empty"),
    (["generate", "hi", "--k", "0"], "num_speculative_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--top-k", "-3"], "top_k"),
    (["generate", "hi", "--draft", "layers:x"], "layers:N"),
    (["generate", "hi", "--model", "./no/such/dir"], "unknown model"),
    (["generate", "hi", "--model", "missing.gguf"], "does not exist"),
    (["generate", "hi", "--temperature", "inf"], "temperature"),
    (["generate", "hi", "--temperature", "nan"], "temperature"),
    (["generate", "hi", "--seed", str(2 ** 70)], "seed"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--min-p", "2"], "min_p"),
    (["generate", "hi", "--presence-penalty", "5"], "presence_penalty"),
    (["generate", "hi", "--repetition-penalty", "0"], "repetition_penalty"),
    (["generate", "hi", "--k", "-1"], "num_speculative_tokens"),
    (["generate", "hi", "--draft", "layers:0"], "num_layers"),
    (["generate", "hi", "--stop", ""], "stop strings"),
    (["generate", "hi", "--k", "two"], "invalid int value"),
    (["generate", "hi", "--dtype", "int4"], "invalid choice"),
    (["generate", "hi", "--compare", "--compare-rounds", "0"], "--compare-rounds"),
    (["distill", "--out", "unused", "--epochs", "0"], "--epochs must be at least 1"),
    (["distill", "--out", "unused", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["distill", "--out", "unused", "--temperatures", "0,hot"], "--temperatures must be numbers"),
    (["distill", "--out", "unused", "--temperatures", "nan"], "--temperatures must be >= 0"),
])
def test_bad_input_exits_2_with_a_clear_message(args, word):
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert word in result.stderr and "Traceback" not in result.stderr


def test_not_a_gguf(tmp_path):
    fake = tmp_path / "x.gguf"
    fake.write_text("hello")
    result = _cli("generate", "hi", "--model", str(fake))
    assert result.returncode == 2 and "not a GGUF file" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_generate_json_and_summary():
    result = _cli("generate", "Repeat exactly: red green blue, red green blue, red", "--max-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["token_ids"]) == data["metrics"]["num_generated_tokens"] <= 12
    assert data["text"] and 0 <= data["metrics"]["acceptance_rate"] <= 1
    assert "loading smollm2-135m" not in result.stderr  # no terminal: no progress (issue 47)
    result = _cli("generate", "Say hello.", "--chat", "--max-tokens", "8", "--draft", "none", "--progress")
    assert result.returncode == 0 and result.stdout.strip()
    assert "[quickdraft]" in result.stderr and "tok/s" in result.stderr
    assert "loading smollm2-135m" in result.stderr  # asked for: drawn though stderr is a pipe


@pytest.mark.slow
def test_prompt_longer_than_context():
    result = _cli("generate", "word " * 9000, "--max-tokens", "4")
    assert result.returncode == 2 and "context" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_readme_first_command_shows_what_speculation_did():
    """Issue 9, defect 12 (failed before: --compare did not exist, and the summary counted drafts that were
    never output). The README's prompt: drafts are accepted, the summary is consistent, plain and speculative
    texts are identical."""
    prompt = ("Fix the typos in this text and return it: Speculative decodng lets a smal draft model propose "
              "tokens that the big model checks in one pass. The output is exactly the same as without it, only "
              "faster.")
    result = _cli("generate", prompt, "--chat", "--compare", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "Speculative" in result.stdout
    assert "texts identical" in result.stderr and "without speculation" in result.stderr
    # --fixed-k: adaptive K prices drafting from measured step costs, and on a loaded machine it may draft nothing
    # (seen in CI while a benchmark ran beside it: accepted_tokens 0); the counts below need drafts to check
    result = _cli("generate", prompt, "--chat", "--compare", "--max-tokens", "24", "--json", "--fixed-k")
    data = json.loads(result.stdout)
    m = data["metrics"]
    assert data["compare"]["identical"] and m["accepted_tokens"] > 0
    assert m["num_generated_tokens"] == len(data["token_ids"]) <= m["target_forwards"] + m["accepted_tokens"]
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["accepted_tokens"] / m["num_drafts"])


def test_compare_warms_both_modes_then_interleaves_rounds_and_reports_the_median(monkeypatch):
    """Issue 21.8: the speculative run went first, paid the warm-up, and adaptive K priced drafting from that
    cold run; one ratio of two runs was a random number. Now both modes are warmed, then each round runs both,
    the order alternating, and the figure is the median of the rounds' ratios with their spread."""
    from conftest import tiny_llama
    from quickdraft import LLM, SamplingParams
    from quickdraft.cli import compare_rounds

    calls = []

    def spy(method):
        def wrapped(self, prompt, params=None):
            calls.append(("spec" if self.speculative_config.method != "none" else "plain", params.max_tokens))
            return method(self, prompt, params)
        return wrapped

    monkeypatch.setattr(LLM, "generate", spy(LLM.generate))
    monkeypatch.setattr(LLM, "stream", spy(LLM.stream))
    llm = LLM(tiny_llama(seed=0), dtype="float32", device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]}
    params = SamplingParams(temperature=0, max_tokens=40)
    rounds = compare_rounds(llm, prompt, params, 3, echo=False)
    assert calls[:2] == [("plain", 32), ("spec", 32)]  # the warm-ups
    # Issue 47: 3 rounds of 40 tokens would be 120 tokens a mode; rounds go on until each mode has decoded 256
    assert len(calls) == 2 + 2 * 7 and [mode for mode, _ in calls[2:8]] == ["plain", "spec", "spec", "plain",
                                                                           "plain", "spec"]
    data = rounds.to_dict()
    assert data["rounds"] == 7 and data["tokens_per_mode"] == 280 and data["identical"]
    ratios = sorted(data["round_speedups"])
    assert data["speedup"] == ratios[3] and data["speedup_min"] == ratios[0] and data["speedup_max"] == ratios[6]
    line = rounds.line(params)
    assert "7 interleaved rounds after a warm-up of each mode, 280 tokens a mode" in line and "texts identical" in line
    assert f"with {data['spec_tokens_per_s']:.1f} tok/s (medians)" in line


def _fake_output(tokens: int, tok_s: float):
    from types import SimpleNamespace

    metrics = SimpleNamespace(tokens_per_s=tok_s, num_generated_tokens=tokens, to_dict=lambda: {})
    return SimpleNamespace(metrics=metrics, outputs=[SimpleNamespace(token_ids=[1] * tokens)])


def test_compare_says_so_when_speculation_loses():
    """Issue 47: the comparison stays honest: a median ratio below 1 is a slowdown, in words."""
    from quickdraft import SamplingParams
    from quickdraft.cli import CompareRounds

    rounds = CompareRounds()
    for plain, spec in ((100.0, 90.0), (100.0, 95.0), (100.0, 80.0)):
        rounds.plain.append(_fake_output(32, plain))
        rounds.spec.append(_fake_output(32, spec))
    line = rounds.line(SamplingParams(temperature=0))
    assert "speculation SLOWER here: 0.90x the plain speed" in line and "rounds 0.80-0.95x" in line
    assert "without speculation 100.0 tok/s, with 90.0 tok/s (medians)" in line
    rounds.spec = [_fake_output(32, 150.0) for _ in range(3)]
    assert "speculation 1.50x as fast" in rounds.line(SamplingParams(temperature=0))


def test_with_compare_the_summary_line_leaves_the_speeds_to_the_comparison():
    """Issue 47: the first line said 113.8 tok/s (one cold run), the comparison 39.3 (the median): now only the
    comparison gives speeds, one measurement."""
    from types import SimpleNamespace

    from quickdraft.cli import summary_line

    metrics = SimpleNamespace(num_generated_tokens=32, wall_time_s=0.5, tokens_per_s=64.0, acceptance_rate=None,
                              target_forwards=20, tokens_per_target_forward=1.6, lossy=False)
    assert "tok/s" in summary_line(metrics, "ngram", 5) and "0.50 s" in summary_line(metrics, "ngram", 5)
    line = summary_line(metrics, "ngram", 5, speed=False)
    assert "tok/s" not in line and " s |" not in line and line.startswith("[quickdraft] 32 tokens | draft ngram")


def test_every_draft_help_and_the_llm_docstring_name_every_registered_method():
    """Help strings had drifted (batch lacked suffix and eagle, check quantized:q4, the LLM docstring listed
    five of seven methods): they are built from the draft registry now."""
    import argparse

    from quickdraft import LLM
    from quickdraft.cli import build_parser
    from quickdraft.drafts import METHODS, PROPOSERS

    spellings = [cls.spelling for cls in PROPOSERS.values() if cls.spelling]
    assert len(spellings) == len(PROPOSERS)
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("generate", "serve", "batch", "check"):
        draft = next(a for a in subparsers.choices[command]._actions if "--draft" in a.option_strings)
        for spelling in spellings:
            assert spelling in draft.help, (command, spelling)
    for method in METHODS:
        assert f'"{method}"' in LLM.__doc__


def _subparsers(parser):
    import argparse

    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_help_shows_every_default():
    """Issue 47: `--help` showed no defaults for generate --max-tokens, --top-p, --top-k, or distill --epochs, --lr,
    --batch-tokens. Now every option of every command whose default is a value says it."""
    from quickdraft.cli import build_parser
    from quickdraft.cli_args import _shows_default

    commands = _subparsers(build_parser())
    assert set(commands) == {"generate", "serve", "batch", "check", "tune", "distill", "bench"}
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if _shows_default(action):
                assert "default" in formatter._format_action(action), (name, action.option_strings)

    def help_of(command: str, option: str) -> str:
        action = next(a for a in commands[command]._actions if option in a.option_strings)
        return " ".join(commands[command]._get_formatter()._format_action(action).split())

    assert "(default: 256)" in help_of("generate", "--max-tokens")
    assert "(default: 1.0)" in help_of("generate", "--top-p") and "(default: 0)" in help_of("generate", "--top-k")
    assert "(default: 4)" in help_of("distill", "--epochs") and "(default: 0.001)" in help_of("distill", "--lr")
    assert "(default: 4096)" in help_of("distill", "--batch-tokens")
    assert "(default: ngram)" in help_of("generate", "--draft") and "default: ngram" not in help_of("generate", "--k")


COMMANDS = ("generate", "serve", "batch", "check", "tune", "distill", "bench")


def test_help_imports_neither_torch_nor_transformers():
    """Issue 47: every --help took 2.4 s (5+ loaded) importing torch and transformers first. quickdraft's help and
    every command's, printed in one fresh interpreter, leave neither imported, and show the defaults and the
    draft methods (read from cli_args.DRAFT_SPELLINGS, the registry not imported)."""
    from quickdraft.bench.names import BASELINE_HELP, DEFAULT_METHODS
    from quickdraft.cli_args import DRAFT_SPELLINGS
    from quickdraft.tools.check.checking import DEFAULT_MAX_TOKENS as CHECK_MAX_TOKENS
    from quickdraft.tools.distill_cli import DEFAULT_EPOCHS, DEFAULT_TOKENS
    from quickdraft.tools.tune.defaults import DEFAULT_DRAFTS, DEFAULT_K_MAX, DEFAULT_MAX_TOKENS

    code = ("import contextlib, io, json, sys\n"
            "from quickdraft.cli import main\n"
            "helps = {}\n"
            f"for argv in [['--help']] + [[command, '--help'] for command in {COMMANDS!r}]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "    helps[argv[0]] = out.getvalue()\n"
            "imported = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "print(json.dumps({'helps': helps, 'imported': imported}))\n")
    # A wide terminal: no line is wrapped, so that no name is broken at a hyphen
    env = {**os.environ, "COLUMNS": "10000"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["imported"] == []
    helps = {name: " ".join(text.split()) for name, text in data["helps"].items()}
    assert all(command in helps["--help"] for command in COMMANDS)
    for command in COMMANDS:
        assert helps[command].startswith(f"usage: quickdraft {command} ") and "--progress" in helps[command], command
    methods = [spelling for spelling, _ in DRAFT_SPELLINGS]
    for command in ("generate", "serve", "batch", "check", "tune", "bench"):  # --draft's, --drafts' or --methods'
        assert all(spelling in helps[command] for spelling in methods), command
    assert "tokens to generate at most (default: 256)" in helps["generate"] and "(default: ngram)" in helps["generate"]
    assert "port to listen on (default: 8000)" in helps["serve"]
    assert "for records that set no max_tokens (default 256)" in helps["batch"]
    assert f"tokens per prompt in the greedy comparison (default {CHECK_MAX_TOKENS})" in helps["check"]
    assert f"(default: {DEFAULT_DRAFTS})" in helps["tune"] and f"largest K tried (default {DEFAULT_K_MAX})" in \
        helps["tune"] and f"tokens generated per prompt (default {DEFAULT_MAX_TOKENS})" in helps["tune"]
    assert f"passes over the generated training data (default: {DEFAULT_EPOCHS})" in helps["distill"]
    assert f"(default {DEFAULT_TOKENS})" in helps["distill"] and "then a cosine decay) (default: 0.001)" in \
        helps["distill"] and "padded positions per training batch (default: 4096)" in helps["distill"]
    assert f"{BASELINE_HELP} (default {DEFAULT_METHODS}; none is always added)" in helps["bench"]
    assert "a comma list sweeps K (e.g. 1,2,4,6,8) (default: 5)" in helps["bench"]


def test_distill_checks_its_arguments_then_runs_the_training(monkeypatch, tmp_path):
    """`quickdraft distill`'s arguments live in tools/distill_cli.py (no torch); the training module is imported
    and run with --temperatures read."""
    from quickdraft.cli import main
    from quickdraft.tools import distill

    seen = []
    monkeypatch.setattr(distill, "run", lambda args, temperatures: seen.append((args.out, temperatures)) or 0)
    assert main(["distill", "--out", str(tmp_path / "head"), "--temperatures", "0,1.5"]) == 0
    assert seen == [(str(tmp_path / "head"), (0.0, 1.5))]


def test_the_help_table_of_draft_spellings_is_the_registrys():
    """--draft's and --tree's help come from cli_args.DRAFT_SPELLINGS while the registry (which imports torch) is
    not imported: a method added to the registry must be added there too, in the registry's order."""
    from quickdraft.cli_args import DRAFT_SPELLINGS
    from quickdraft.drafts import BUILT_IN

    listed = sorted(BUILT_IN, key=lambda cls: cls.spelling_catches_all)  # the registry's draft_help order
    assert [(cls.spelling, cls.proposes_trees) for cls in listed] == list(DRAFT_SPELLINGS), \
        "add the method's --draft spelling to quickdraft/cli_args.py's DRAFT_SPELLINGS"


@pytest.mark.parametrize("argv", [["generate", "hi"], ["serve"], ["batch", "--input", "in.jsonl", "--output", "o"],
                                  ["check", "--prompts", "p.txt"]])
def test_an_unknown_draft_fails_before_any_model_loads_and_lists_the_methods(argv, monkeypatch, capsys, tmp_path):
    """Issue 47: `--draft bogus_method` loaded the target (23 s), then said "unknown model 'bogus_method'" without
    the methods. Now it fails before loading anything, naming the methods and how to name a draft model."""
    from quickdraft import api
    from quickdraft.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(api.LLM, "__init__", no_load)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "p.txt").write_text("hi\n")
    assert main([*argv, "--draft", "bogus_method"]) == 2
    error = capsys.readouterr().err
    assert "--draft 'bogus_method' is not a draft method" in error
    for spelling in ("ngram", "suffix", "layers:N", "lookup+MODEL", "eagle[:HEAD_DIR]"):
        assert spelling in error
    assert "a .gguf file, a model directory or a hub id (org/name)" in error
    assert main([*argv, "--draft", "lookup+bogus_model"]) == 2
    assert "--draft 'lookup+bogus_model': its draft model: unknown model 'bogus_model'" in capsys.readouterr().err


def test_the_ray_serve_app_checks_its_draft_with_the_same_chain():
    """One chain (cli_args.checked_speculative_config) serves generate, serve, batch, check and the Ray Serve
    app's `serve run` options."""
    from quickdraft.server.ray_serve import app_settings

    with pytest.raises(QuickdraftError, match="is not a draft method"):
        app_settings({"draft": "bogus_method"}, environ={})
    llm_kwargs, _, _ = app_settings({"draft": "suffix", "k": 3, "fixed_k": True, "tree": "4,2"}, environ={})
    assert llm_kwargs["speculative_config"] == {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False,
                                                "tree": {"max_nodes": 4, "max_depth": 2}}


def test_serve_says_when_it_is_ready(capsys):
    """Issue 47: `quickdraft serve` said nothing for the 37 s of its load; once it accepts connections it says
    where."""
    import socket
    import threading

    from quickdraft.cli import say_when_ready

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        waiting = threading.Thread(target=say_when_ready, args=("127.0.0.1", port, "m"), kwargs={"poll_s": 0.01})
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive() and "ready" not in capsys.readouterr().err  # not listening yet
        listener.listen()
        waiting.join(60)
    assert f"[quickdraft] ready on http://127.0.0.1:{port} (model m;" in capsys.readouterr().err


def test_serve_refuses_a_taken_port_before_loading(monkeypatch, capsys):
    """The port is checked before the model's load (uvicorn found it taken only after it), and so the "ready"
    line is the server's own."""
    import socket

    from quickdraft import api
    from quickdraft.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(api.LLM, "__init__", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--draft", "none"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err

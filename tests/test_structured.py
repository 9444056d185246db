"""Structured outputs (quickdraft/structured.py, on llguidance) under speculation: the joint law of 5 constrained
tokens equals plain constrained sampling's exactly, greedy constrained output equals plain constrained output,
lookup drafts that leave the grammar are cut, and JSON / regex / choice outputs parse.

The law test is tests/test_law.py's (4-token vocabulary, T = 5, K = 3 fixed, 8 chi-square statistics at
ALPHA / 8 each, fixed seeds) with the target's pieces a, b, c, ab and the regex (ab?c?)*: no b or c first,
no b after b or c, no c after c, so the grammar removes tokens at most prefixes and allows two or more
everywhere. The reference law is
computed without llguidance: a token is allowed after the text s when s + its text matches the regex (the
language is prefix-closed), and its logit is -inf otherwise before the request's processing."""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import pytest
import torch

from conftest import assert_greedy_equals_plain
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.structured import StructuredOutputs
from drafts.test_cross_vocab import TARGET_PIECES, piece_tokenizer
from test_law import CELLS, INDEX, N, REQUEST_SEED, T, _config, _LawTest, _models, _plain_law, _sample_rejection, \
    _Tables, assert_follows_law

pytestmark = pytest.mark.usefixtures("one_thread")
REGEX = "(ab?c?)*"
SETTINGS = {"t0.9": dict(temperature=0.9),
            "t1.3-penalties-topk": dict(temperature=1.3, top_k=3, repetition_penalty=1.2, presence_penalty=0.3)}
PROMPT = [1, 2, 0, 1, 2]


def _allowed(prefix: tuple) -> torch.Tensor:
    text = "".join(TARGET_PIECES[t] for t in prefix)
    return torch.tensor([re.fullmatch(REGEX, text + piece) is not None for piece in TARGET_PIECES])


@functools.lru_cache(maxsize=None)
def _constrained_law(setting: str) -> np.ndarray:
    """test_law's plain law over logits tables masked by the regex (-inf outside it, before processing). A
    prefix outside the language (probability zero, but expanded all the same) keeps its logits: masked, it
    would allow nothing and give NaN."""
    tables = _Tables(_models()[0], PROMPT, SamplingParams(**SETTINGS[setting]))
    for prefix, row in tables.logits.items():
        allowed = _allowed(prefix)
        if allowed.any():
            tables.logits[prefix] = row.masked_fill(~allowed, float("-inf"))
    return _plain_law(tables)


def _llm(method: str) -> LLM:
    config = _config(method)
    if method == "draft_model":  # the draft shares the target's pieces
        config["tokenizer"] = piece_tokenizer(TARGET_PIECES)
    return LLM(_models()[0], tokenizer=piece_tokenizer(TARGET_PIECES), dtype="float32", device="cpu",
               speculative_config=config)


def _attach_grammars(llm: LLM) -> None:
    """test_law's rejection sampler makes sequences with engine.new_sequence: give each its grammar, as
    LLM._sequences does."""
    new_sequence = llm.engine.new_sequence

    def with_grammar(prompt, sp, generator=None, noise_key=None):
        seq = new_sequence(prompt, sp, generator, noise_key)
        seq.grammar = llm._grammar(sp)
        return seq

    llm.engine.new_sequence = with_grammar


def _constraint():
    return {"regex": REGEX}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("seeding", ["rejection", "request-seed"])
def test_five_constrained_tokens_follow_the_target_constrained_law(seeding, method, setting):
    law = _constrained_law(setting)
    assert (law > 0).sum() >= 100 and (law == 0).sum() > 0  # the grammar cuts, and leaves room
    n = N[method]
    test = _LawTest(law, n)
    llm = _llm(method)
    params = SamplingParams(max_tokens=T, structured_outputs=_constraint(), **SETTINGS[setting])
    if seeding == "rejection":
        _attach_grammars(llm)
        samples, metrics, steps = _sample_rejection(llm, n, PROMPT, params)
        assert sum(v for (k, a), v in steps.items() if k == 3 and a >= 1) >= 5, steps
    else:
        seeded = SamplingParams(n=n, seed=REQUEST_SEED, max_tokens=T, structured_outputs=_constraint(),
                                **SETTINGS[setting])
        out = llm.generate({"prompt_token_ids": PROMPT}, seeded)[0]
        samples, metrics, steps = [tuple(c.token_ids) for c in out.outputs], [out.metrics], None
    assert all(re.fullmatch(REGEX, "".join(TARGET_PIECES[t] for t in s)) for s in samples)
    assert_follows_law(test, samples, metrics, steps, n, f"structured {seeding} {method} {setting}")


def test_the_constrained_law_test_sees_an_unmasked_draft():
    """Power: samples of the unconstrained law (what a verifier that forgot the mask would give) fail."""
    law = _constrained_law("t0.9")
    test = _LawTest(law, N["draft_model"])
    free = _plain_law(_Tables(_models()[0], PROMPT, SamplingParams(**SETTINGS["t0.9"])))
    rng = np.random.default_rng(0)
    draws = rng.multinomial(test.n, free, size=20)
    assert all(test.rejects(counts) for counts in draws)


def test_the_constrained_law_test_sees_a_draft_drawn_without_the_mask(monkeypatch):
    """Power against a subtler bug: the target masked, the draft model not (its drafts outside the grammar are
    cut, the others verified against an unmasked q): rejection sampling is then no longer exact, and the same
    test at the same N rejects it."""
    from quickdraft import sequence

    original = sequence.Sequence.process

    def unmasked(self, logits, pending, first_row=0):
        grammar, self.grammar = self.grammar, None
        try:
            return original(self, logits, pending, first_row)
        finally:
            self.grammar = grammar

    monkeypatch.setattr(sequence.Sequence, "process", unmasked)
    law = _constrained_law("t0.9")
    test = _LawTest(law, N["draft_model"])
    llm = _llm("draft_model")
    _attach_grammars(llm)
    params = SamplingParams(max_tokens=T, structured_outputs=_constraint(), **SETTINGS["t0.9"])
    samples, _, _ = _sample_rejection(llm, N["draft_model"], PROMPT, params)
    counts = np.bincount([INDEX[s] for s in samples], minlength=len(CELLS))
    assert test.rejects(counts)


def test_greedy_constrained_output_equals_plain_with_lookup_drafts():
    """ngram proposes continuations copied from the prompt, which may break the grammar (cc, bb): they are cut
    before verification; greedy output equals plain constrained greedy output at batch 1 and 4."""
    tokenizer = piece_tokenizer(TARGET_PIECES)
    plain = LLM(_models()[0], tokenizer=tokenizer, dtype="float32", device="cpu")
    spec = _llm("ngram")
    prompts = [{"prompt_token_ids": p} for p in ([0, 2, 2, 0, 2, 2, 0], [1, 2, 0, 1, 2, 0, 1], [3, 3, 1, 3])]
    sp = SamplingParams(temperature=0, max_tokens=16, structured_outputs={"regex": REGEX})
    for out in assert_greedy_equals_plain(spec, plain, prompts, sp):
        assert re.fullmatch(REGEX, "".join(TARGET_PIECES[t] for t in out.outputs[0].token_ids))


@pytest.mark.slow
def test_json_regex_and_choice_on_the_packaged_model(smollm2):
    llm = smollm2.with_speculative_config({"method": "ngram", "num_speculative_tokens": 5})
    prompt = llm.chat_prompt([{"role": "user", "content": "Describe a cat as JSON with its name and age."}])
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    spec = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": schema}))[0]
    plain = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": schema}))[0]
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    data = json.loads(spec.outputs[0].text)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int) and spec.outputs[0].finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(temperature=0.8, seed=2, max_tokens=12,
                                              structured_outputs={"regex": "[0-9]{3}-[a-z]{2,4}"}))[0]
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8,
                                              structured_outputs={"choice": ["meow", "purr"]}))[0]
    assert out.outputs[0].text in ("meow", "purr")


@pytest.mark.parametrize("value, word", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["a"]}, "exactly one of"), ({"choice": []}, "choice must be"),
    ({"json": 3}, "json must be"), ({"schema": {}}, "unknown fields"), ("json", "must be a StructuredOutputs"),
])
def test_bad_constraints_name_the_problem(value, word):
    with pytest.raises(QuickdraftError, match=word):
        SamplingParams(structured_outputs=value)


def test_a_constraint_that_does_not_compile_is_refused_at_once():
    llm = _llm("ngram")
    with pytest.raises(QuickdraftError, match="structured_outputs"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(structured_outputs={"regex": "(unclosed"}))
    with pytest.raises(QuickdraftError, match="structured_outputs"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(structured_outputs={"json": "{not json"}))
    assert StructuredOutputs.of({"json_object": True}).json_object

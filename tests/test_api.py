"""Bad input through the Python API, as a new user would try it: every case is a QuickdraftError that names
the argument, never a bare TypeError from deep inside."""

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_llama(seed=0), speculative_config={"method": "ngram"})


OK_PROMPT = {"prompt_token_ids": [1, 2, 3]}
GREEDY = SamplingParams(temperature=0, max_tokens=2)

# (what a user calls, a word the error must contain)
CALLS = [
    (lambda llm: llm.generate(None), "prompts must be"),
    (lambda llm: llm.generate(5), "prompts must be"),
    (lambda llm: llm.generate([]), "no prompts"),
    (lambda llm: llm.generate([OK_PROMPT, 7], GREEDY), "a prompt is a string or a dict"),
    (lambda llm: llm.generate(OK_PROMPT, "greedy"), "sampling_params"),
    (lambda llm: llm.generate(OK_PROMPT, [GREEDY, {"temperature": 0}]), "sampling_params"),
    (lambda llm: llm.generate([OK_PROMPT], [GREEDY, GREEDY]), "2 SamplingParams for 1 prompts"),
    (lambda llm: llm.generate({"prompt_token_ids": "abc"}), "prompt_token_ids"),
    (lambda llm: llm.generate({"prompt_token_ids": [1, 2.5]}), "prompt_token_ids"),
    (lambda llm: llm.generate({"prompt_token_ids": [-1]}), r"\[0, 32\)"),
    (lambda llm: llm.generate({"text": "hi"}), "'prompt' or 'prompt_token_ids'"),
    (lambda llm: llm.generate("hello"), "no tokenizer"),
    (lambda llm: llm.generate(OK_PROMPT, SamplingParams(max_tokens=2, stop=["x"])), "stop"),
    (lambda llm: llm.chat(None), "messages"),
    (lambda llm: llm.chat("hi"), "messages"),
    (lambda llm: llm.stream([OK_PROMPT, OK_PROMPT]), "one prompt"),
    (lambda llm: llm.stream(OK_PROMPT, 0.5), "sampling_params"),
    (lambda llm: llm.with_speculative_config("ngram"), "speculative_config must be a dict"),
    (lambda llm: llm.with_speculative_config({"method": "eagle9"}), "unknown speculative method"),
]


@pytest.mark.parametrize("call, word", CALLS, ids=[f"call{i}" for i in range(len(CALLS))])
def test_bad_calls_name_the_problem(llm, call, word):
    with pytest.raises(QuickdraftError, match=word):
        result = call(llm)
        if hasattr(result, "__iter__") and not isinstance(result, list):
            list(result)


CONSTRUCTIONS = [
    (dict(model=None), "model must be"),
    (dict(model=42), "model must be"),
    (dict(seed=2 ** 70), "seed"),
    (dict(seed="x"), "seed"),
    (dict(trust_remote_code="yes"), "trust_remote_code"),
    (dict(runner="fast"), "unknown runner"),
    (dict(max_model_len=1), "max_model_len"),
    (dict(max_model_len=True), "max_model_len"),
    (dict(dtype="int4"), "unknown dtype"),
    (dict(dtype=torch.int8), "unsupported dtype"),
    (dict(device="tpu"), "device"),
    (dict(speculative_config="ngram"), "speculative_config must be a dict"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": -2}), "num_speculative_tokens"),
    (dict(speculative_config={"method": "ngram", "adaptive": "no"}), "adaptive"),
    (dict(speculative_config={"method": "ngram"}, speculative_model="x"), "either speculative_config"),
    (dict(num_speculative_tokens=-1, speculative_model=tiny_llama(seed=1)), "num_speculative_tokens"),
]


@pytest.mark.parametrize("kwargs, word", CONSTRUCTIONS, ids=[f"llm{i}" for i in range(len(CONSTRUCTIONS))])
def test_bad_llm_arguments_name_the_problem(kwargs, word):
    kwargs = dict(kwargs)
    model = kwargs.pop("model", None) if "model" in kwargs else tiny_llama(seed=0)
    with pytest.raises(QuickdraftError, match=word):
        LLM(model, **kwargs)


def test_with_speculative_config_leaves_the_seed_stream_alone():
    """LLM(seed=1).generate(p) gives the same text whether or not with_speculative_config was called first, and
    the derived LLM draws what a fresh LLM(seed=1) with that config draws (seeded: the same as plain)."""
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 1, 2]}
    params = SamplingParams(temperature=1.0, max_tokens=16)

    def fresh():
        return LLM(tiny_llama(seed=0), dtype="float32", device="cpu", seed=1)

    want = fresh().generate(prompt, params)[0].outputs[0].token_ids
    llm = fresh()
    derived = llm.with_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
    assert derived.generate(prompt, params)[0].outputs[0].token_ids == want
    assert llm.generate(prompt, params)[0].outputs[0].token_ids != want  # the stream does move on per request


def test_freeze_loaded_objects_takes_every_live_object_out_of_the_collections():
    """What a server does after loading: a collection, then every object alive moves to the permanent generation."""
    import gc

    from quickdraft.api import freeze_loaded_objects

    gc.collect()
    assert gc.get_objects(generation=2)  # the test session's objects, before
    try:
        freeze_loaded_objects()
        assert gc.get_freeze_count() > 0 and not gc.get_objects(generation=2)
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    assert gc.get_freeze_count() == 0

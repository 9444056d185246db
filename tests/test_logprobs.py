"""Log-probabilities and logit_bias under speculation (SamplingParams.logprobs, prompt_logprobs, logit_bias).

logprobs are the target's raw log-probabilities (log_softmax of its logits before any processing, vLLM's
default logprobs_mode) of each emitted token and its alternatives, read from the verification forward: the
rows plain decoding computes for the same positions. On the CPU kernels (bf16, every row computed alike
whatever the call) they equal plain decoding's bitwise; in float32 through torch within rounding."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import cpu_linear
from conftest import tiny_llama16

pytestmark = pytest.mark.usefixtures("one_thread")
needs_kernels = pytest.mark.skipif(cpu_linear() is None, reason="quickdraft's CPU kernels need AVX512-BF16")
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]}, {"prompt_token_ids": [7, 5, 9, 7, 5, 9, 7]}]


def _logprob_table(out):
    return [{t: (lp.logprob, lp.rank) for t, lp in entry.items()} for entry in out.outputs[0].logprobs]


def _reference(model, prompt: list[int], output: list[int], top: int):
    """Teacher-forced: one float32 forward of prompt + output through transformers, log_softmax per row."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    rows = logp[len(prompt) - 1: len(prompt) - 1 + len(output)]
    return [(float(row[t]), {int(i) for i in row.topk(top).indices}) for row, t in zip(rows, output)]


@pytest.mark.parametrize("config", [{"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
                                    {"model": "draft", "num_speculative_tokens": 3, "adaptive": False}],
                         ids=["ngram", "draft_model"])
def test_logprobs_with_speculation_are_plain_decodings_and_the_models_own(config):
    target = tiny_llama(seed=0)
    if config.get("model") == "draft":
        config = {**config, "model": tiny_llama(seed=0)}  # the same weights: its drafts are accepted
    plain = LLM(target, dtype="float32", device="cpu")
    spec = LLM(target, dtype="float32", device="cpu", speculative_config=config)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3)
    want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert sum(o.metrics.accepted_tokens for o in got) > 0  # drafts were accepted: multi-row verification
    for p, w, g in zip(PROMPTS, want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        wt, gt = _logprob_table(w), _logprob_table(g)
        assert len(gt) == len(g.outputs[0].token_ids) and [set(e) for e in gt] == [set(e) for e in wt]
        for we, ge in zip(wt, gt):
            for token in we:
                assert ge[token][0] == pytest.approx(we[token][0], abs=1e-4) and ge[token][1] == we[token][1]
        for (lp, top), entry, token in zip(_reference(target, p["prompt_token_ids"], g.outputs[0].token_ids, 3),
                                           gt, g.outputs[0].token_ids):
            assert entry[token][0] == pytest.approx(lp, abs=1e-4) and top <= set(entry)
            assert entry[token][1] == 1  # greedy: the chosen token is the most likely
        assert g.outputs[0].cumulative_logprob == pytest.approx(sum(e[t][0] for e, t in zip(gt, g.outputs[0].token_ids)))


@needs_kernels
def test_logprobs_are_bitwise_plain_decodings_on_the_row_invariant_kernels():
    model = tiny_llama16(seed=0).to(torch.bfloat16)
    plain = LLM(model, dtype="bfloat16", device="cpu")
    spec = LLM(model, dtype="bfloat16", device="cpu",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert spec.target.rows_invariant
    for params in (SamplingParams(temperature=0, max_tokens=24, logprobs=5, prompt_logprobs=2),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=24, logprobs=2)):
        want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
        assert sum(o.metrics.accepted_tokens for o in got) > 0
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert _logprob_table(g) == _logprob_table(w)
            if params.prompt_logprobs is not None:
                assert [e and {t: lp.logprob for t, lp in e.items()} for e in g.prompt_logprobs] == \
                       [e and {t: lp.logprob for t, lp in e.items()} for e in w.prompt_logprobs]


def test_prompt_logprobs_score_every_prompt_token_and_skip_the_prefix_cache():
    target = tiny_llama(seed=0)
    llm = LLM(target, dtype="float32", device="cpu", enable_prefix_caching=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = PROMPTS[0]["prompt_token_ids"] * 4  # 40 tokens: two full blocks a second request could reuse
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    for _ in range(2):  # the second request would find the first's blocks kept
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        reference = _reference(target, prompt[:1], prompt[1:], 1)
        for entry, token, (lp, _) in zip(out.prompt_logprobs[1:], prompt[1:], reference):
            assert entry[token].logprob == pytest.approx(lp, abs=1e-4) and len(entry) <= 2
        assert out.outputs[0].logprobs is None and out.metrics.num_cached_tokens == 0
    one = llm.generate({"prompt_token_ids": [5]}, params)[0]
    assert one.prompt_logprobs == [None]


def test_logit_bias_steers_target_and_draft_alike():
    """A +100 bias makes a token the greedy choice everywhere (target and draft model agree: drafts accepted);
    a -100 bias keeps a token out even of sampled output; speculative output equals plain output."""
    target, draft = tiny_llama(seed=0), tiny_llama(seed=7)
    plain = LLM(target, dtype="float32", device="cpu")
    spec = LLM(target, dtype="float32", device="cpu",
               speculative_config={"model": draft, "num_speculative_tokens": 3, "adaptive": False})
    forced = SamplingParams(temperature=0, max_tokens=12, logit_bias={17: 100})
    out = spec.generate(PROMPTS, forced)
    assert all(o.outputs[0].token_ids == [17] * 12 for o in out)
    assert all(o.metrics.accepted_tokens > 0 for o in out)
    banned = SamplingParams(temperature=1.0, max_tokens=30, seed=5, logit_bias={"3": -100, 4: -100})
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, banned)]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, banned)]
    assert got == want and not {3, 4} & {t for ids in got for t in ids}


@pytest.mark.parametrize("kwargs, word", [
    (dict(logprobs=-1), "logprobs must be"), (dict(logprobs=21), "logprobs must be"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs must be"), (dict(logit_bias=[1, 2]), "logit_bias must be a mapping"),
    (dict(logit_bias={"x": 1}), "logit_bias keys"), (dict(logit_bias={1: 101}), "logit_bias values"),
    (dict(logit_bias={1: float("nan")}), "logit_bias values"),
])
def test_bad_logprobs_and_logit_bias_name_the_problem(kwargs, word):
    with pytest.raises(QuickdraftError, match=word):
        SamplingParams(**kwargs)


def test_a_logit_bias_outside_the_vocabulary_is_refused():
    llm = LLM(tiny_llama(seed=0), dtype="float32", device="cpu")
    with pytest.raises(QuickdraftError, match="logit_bias names token 99"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={99: 1.0}))

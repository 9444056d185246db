"""The `eagle` draft (drafts/eagle.py) and `quickdraft distill` (tools/distill.py) on tiny models: the target's
hidden states, greedy output equal to plain decoding (bf16 kernels, batched, with prefix caching), a head
trained in the test that agrees with the target far more than an untrained one, resuming, the lookup path,
and refusals. The sampled law of eagle is tested with the other drafts' in test_law.py."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from conftest import tiny_gemma16, tiny_llama16
from quickdraft import LLM, SamplingParams
from quickdraft.drafts import eagle
from quickdraft.errors import QuickdraftError
from quickdraft.tools import distill

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5, 1, 2], [7, 8, 9], [3, 3, 4, 10, 11, 12, 13, 14, 15]]


def _plain(make, dtype="bfloat16", **kwargs):
    """A plain LLM on a tiny model of 48 tokens with head_dim 16 (the smallest the bf16 CPU kernels take)."""
    return LLM(make(seed=0), dtype=dtype, speculative_config={"method": "none"}, **kwargs)


def _head_dir(llm, tmp_path, vocab_ids, seed=0):
    head = eagle.new_head(llm.target, torch.as_tensor(vocab_ids), seed)
    head.save(tmp_path / "head", {"test": True})
    return str(tmp_path / "head")


@pytest.mark.parametrize("make", [tiny_llama16, tiny_gemma16])
def test_hidden_states_are_the_final_norms_output(make):
    """forward_batch(return_hidden=True) gives each row's final-norm output (what the output layer reads): the
    transformers model's, and the same logits as without it; bitwise alike batched or alone (bf16 kernels)."""
    model = make(seed=0)
    llm = LLM(model, dtype="float32", speculative_config={"method": "none"})
    ids = torch.tensor([1, 5, 9, 2, 7])
    logits, hidden = llm.target.forward_batch([llm.target.new_cache()], [ids], [2], return_hidden=True)
    captured = []
    inner = model.model
    handle = inner.norm.register_forward_hook(lambda m, i, o: captured.append(o))
    with torch.no_grad():
        reference = model(input_ids=ids[None]).logits[0]
    handle.remove()
    torch.testing.assert_close(hidden, captured[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, reference[-2:].float(), atol=1e-3, rtol=1e-3)
    plain = llm.target.forward_batch([llm.target.new_cache()], [ids], [2])
    torch.testing.assert_close(plain, logits, atol=0, rtol=0)

    bf16 = _plain(make).target
    if not bf16.rows_invariant:
        pytest.skip("bf16 kernels not available on this CPU")
    alone = bf16.forward_batch([bf16.new_cache()], [ids], [1], return_hidden=True)[1]
    other = torch.tensor([4, 4, 2])
    together = bf16.forward_batch([bf16.new_cache(), bf16.new_cache()], [other, ids], [1, 1], return_hidden=True)[1]
    assert torch.equal(together[3:], alone)


@pytest.mark.parametrize("make", [tiny_llama16, tiny_gemma16, tiny_gemma3])
def test_greedy_eagle_equals_plain(make, tmp_path):
    """Greedy output with eagle drafts (a random head over a reduced vocabulary, K = 3, batched prompts, with and
    without the lookup path and with a repetition penalty) is plain greedy output token for token."""
    plain = _plain(make)
    head = _head_dir(plain, tmp_path, range(0, 32, 2))
    for lookup in (False, True):
        llm = plain.with_speculative_config({"method": "eagle", "model": head, "num_speculative_tokens": 3,
                                             "adaptive": False, "eagle_lookup": lookup})
        for params in (SamplingParams(temperature=0, max_tokens=24),
                       SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)):
            want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert sum(o.metrics.proposed_tokens for o in outs) > 0


@pytest.mark.parametrize("make", [tiny_llama16, tiny_gemma16])
def test_eagle_trees_equal_plain_output(make, tmp_path):
    """The head's EAGLE-2 trees (tree attention in the head's cache, each node fused with its parent's estimate):
    greedy and seeded output is plain decoding's token for token, batched, with trees verified."""
    plain = _plain(make)
    head = _head_dir(plain, tmp_path, range(0, 40))
    llm = plain.with_speculative_config({"method": "eagle", "model": head, "num_speculative_tokens": 4,
                                         "adaptive": False, "eagle_lookup": False,
                                         "tree": {"max_nodes": 10, "max_depth": 4}})
    for params in (SamplingParams(temperature=0, max_tokens=24),
                   SamplingParams(temperature=0.9, max_tokens=24, seed=5, presence_penalty=0.3)):
        want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.metrics.tree_steps > 0 for o in outs)


def test_prefix_cache_gaps_stay_exact(tmp_path):
    """A prompt whose prefix comes from the prefix cache has no target features there: the head reads zeros
    for those positions, and the output is still plain greedy output."""
    plain = _plain(tiny_llama16, enable_prefix_caching=True)
    if not plain.enable_prefix_caching:
        pytest.skip("prefix caching needs the bf16 kernels")
    llm = plain.with_speculative_config({"method": "eagle", "model": _head_dir(plain, tmp_path, range(48)),
                                         "num_speculative_tokens": 3, "adaptive": False})
    shared = list(range(1, 40))
    params = SamplingParams(temperature=0, max_tokens=20)
    first = llm.generate({"prompt_token_ids": shared + [5]}, params)[0]
    second = llm.generate({"prompt_token_ids": shared + [6]}, params)[0]
    assert second.metrics.num_cached_tokens >= 16
    for out, prompt in ((first, shared + [5]), (second, shared + [6])):
        assert out.outputs[0].token_ids == plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


def _tiny_data(llm, count=96, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(32) for _ in range(rng.randrange(2, 6))] for _ in range(count)]
    return [distill._generate_shard(llm, prompts[i:i + 48], (0.0, 1.0), 40) for i in range(0, count, 48)]


def test_a_head_trained_in_the_test_learns_the_target(tmp_path):
    """distill's data and training on a tiny target (seconds): on sequences it was not trained on, the trained
    head's first draft agrees with the target's greedy token far more often than an untrained head's; the
    written head loads and drafts with acceptance, greedy output stays plain output, and a rerun resumes from
    the checkpoint."""
    plain = LLM(tiny_llama(seed=0, vocab_size=32, layers=2), dtype="float32", speculative_config={"method": "none"})
    shards = _tiny_data(plain)
    vocab_ids = distill.reduced_vocab(shards, 32, 24, set())
    assert vocab_ids.numel() == 24 and torch.equal(vocab_ids, vocab_ids.sort().values)
    unseen = distill.examples(_tiny_data(plain, count=48, seed=1))
    embed = lambda ids: plain.target.embed_rows(ids).float()  # noqa: E731

    def autocast():
        return torch.autocast("cpu", enabled=False)

    def agreement(head):
        return distill.held_out_estimate(head, unseen, embed, torch.device("cpu"), autocast)["alpha1"]

    untrained = agreement(eagle.new_head(plain.target, vocab_ids))
    out, work = tmp_path / "head", tmp_path / "head" / "work"
    work.mkdir(parents=True)
    result = distill.train(plain, shards, vocab_ids, out, work, epochs=12, lr=5e-3, batch_tokens=1024, seed=0,
                           device=torch.device("cpu"), checkpoint_every=1000, recipe={"test": True})
    trained = agreement(eagle.load_head(out, plain.target))
    assert trained > untrained + 0.15 and trained > 0.2, (untrained, trained, result["history"][-1])
    assert eagle.read_head_config(out)["recipe"]["steps"] == result["steps"]

    again = distill.train(plain, shards, vocab_ids, out, work, epochs=12, lr=5e-3, batch_tokens=1024, seed=0,
                          device=torch.device("cpu"), checkpoint_every=1000, recipe={"test": True})
    assert again["steps"] == result["steps"] and again["history"] == result["history"]  # resumed: nothing left

    llm = plain.with_speculative_config({"method": "eagle", "model": str(out), "num_speculative_tokens": 3,
                                         "adaptive": False, "eagle_lookup": False})
    params = SamplingParams(temperature=0, max_tokens=30)
    prompts = [{"prompt_token_ids": p} for p in ([3, 1, 4], [2, 7, 1, 8])]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert sum(o.metrics.accepted_tokens for o in outs) > 0.12 * sum(o.metrics.proposed_tokens for o in outs)


def test_lookup_takes_a_confident_copy(tmp_path):
    """With eagle_lookup, a request whose text repeats is drafted by the suffix lookup where it has a confident
    match (the copy: a "lookup" step for adaptive K), and by the head otherwise (a "model" step)."""
    plain = _plain(tiny_llama16)
    llm = plain.with_speculative_config({"method": "eagle", "model": _head_dir(plain, tmp_path, range(48)),
                                         "num_speculative_tokens": 3, "adaptive": False})
    engine = llm.engine
    pattern = [11, 12, 13, 14, 15, 16, 17, 18]
    seq = engine.new_sequence(pattern * 3 + pattern[:4], SamplingParams(temperature=0, max_tokens=8))
    assert llm.proposer.draft_kind(seq) == "lookup"
    proposal = llm.proposer.propose(seq, 3)
    assert llm.proposer.forwards == 0  # no head forward: the lookup drafted
    assert proposal.tokens.tolist() == pattern[4:7] and proposal.probs is None
    other = engine.new_sequence([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=8))
    engine.step(other)  # the prompt (no draft), then a head draft: no text repeats
    assert llm.proposer.draft_kind(other) == "model"
    assert llm.proposer.propose(other, 3).tokens.numel() == 3 and llm.proposer.forwards == 3


def test_refusals(tmp_path):
    plain = _plain(tiny_llama16)
    with pytest.raises(QuickdraftError, match="no EAGLE head ships"):
        plain.with_speculative_config({"method": "eagle"})
    with pytest.raises(QuickdraftError, match="not an EAGLE head"):
        plain.with_speculative_config({"method": "eagle", "model": str(tmp_path)})
    other = _plain(tiny_gemma16)
    head = _head_dir(other, tmp_path, range(48))
    with pytest.raises(QuickdraftError, match="trained for a target"):
        plain.with_speculative_config({"method": "eagle", "model": head})
    with pytest.raises(QuickdraftError, match="eagle_lookup"):
        plain.with_speculative_config({"method": "eagle", "model": head, "eagle_lookup": "yes"})
    with pytest.raises(QuickdraftError, match="quantization applies"):
        plain.with_speculative_config({"method": "eagle", "quantization": "int8"})

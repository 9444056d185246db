"""The incremental cache after any sequence of appends and rollbacks equals a fresh full forward."""

import random

import pytest
import torch

from quickdraft.models.hf import HFRunner
from conftest import tiny_gemma3, tiny_llama


def _full_forward_logits(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def _check_random_appends_and_rollbacks(runner, vocab, steps, seed, atol):
    rng = random.Random(seed)
    cache = runner.new_cache()
    tokens = []
    for _ in range(steps):
        if tokens and rng.random() < 0.4:
            keep = rng.randrange(max(1, len(tokens) - 6), len(tokens) + 1)
            cache.rollback(keep)
            tokens = tokens[:keep]
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        logits = runner.forward(cache, torch.tensor(new), num_logits=len(new))
        tokens += new
        assert len(cache) == len(tokens) and cache.token_ids == tokens
        expected = _full_forward_logits(runner.model, tokens)[-len(new):]
        assert torch.allclose(logits, expected, atol=atol, rtol=0), (logits - expected).abs().max()


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_models(build, seed):
    model = build(seed=seed)
    # Gemma 3's sliding window is 4 here: rollbacks cross the window often.
    _check_random_appends_and_rollbacks(HFRunner(model), 32, steps=25, seed=seed, atol=1e-4)


def test_sync_rolls_back_to_common_prefix():
    runner = HFRunner(tiny_llama())
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor([1, 2, 3, 4, 5]))
    assert cache.sync([1, 2, 3, 9, 9, 9]) == 3 and cache.token_ids == [1, 2, 3]
    assert cache.sync([1, 2, 3]) == 3
    with pytest.raises(ValueError):
        cache.rollback(7)


def test_lengths_count_tokens_not_read_back_and_a_rollback_to_the_length_reads_nothing():
    """record keeps a forward's tokens on the device until they are read (token_ids); len counts them, and a
    rollback to the cache's own length (a plain step's) changes nothing and leaves them unread."""
    from quickdraft.cache import SequenceCache

    cache = SequenceCache()
    cache.record(torch.tensor([4, 5, 6]))
    cache.record(torch.tensor([[7]]))
    assert len(cache) == 4
    cache.rollback(4)
    assert len(cache._pending) == 2  # not read back
    assert cache.token_ids == [4, 5, 6, 7] and len(cache) == 4 and not cache._pending
    cache.record(torch.tensor([8, 9]))
    cache.rollback(5)
    assert cache.token_ids == [4, 5, 6, 7, 8] and len(cache) == 5
    with pytest.raises(ValueError):
        cache.rollback(6)


@pytest.mark.slow
def test_packaged_smollm2(smollm2):
    _check_random_appends_and_rollbacks(smollm2.target, smollm2.target.vocab_size, steps=8, seed=0, atol=2e-3)


@pytest.mark.slow
def test_packaged_gemma3(gemma3):
    _check_random_appends_and_rollbacks(gemma3.target, gemma3.target.vocab_size, steps=8, seed=0, atol=2e-3)

"""The CUDA runner's paged batch (models/cuda_runner.py over kv/paged.py) on the CPU, where it runs eagerly: every
sequence's logits in a batched step equal its logits stepped alone (float32) for plain rows, chains and token trees
together, after rollbacks and compactions; the graph key is the padded shape, not the caches; padded sequences and
rows write only the null block; steps that fit no bucket are counted; the pool's blocks are accounted after every
event (a failed step, a dropped cache, prefix blocks shared by reference)."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import recorded_graph_keys, tiny_gemma3, tiny_llama
from quickdraft.kv import KVPoolFull
from quickdraft.kv.paged import NULL_BLOCK
from quickdraft.models.base import TreeAttention
from quickdraft.models.cuda_runner import BATCH_BUCKETS, CudaRunner
from quickdraft.models.weights import DecoderWeights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def _close(got, expected):
    assert got.shape == expected.shape
    if expected.numel():
        torch.testing.assert_close(got, expected, atol=2e-5 * max(1.0, expected.abs().max().item()), rtol=1e-5)


def _runner(build=tiny_llama, **kwargs) -> CudaRunner:
    return CudaRunner(DecoderWeights(build(seed=0, **kwargs)))


# Steps of up to five sequences: (rollbacks {sequence: positions dropped} or compactions {sequence: kept tree
# nodes}, feeds [(sequence, rows, logits wanted, a tree's parents or None)]).
STEPS = [
    ({}, [(0, 9, 1, None), (1, 4, 4, None), (2, 6, 0, None), (3, 20, 1, None)]),
    ({}, [(0, 5, 5, [-1, 0, 0, 1, 2]), (1, 1, 1, None), (2, 3, 2, None), (3, 1, 1, None), (4, 3, 1, None)]),
    ({"compact": {0: [0, 1, 3]}, 2: 2}, [(0, 1, 1, None), (2, 5, 5, None), (4, 1, 1, None)]),
    ({1: 3}, [(1, 5, 5, None), (0, 4, 4, [-1, -1, 0, 2]), (2, 1, 1, None), (3, 5, 5, [-1, 0, 1, 2, 3])]),
    ({"compact": {0: [1, 3], 3: [0, 1]}, 1: 4}, [(i, 1, 1, None) for i in range(5)]),
    ({2: 1}, [(3, 5, 5, None), (0, 8, 8, [-1, 0, 1, 2, 0, 4, 0, 6]), (2, 2, 2, None), (4, 70, 1, None)]),
]


def _apply(caches, events, trees_of):
    for i, what in events.items():
        if i == "compact":
            for j, nodes in what.items():
                tree = trees_of[j]
                caches[j].compact(tree.base, [tree.base + node for node in nodes])
        else:
            caches[i].rollback(len(caches[i]) - what)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_every_sequences_logits_in_a_batch_equal_its_logits_alone(build):
    runner = _runner(build)
    batched = [runner.new_cache() for _ in range(5)]
    alone = [runner.new_cache() for _ in range(5)]
    generator = torch.Generator().manual_seed(3)
    trees_of = {}
    for events, feeds in STEPS:
        _apply(batched, events, trees_of)
        _apply(alone, events, trees_of)
        tokens = [torch.randint(0, 32, (n,), generator=generator) for _, n, _, _ in feeds]
        trees = [None if parents is None else TreeAttention.of_tree(len(batched[i]), parents)
                 for i, _, _, parents in feeds]
        trees_of = {i: tree for (i, _, _, _), tree in zip(feeds, trees) if tree is not None}
        got = runner.forward_batch([batched[i] for i, _, _, _ in feeds], tokens, [k for _, _, k, _ in feeds],
                                   trees=trees)
        row = 0
        for (i, _, k, _), ids, tree in zip(feeds, tokens, trees):
            expected = runner.forward_batch([alone[i]], [ids], [k], trees=[tree])
            _close(got[row: row + k], expected)
            row += k
        assert row == got.shape[0]
        runner.kv_pool.audit([c.seq for c in batched + alone])
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    for a, b in zip(batched, alone):
        _close(a.keys[:, :, :len(a)], b.keys[:, :, :len(b)])  # the same keys, in different blocks


def test_the_graph_key_is_the_padded_shape_not_the_caches():
    """Two different sets of sequences of the same bucketed shape make one key (one graph serves both); padding
    sequences and rows write only the null block."""
    runner = _runner()
    keys = recorded_graph_keys(runner)
    first, second = [runner.new_cache() for _ in range(3)], [runner.new_cache() for _ in range(3)]
    for caches in (first, second):
        runner.forward_batch(caches, [torch.arange(5), torch.arange(7), torch.arange(3)], [1, 1, 1])
        before = runner.kv_pool.kv.clone()
        runner.forward_batch(caches, [torch.tensor([1]), torch.arange(4), torch.tensor([2])], [1, 4, 1])
        changed = (runner.kv_pool.kv != before).flatten(2).any(-1).any(0).any(0).nonzero().flatten().tolist()
        used = {block for cache in caches for block in cache.seq.blocks}
        assert set(changed) <= used | {NULL_BLOCK}  # 3 sequences padded to 4, rows padded to 4
    assert keys[0] == keys[2] and keys[1] == keys[3] and keys[0] != keys[1]
    assert runner.eager_steps == 4 and runner.graph_replays == 0 and runner.unbucketed_steps == 0
    assert 3 not in BATCH_BUCKETS


def test_steps_that_fit_no_bucket_run_unpadded_and_are_counted():
    runner = _runner()
    prompt = runner.new_cache()
    runner.forward(prompt, torch.arange(70) % 32, 1)  # 70 rows: past the last row bucket
    assert runner.unbucketed_steps == 1
    many = [runner.new_cache() for _ in range(65)]  # 65 sequences: past the last batch bucket
    got = runner.forward_batch(many, [torch.tensor([i % 32]) for i in range(65)], [1] * 65)
    assert runner.unbucketed_steps == 2 and runner.eager_steps == 2 and got.shape == (65, 32)
    _close(got[7:8], runner.forward(runner.new_cache(), torch.tensor([7]), 1))
    runner.forward_batch(many[:64], [torch.tensor([1])] * 64, [1] * 64)  # 64: a bucket
    assert runner.unbucketed_steps == 2 and runner.eager_steps == 4
    assert runner.kv_pool_metrics()["unbucketed_steps"] == 2


def test_a_step_the_pool_cannot_hold_changes_nothing_and_dropped_caches_free_their_blocks():
    runner = _runner()
    runner.size_kv_pool(6 * runner.kv_pool.bytes_per_block)  # 5 blocks of 16 and the null block
    pool = runner.kv_pool
    assert pool.total_blocks == 5
    a, b = runner.new_cache(), runner.new_cache()
    runner.forward_batch([a, b], [torch.arange(20) % 32, torch.arange(30) % 32], [1, 1])  # 2 + 2 blocks
    assert pool.num_free_blocks == 1
    with pytest.raises(KVPoolFull):
        runner.forward_batch([a, b], [torch.arange(13) % 32, torch.arange(3)], [1, 1])  # a needs 1, b needs 1
    assert (len(a), len(b)) == (20, 30) and len(a.token_ids) == 20 and pool.num_free_blocks == 1
    pool.audit([a.seq, b.seq])
    a.rollback(5)
    assert pool.num_free_blocks == 2
    del a
    gc.collect()
    assert pool.num_free_blocks == 3  # the dropped cache's block came back
    b.release()
    assert pool.num_free_blocks == 5 and len(b) == 0
    pool.audit([])


def test_a_prompt_prefix_is_shared_by_reference_and_computes_the_same_logits():
    runner = _runner()
    pool = runner.kv_pool
    prompt = [int(t) for t in torch.randint(0, 32, (40,), generator=torch.Generator().manual_seed(5))]
    first = runner.new_cache()
    want = runner.forward(first, torch.tensor(prompt), 1)
    first.store_prefix()  # its 2 full blocks kept by their prefix
    used = pool.num_used_blocks
    second = runner.new_cache()
    assert second.load_prefix(prompt) == 32 and second.token_ids == prompt[:32]
    assert second.seq.blocks[:2] == first.seq.blocks[:2] and pool.num_used_blocks == used  # no new block
    got = runner.forward(second, torch.tensor(prompt[32:]), 1)  # only the rest is computed
    _close(got, want)
    assert pool.num_used_blocks == used + 1  # its own last block
    pool.audit([first.seq, second.seq])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_flex_attention_over_the_pool_equals_sdpa_over_gathered_blocks(build):
    """attention = "flex" (FlexAttention in place under the paged block mask; eager on the CPU) computes what the
    default SDPA over gathered blocks does, on steps mixing prompts, chains, a tree and plain rows."""
    sdpa, flex = _runner(build), _runner(build)
    flex.attention = "flex"
    generator = torch.Generator().manual_seed(4)
    caches = {runner: [runner.new_cache() for _ in range(3)] for runner in (sdpa, flex)}
    for feeds in ([(0, 9, 1, None), (1, 20, 2, None), (2, 3, 3, None)],
                  [(0, 5, 5, [-1, 0, 0, 1, 2]), (1, 1, 1, None), (2, 5, 5, None)]):
        tokens = [torch.randint(0, 32, (n,), generator=generator) for _, n, _, _ in feeds]
        got = []
        for runner in (sdpa, flex):
            own = caches[runner]
            trees = [None if parents is None else TreeAttention.of_tree(len(own[i]), parents)
                     for i, _, _, parents in feeds]
            got.append(runner.forward_batch([own[i] for i, _, _, _ in feeds], tokens, [k for _, _, k, _ in feeds],
                                            trees=trees))
        _close(got[1], got[0])

"""The CUDA runner's static-shape forward (models/cuda_runner.py) on the CPU, where it runs eagerly: the rows'
block tables, positions and trees travel as one device tensor, sequences and rows are padded to buckets and write
their padding to the paged pool's null block, attention is SDPA over each sequence's gathered blocks under a mask
built on the device. Checked against
the torch reference runner (models/torch_runner.py): the same logits to rounding for prefills, steps, rollbacks,
trees, batches, hidden states and input embeddings, and the engine's tokens, greedy and seeded. The graphs
themselves need a GPU: tests/test_cuda.py checks them there."""

from __future__ import annotations

import pytest
import torch

from conftest import recorded_graph_keys, tiny_gemma3, tiny_llama, tiny_llama16
from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.models import factory
from quickdraft.models.base import TreeAttention
from quickdraft.models.cpu_runner import CpuKernelRunner
from quickdraft.kv.paged import NULL_BLOCK
from quickdraft.kv.paged_cache import PagedSequenceCache
from quickdraft.models.cuda_runner import GRAPH_MAX_ROWS, CudaRunner, block_bucket, row_bucket
from quickdraft.models.torch_runner import TorchRunner
from quickdraft.models.weights import DecoderWeights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

# (rows, logits wanted, positions rolled back first): prefill, decoding steps, verifications, rejections.
STEPS = [(11, 1, 0), (1, 1, 0), (5, 5, 0), (3, 3, 2), (1, 1, 0), (7, 2, 3), (1, 1, 0)] * 3


def _close(got, expected):
    torch.testing.assert_close(got, expected, atol=1e-4 * max(1.0, expected.abs().max().item()), rtol=1e-4)


def _pair(build):
    """A reference runner and a static-path runner over the same weights."""
    weights = DecoderWeights(build(seed=0))
    return TorchRunner(weights), CudaRunner(weights)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_static_forward_equals_the_reference(build):
    reference, static = _pair(build)
    assert not static.capture_graphs  # on the CPU: eager, no graph
    a, b = reference.new_cache(), static.new_cache()
    generator = torch.Generator().manual_seed(0)
    for rows, wanted, dropped in STEPS + [(GRAPH_MAX_ROWS + 6, 3, 0)]:  # the last: more rows than a bucket
        if dropped:
            a.rollback(len(a) - dropped)
            b.rollback(len(b) - dropped)
        ids = torch.randint(0, 32, (rows,), generator=generator)
        expected, got = reference.forward(a, ids, wanted), static.forward(b, ids, wanted)
        assert got.shape == expected.shape == (wanted, 32)
        _close(got, expected)
        used = len(a)
        _close(b.keys[:, :, :used], a.keys[:, :, :used])  # the live slots hold the same keys and values
        _close(b.values[:, :, :used], a.values[:, :, :used])
    assert a.token_ids == b.token_ids and static.forwards == reference.forwards


def test_its_caches_are_paged_and_padded_rows_write_only_the_null_block():
    _, static = _pair(tiny_llama)
    cache = static.new_cache()
    assert isinstance(cache, PagedSequenceCache) and cache.pool is static.kv_pool
    pool = static.kv_pool
    assert torch.equal(pool.kv, torch.zeros_like(pool.kv))
    static.forward(cache, torch.arange(3), 1)  # 3 rows padded to 4: the fourth writes the null block
    assert row_bucket(3) == 4 and len(cache.seq.blocks) == 1
    block = cache.seq.blocks[0]
    assert pool.kv[:, :, block, :3].abs().sum() > 0 and pool.kv[:, :, block, 3:].abs().sum() == 0
    assert pool.kv[:, :, NULL_BLOCK].abs().sum() > 0  # the padded row's keys
    others = [b for b in range(1, pool.num_blocks) if b != block]
    assert pool.kv[:, :, others].abs().sum() == 0  # nothing else written
    with pytest.raises(QuickdraftError, match="caches its new_cache"):
        static.forward(TorchRunner(static.weights).new_cache(), torch.arange(3), 1)


def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 9, 13, 17, 33, 64, 65)] == [1, 2, 4, 8, 12, 16, 24, 48, 64, 65]
    assert block_bucket(1, 64) == block_bucket(8, 64) == 8 and block_bucket(9, 64) == 16
    assert block_bucket(20, 20) == 20  # within a context's blocks
    assert block_bucket(300, 1 << 20) == 320  # a quarter of 256: at most a quarter more keys than live


def _steps():
    """Batches of three sequences (feeds: (sequence, rows, logits wanted, a tree's parents or None)) with
    rollbacks before a step: prompts, decoding, chains, a tree, sequences sitting a step out."""
    return [
        ({}, [(0, 9, 1, None), (1, 4, 4, None), (2, 6, 0, None)]),
        ({1: 2}, [(0, 5, 5, [-1, 0, 0, 1, 2]), (1, 1, 1, None), (2, 3, 2, None)]),
        ({0: 5}, [(2, 1, 1, None), (0, 1, 1, None)]),
        ({}, [(1, 5, 5, None), (0, 4, 4, [-1, -1, 0, 2]), (2, 1, 1, None)]),
    ]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_a_batch_with_trees_equals_the_reference(build, hidden):
    """One static forward over several sequences (chains, trees, prompts; with hidden states and, for the
    hidden case, input embeddings in place of the tokens' as an EAGLE head gives them)."""
    reference, static = _pair(build)
    caches = {runner: [runner.new_cache() for _ in range(3)] for runner in (reference, static)}
    generator = torch.Generator().manual_seed(1)
    for rollbacks, feeds in _steps():
        tokens = [torch.randint(0, 32, (n,), generator=generator) for _, n, _, _ in feeds]
        embeds = [reference.embed_rows(ids) * 0.5 for ids in tokens] if hidden else None
        results = []
        for runner in (reference, static):
            own = caches[runner]
            for i, dropped in rollbacks.items():
                own[i].rollback(len(own[i]) - dropped)
            trees = [None if parents is None else TreeAttention.of_tree(len(own[i]), parents)
                     for i, _, _, parents in feeds]
            results.append(runner.forward_batch([own[i] for i, _, _, _ in feeds], tokens, [k for _, _, k, _ in feeds],
                                                inputs_embeds=embeds, return_hidden=hidden, trees=trees))
        if hidden:
            (a, a_hidden), (b, b_hidden) = results
            assert b_hidden.shape == a_hidden.shape and b_hidden.dtype == a_hidden.dtype
            _close(b_hidden, a_hidden)
        else:
            a, b = results
        assert a.shape == b.shape
        _close(b, a)
    assert [c.token_ids for c in caches[reference]] == [c.token_ids for c in caches[static]]


def test_a_decode_reuses_a_few_shapes():
    """What a graph is keyed by repeats: 100 decoding steps after a prompt, and K = 4 verifications between
    them, make a handful of shapes (a wider bucket of blocks starts new ones), so that on
    a GPU nearly every step replays a graph already captured."""
    _, static = _pair(tiny_llama)
    cache = static.new_cache()
    keys = recorded_graph_keys(static)
    static.forward(cache, torch.arange(20) % 32, 1)
    for step in range(100):
        static.forward(cache, torch.tensor([step % 32]), 1)
        if step % 10 == 0:
            static.forward(cache, torch.arange(5), 5)
            cache.rollback(len(cache) - 5)
    assert len(keys) == 111 and len(set(keys)) <= 8


@pytest.mark.parametrize("method", ["none", "draft_model", "ngram", "eagle-tree"])
def test_the_engine_on_the_static_path_decodes_as_the_reference(method, monkeypatch, tmp_path):
    """Greedy and seeded, one sequence at a time and two batched, every runner (target, draft model, EAGLE head:
    trees, hidden states, input embeddings) on the static path: the reference runner's tokens."""
    from quickdraft.drafts import eagle

    target = tiny_llama(seed=0)
    reference = LLM(target, dtype="float32", device="cpu", speculative_config={"method": "none"})
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model":
        config["model"] = tiny_llama(seed=1)
    if method == "eagle-tree":
        eagle.new_head(reference.target, torch.arange(32), 0).save(tmp_path / "head", {"test": True})
        config = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3,
                  "tree": {"max_nodes": 6, "max_depth": 3}, "adaptive": False, "eagle_lookup": False}
    reference = reference.with_speculative_config(config)
    assert isinstance(reference.target, TorchRunner)
    monkeypatch.setattr(factory, "backend_for", lambda weights: CudaRunner)
    static = LLM(target, dtype="float32", device="cpu", speculative_config=config)
    assert isinstance(static.target, CudaRunner)
    if method in ("draft_model", "eagle-tree"):
        assert isinstance(static.proposer.runner, CudaRunner)
    prompts = [{"prompt_token_ids": [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9]}, {"prompt_token_ids": [1, 2, 3]}]
    for params in (SamplingParams(temperature=0, max_tokens=32),
                   SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=3)):
        want = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
        for batch in (1, 2):
            static.max_num_seqs = batch
            out = static.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in out] == want, (params, batch)
            if method != "none":
                assert sum(o.metrics.proposed_tokens for o in out) > 0


def test_the_factory_picks_the_runner_by_device_dtype_and_kernels():
    assert type(factory.native_runner(tiny_llama(seed=0))) is TorchRunner  # float32
    bf16 = factory.native_runner(tiny_llama16(seed=0).to(torch.bfloat16))
    assert type(bf16) is (CpuKernelRunner if CpuKernelRunner.runs(bf16.weights) else TorchRunner)
    assert bf16.truncated(2).backend == bf16.backend and bf16.quantized("int8").backend == bf16.backend
    if torch.cuda.is_available():
        assert type(factory.native_runner(tiny_llama(seed=0).cuda())) is CudaRunner

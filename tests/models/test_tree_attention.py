"""Token-tree attention on the torch forwards (issue 25): every node of a tree, fed in one forward, gets the
logits of its path fed as a plain line; after SequenceCache.compact keeps the accepted path, the cache is that
line's cache. Checked on the transformers runner (a 4-D mask and position ids), on the torch reference runner
(float32) and on the CUDA runner's static path run eagerly (masks built from device tensors), for Llama, Mistral
(a window on every layer) and Gemma 3 (sliding and full layers), windows short enough that the deeper nodes lose
part of the prefix; then TreeAttention's checks and the compaction of each cache layout (transformers'
DynamicCache, the static cache plain and packed)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import _sharpen, tiny_gemma3, tiny_llama, tiny_llama16
from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import cpu_linear, pack
from quickdraft.kv.static_cache import StaticSequenceCache
from quickdraft.models.base import TreeAttention
from quickdraft.models.hf import HFRunner
from quickdraft.models.cuda_runner import CudaRunner
from quickdraft.models.factory import native_runner
from quickdraft.models.torch_runner import TorchRunner
from quickdraft.models.tree_mask import tree_positions, tree_visibility

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

WINDOW = 3  # well inside the paths checked: a node at depth 3 or more sees only part of the prefix
PREFIX = 7
TOLERANCE = dict(atol=2e-5, rtol=1e-5)  # float32; the tree's rows are rounded in other matmul shapes


def tiny_mistral(seed: int = 0, sliding_window: int = WINDOW):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                           sliding_window=sliding_window, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return _sharpen(MistralForCausalLM(config).eval())


MODELS = {"llama": tiny_llama, "mistral": tiny_mistral, "gemma3": lambda: tiny_gemma3(sliding_window=WINDOW)}
_built: dict = {}


def runner_of(kind: str, model_name: str):
    """hf: the transformers forward; native: the torch reference runner (float32); static: the CUDA runner's
    static-shape path, eagerly on the CPU (tree masks built from device tensors, rows padded to buckets)."""
    key = kind, model_name
    if key not in _built:
        model = MODELS[model_name]()
        _built[key] = {"hf": HFRunner, "native": TorchRunner.from_model, "static": CudaRunner.from_model}[kind](model)
    return _built[key]


def tree_forward(runner, cache, tokens: torch.Tensor, tree: TreeAttention | None) -> torch.Tensor:
    """All rows' logits [n, V] of appending `tokens` as `tree` says."""
    return runner.forward_batch([cache], [tokens], [tokens.shape[0]], trees=[tree])


def plain_logits(runner, tokens: list[int]) -> torch.Tensor:
    """Every row's logits of `tokens` fed as a line on a fresh cache, [len, V]."""
    return runner.forward(runner.new_cache(), torch.tensor(tokens), len(tokens))


def path_of(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def random_parents(size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(-1, i) for i in range(size)]


SHAPES = {
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1] * 5,
    "deep_wide": [-1, -1, 0, 0, 1, 2, 2, 5, 7, 7, 8, -1],
    "random": random_parents(14, seed=4),
}


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 32, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("kind", ["hf", "native", "static"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("with_root_row", [False, True])
def test_every_node_gets_the_logits_of_its_path_as_a_line(kind, model_name, shape, with_root_row):
    runner = runner_of(kind, model_name)
    parents = SHAPES[shape]
    prefix, nodes = _tokens(PREFIX, 1), _tokens(len(parents), 2)
    tree = TreeAttention.of_tree(PREFIX, parents)
    cache = runner.new_cache()
    # The prefix cached, then the tree; or the prefix but its last token, then that token (a causal row below
    # base) and the tree in one forward.
    cached = PREFIX - 1 if with_root_row else PREFIX
    runner.forward(cache, torch.tensor(prefix[:cached]), 1)
    logits = tree_forward(runner, cache, torch.tensor(prefix[cached:] + nodes), tree)
    assert len(cache) == PREFIX + len(parents)
    assert cache.token_ids == prefix + nodes
    if with_root_row:
        torch.testing.assert_close(logits[0], plain_logits(runner, prefix)[-1], **TOLERANCE)
        logits = logits[1:]
    for node in range(len(parents)):
        line = prefix + [nodes[i] for i in path_of(parents, node)]
        torch.testing.assert_close(logits[node], plain_logits(runner, line)[-1], **TOLERANCE,
                                   msg=lambda m, node=node: f"node {node} of {shape}: {m}")


@pytest.mark.parametrize("model_name", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["hf", "native", "static"])
def test_a_tree_grown_in_two_calls_equals_its_paths_then_compacts_to_the_accepted_line(kind, model_name):
    runner = runner_of(kind, model_name)
    parents = SHAPES["deep_wide"]
    grown = 5  # the first call's nodes; the second call's parents point at them
    assert any(0 <= p < grown for p in parents[grown:])
    prefix, nodes = _tokens(PREFIX, 3), _tokens(len(parents), 4)
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor(prefix), 1)
    first = tree_forward(runner, cache, torch.tensor(nodes[:grown]), TreeAttention.of_tree(PREFIX, parents[:grown]))
    second = tree_forward(runner, cache, torch.tensor(nodes[grown:]), TreeAttention.of_tree(PREFIX, parents))
    for node, row in enumerate(torch.cat([first, second])):
        line = prefix + [nodes[i] for i in path_of(parents, node)]
        torch.testing.assert_close(row, plain_logits(runner, line)[-1], **TOLERANCE)

    # Accept the path to the deepest node, then decode two more tokens: the logits of the line's cache.
    path = path_of(parents, 10)
    assert path != list(range(len(path)))  # slots move
    cache.compact(PREFIX, [PREFIX + i for i in path])
    line = prefix + [nodes[i] for i in path]
    assert cache.token_ids == line and len(cache) == len(line)
    after = _tokens(2, 5)
    logits = runner.forward(cache, torch.tensor(after), 2)
    torch.testing.assert_close(logits, plain_logits(runner, line + after)[-2:], **TOLERANCE)


@pytest.mark.parametrize("kind", ["hf", "native", "static"])
@pytest.mark.parametrize("kept", [[], [0], [0, 1, 2]], ids=["nothing", "first", "chain"])
def test_compacting_to_a_prefix_of_the_slots_is_a_rollback(kind, kept):
    runner = runner_of(kind, "mistral")
    parents = SHAPES["chain"]
    prefix, nodes = _tokens(PREFIX, 6), _tokens(len(parents), 7)
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor(prefix), 1)
    tree_forward(runner, cache, torch.tensor(nodes), TreeAttention.of_tree(PREFIX, parents))
    cache.compact(PREFIX, [PREFIX + i for i in kept])
    line = prefix + [nodes[i] for i in kept]
    assert cache.token_ids == line
    after = _tokens(3, 8)
    torch.testing.assert_close(runner.forward(cache, torch.tensor(after), 3),
                               plain_logits(runner, line + after)[-3:], **TOLERANCE)


@pytest.mark.parametrize("kind", ["hf", "native", "static"])
def test_a_batch_of_a_tree_and_a_line_gives_each_its_own_logits(kind):
    runner = runner_of(kind, "gemma3")
    parents = SHAPES["random"]
    prefix, nodes, other = _tokens(PREFIX, 9), _tokens(len(parents), 10), _tokens(9, 11)
    tree_cache, line_cache = runner.new_cache(), runner.new_cache()
    runner.forward(tree_cache, torch.tensor(prefix), 1)
    runner.forward(line_cache, torch.tensor(other[:5]), 1)
    trees = [TreeAttention.of_tree(PREFIX, parents), None]
    logits = runner.forward_batch([tree_cache, line_cache], [torch.tensor(nodes), torch.tensor(other[5:])],
                                  [len(nodes), 4], trees=trees)
    for node in range(len(parents)):
        line = prefix + [nodes[i] for i in path_of(parents, node)]
        torch.testing.assert_close(logits[node], plain_logits(runner, line)[-1], **TOLERANCE)
    torch.testing.assert_close(logits[len(nodes):], plain_logits(runner, other)[-4:], **TOLERANCE)


def test_the_window_matters_on_the_paths_checked():
    """Without this the tests above would pass with the window ignored: a path's last logits differ between
    the windowed Gemma 3 and the same weights without a window."""
    windowed, full = HFRunner(tiny_gemma3(sliding_window=WINDOW)), HFRunner(tiny_gemma3(sliding_window=256))
    line = _tokens(PREFIX, 1) + _tokens(4, 2)
    assert not torch.allclose(plain_logits(windowed, line)[-1], plain_logits(full, line)[-1], atol=1e-3)


def test_transformers_runner_refuses_a_tree_that_does_not_fit_the_call():
    runner = runner_of("hf", "llama")
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor(_tokens(PREFIX, 1)), 1)
    with pytest.raises(QuickdraftError, match=r"len\(cache\) \+ n = 10"):  # 3 rows, a tree of 2 slots
        runner.forward_batch([cache], [torch.tensor([1, 2, 3])], [3], trees=[TreeAttention(PREFIX, (6, 7))])
    with pytest.raises(QuickdraftError, match="one tree"):
        runner.forward_batch([cache], [torch.tensor([1, 2])], [2], trees=[None, None])
    with pytest.raises(QuickdraftError, match="TreeAttention or None"):
        runner.forward_batch([cache], [torch.tensor([1, 2])], [2], trees=[(6, 7)])
    assert len(cache) == PREFIX  # nothing appended by a refused call


def test_transformers_runner_refuses_trees_where_it_cannot_tell_which_layers_slide():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
                        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    runner = HFRunner(Phi3ForCausalLM(config).eval())
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor([1, 2, 3]), 1)
    with pytest.raises(QuickdraftError, match="sliding_window=4"):
        runner.forward_batch([cache], [torch.tensor([4])], [1], trees=[TreeAttention(3, (2,))])
    assert len(cache) == 3


def test_transformers_runner_takes_trees_of_a_model_without_windows_outside_the_native_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = _sharpen(GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                bos_token_id=None, eos_token_id=None)).eval())
    runner = HFRunner(model)
    parents = SHAPES["deep_wide"]
    prefix, nodes = _tokens(PREFIX, 12), _tokens(len(parents), 13)
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor(prefix), 1)
    logits = tree_forward(runner, cache, torch.tensor(nodes), TreeAttention.of_tree(PREFIX, parents))
    for node in range(len(parents)):
        line = prefix + [nodes[i] for i in path_of(parents, node)]
        torch.testing.assert_close(logits[node], plain_logits(runner, line)[-1], **TOLERANCE)


# --- TreeAttention and the masks built from it ---------------------------------------------------------------

def test_tree_attention_checks_its_slots():
    with pytest.raises(ValueError, match="base 0"):
        TreeAttention(0, (-1,))
    with pytest.raises(ValueError, match="slot 5 has parent 5"):  # itself
        TreeAttention(4, (3, 5))
    with pytest.raises(ValueError, match="slot 5 has parent 6"):  # a later slot
        TreeAttention(4, (3, 6, 4))
    with pytest.raises(ValueError, match="slot 4 has parent 2"):  # inside the prefix but not its last token
        TreeAttention(4, (2,))
    with pytest.raises(ValueError, match="slot 4 has parent 4"):
        TreeAttention.of_tree(4, [0])  # node 0 as its own parent
    tree = TreeAttention.of_tree(4, [-1, 0, -1, 1])
    assert tree.parents == (3, 4, 3, 5) and tree.end == 8
    assert tree.depths() == [1, 2, 1, 3]
    assert tree.positions(2, 6) == [2, 3, 4, 5, 4, 6]
    assert tree.visible(7) == [0, 1, 2, 3, 4, 5, 7] and tree.visible(6) == [0, 1, 2, 3, 6]
    assert tree.visible(2) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(6))
def test_tree_visibility_is_what_tree_attention_says(seed):
    rng = random.Random(seed)
    base = rng.randrange(1, 6)
    tree = TreeAttention.of_tree(base, random_parents(rng.randrange(0, 12), seed))
    positions = tree.positions(0, tree.end)
    assert tree_positions(tree).tolist() == positions
    for start in range(max(0, base - 2), tree.end):
        for window in (None, 1, 2, 4):
            allowed = tree_visibility(tree, start, window)
            assert allowed.shape == (tree.end - start, tree.end)
            for row, slot in enumerate(range(start, tree.end)):
                seen = [s for s in tree.visible(slot)
                        if window is None or positions[s] > positions[slot] - window]
                assert allowed[row].nonzero().flatten().tolist() == seen


# --- compaction of each cache layout -------------------------------------------------------------------------

FIRST, KEPT = 5, [6, 9, 10]  # keep [0, 5), move slots 6, 9, 10 to 5, 6, 7
ORDER = list(range(FIRST)) + KEPT  # the slot each slot's contents come from


def test_compact_moves_dynamic_cache_slots():
    runner = runner_of("hf", "llama")
    cache = runner.new_cache()
    ids = _tokens(12, 14)
    runner.forward(cache, torch.tensor(ids), 1)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.kv.layers]
    cache.compact(FIRST, KEPT)  # outside inference mode, as the engine calls it
    order = ORDER
    assert len(cache) == len(order) and cache.kv.get_seq_length() == len(order)
    assert cache.token_ids == [ids[i] for i in order]
    for layer, (keys, values) in zip(cache.kv.layers, before):
        assert torch.equal(layer.keys, keys[:, :, order]) and torch.equal(layer.values, values[:, :, order])


def test_compact_moves_static_cache_slots():
    runner = runner_of("native", "llama")
    cache = runner.new_cache()
    ids = _tokens(12, 15)
    runner.forward(cache, torch.tensor(ids), 1)
    keys, values = cache.keys.clone(), cache.values.clone()
    cache.compact(FIRST, KEPT)
    order = ORDER
    assert len(cache) == len(order) and cache.token_ids == [ids[i] for i in order]
    used = len(order)
    assert torch.equal(cache.keys[:, :, :used], keys[:, :, order])
    assert torch.equal(cache.values[:, :, :used], values[:, :, order])


def _unpack_keys(keys: torch.Tensor) -> torch.Tensor:
    """[layers, heads, capacity/16, head_dim/2, 16, 2] (kernels.pack's layout per head) -> [.., capacity, head_dim]."""
    layers, heads, blocks, half, _, _ = keys.shape
    return keys.permute(0, 1, 2, 4, 3, 5).reshape(layers, heads, blocks * 16, half * 2)


class _PackedKeysRunner:
    """What StaticSequenceCache reads of a runner, with the CPU kernels' packed key layout."""

    num_layers, num_kv_heads, head_dim, max_len = 2, 2, 8, 64
    dtype, key_dtype, device, packed_keys = torch.float32, torch.float32, torch.device("cpu"), True


def test_compact_moves_packed_keys_across_blocks():
    cache = StaticSequenceCache(_PackedKeysRunner())
    length = 40  # three blocks of 16 positions; the moves cross from the third block into the first
    cache.reserve(length)
    logical = torch.randn(2, 2, cache.capacity, 8)
    with torch.inference_mode():
        cache.keys.copy_(torch.stack([torch.stack([pack(logical[l, h]) for h in range(2)]) for l in range(2)]))
        cache.values.copy_(logical * 2)
    assert torch.equal(_unpack_keys(cache.keys), logical)  # the layout as kernels.pack writes it
    cache.record(torch.arange(length))
    cache.block_digests = [b"0", b"1"]
    first, kept = 14, [15, 17, 33, 39]
    cache.compact(first, kept)
    order = list(range(first)) + kept
    assert cache.token_ids == order and len(cache) == len(order)
    assert torch.equal(_unpack_keys(cache.keys)[:, :, :len(order)], logical[:, :, order])
    assert torch.equal(cache.values[:, :, :len(order)], 2 * logical[:, :, order])
    assert cache.block_digests == []  # block 0 holds slot 14 on: its digest is stale


@pytest.mark.skipif(cpu_linear() is None, reason="quickdraft's CPU kernels need AVX512-BF16")
def test_compact_moves_keys_the_kernels_packed():
    runner = native_runner(tiny_llama16().to(torch.bfloat16))
    assert runner.packed_keys
    cache = runner.new_cache()
    ids = torch.randint(0, 48, (36,), generator=torch.Generator().manual_seed(16)).tolist()
    runner.forward(cache, torch.tensor(ids), 1)
    keys, values = _unpack_keys(cache.keys).clone(), cache.values.clone()
    first, kept = 3, [4, 20, 35]
    cache.compact(first, kept)
    order = list(range(first)) + kept
    assert cache.token_ids == [ids[i] for i in order]
    assert torch.equal(_unpack_keys(cache.keys)[:, :, :len(order)], keys[:, :, order])
    assert torch.equal(cache.values[:, :, :len(order)], values[:, :, order])


@pytest.mark.parametrize("first,kept", [(3, [5, 4]), (3, [2]), (3, [12]), (13, []), (-1, []), (3, [4, 4])])
def test_compact_refuses_slots_outside_the_cache_or_out_of_order(first, kept):
    cache = SequenceCache()
    cache.record(torch.arange(12))
    with pytest.raises(ValueError, match="compact"):
        cache.compact(first, kept)
    assert cache.token_ids == list(range(12))

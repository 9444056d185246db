"""Token trees on the native runner's CPU kernels: a tree node's logits and cached keys are bitwise those of its
path's tokens fed in a line (models.base.TreeAttention; kernels/cpu_attention.cpp), and compaction keeps them."""

import pytest
import torch

from conftest import gguf_blocks_of, tiny_gemma16, tiny_llama16, tiny_qwen2
from quickdraft.kernels import cpu_linear
from quickdraft.models.base import TreeAttention
from quickdraft.models.factory import native_runner
from quickdraft.token_tree import TokenTree

BUILDS = {"llama16": tiny_llama16, "gemma16": tiny_gemma16, "qwen2": tiny_qwen2,
          "gemma16-gguf": tiny_gemma16}  # on GGUF blocks: a float32 stream, float16 keys
needs_kernels = pytest.mark.skipif(cpu_linear() is None, reason="the CPU kernels need AVX512-BF16")

# (parents of the nodes, -1: a child of the root): a chain, a star, a wide-and-deep tree.
SHAPES = {
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1, -1, -1, -1],
    "tree": [-1, -1, 0, 0, 1, 2, 2, 4, 5, 7, 3, 10, 11],
}


def _runner(name):
    model = BUILDS[name]().to(torch.bfloat16)
    weights = gguf_blocks_of(model) if name.endswith("-gguf") else None
    return native_runner(model, quantized=weights), model.config.vocab_size


def _line(runner, prefix, path_tokens):
    """The logits after each token of prefix + path fed in a line, from the last prefix token on."""
    cache = runner.new_cache()
    runner.forward(cache, prefix[:-1], 1)
    return cache, runner.forward(cache, torch.cat([prefix[-1:], path_tokens]), 1 + len(path_tokens))


@needs_kernels
@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tree_rows_equal_their_paths_in_a_line_bitwise(name, shape):
    runner, vocab = _runner(name)
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, vocab, (21,), generator=gen)
    parents = SHAPES[shape]
    tokens = torch.randint(0, vocab, (len(parents),), generator=gen)
    tree = TokenTree.from_parents(tokens, parents)
    cache = runner.new_cache()
    runner.forward(cache, prefix[:-1], 1)
    base = len(prefix)  # the root (the prefix's last token) is fed with the nodes, at slot base - 1
    logits = runner.forward_batch([cache], [torch.cat([prefix[-1:], tokens])], [len(parents) + 1],
                                  trees=[TreeAttention.of_tree(base, parents)])
    for node in range(len(parents)):
        path = tree.path_to(node)
        _, line = _line(runner, prefix, tokens[path])
        assert torch.equal(logits[0], line[0])  # the root's row
        assert torch.equal(logits[node + 1], line[-1]), f"node {node} (path {path})"


@needs_kernels
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_compacted_tree_cache_continues_as_the_line(name):
    runner, vocab = _runner(name)
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, vocab, (30,), generator=gen)
    parents = SHAPES["tree"]
    tokens = torch.randint(0, vocab, (len(parents),), generator=gen)
    tree = TokenTree.from_parents(tokens, parents)
    for accepted_node in (-1, 1, 9, 12):  # none accepted, a depth-2 path, the deepest paths
        path = tree.path_to(accepted_node)
        cache = runner.new_cache()
        runner.forward(cache, prefix[:-1], 1)
        base = len(prefix)
        runner.forward_batch([cache], [torch.cat([prefix[-1:], tokens])], [1],
                             trees=[TreeAttention.of_tree(base, parents)])
        cache.compact(base, [base + node for node in path])
        assert len(cache) == base + len(path)
        assert cache.token_ids == prefix.tolist() + tokens[path].tolist()
        follow = torch.randint(0, vocab, (3,), generator=gen)
        after = runner.forward(cache, follow, 3)
        line_cache, _ = _line(runner, prefix, tokens[path])
        assert torch.equal(after, runner.forward(line_cache, follow, 3)), f"accepted path {path}"


@needs_kernels
def test_tree_grown_over_two_calls_and_batched_with_a_line():
    """A draft grows its tree level by level: the second call's parents cover the first call's tree slots. In the
    same forward another sequence's causal rows are unaffected."""
    runner, vocab = _runner("llama16")
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, vocab, (18,), generator=gen)
    other = torch.randint(0, vocab, (9,), generator=gen)
    parents = [-1, -1, 0, 1, 1, 2]
    tokens = torch.randint(0, vocab, (6,), generator=gen)
    tree = TokenTree.from_parents(tokens, parents)
    cache = runner.new_cache()
    runner.forward(cache, prefix, 1)
    base = len(prefix)
    full = TreeAttention.of_tree(base, parents)
    first = runner.forward_batch([cache], [tokens[:2]], [2], trees=[TreeAttention(base, full.parents[:2])])
    other_cache = runner.new_cache()
    second = runner.forward_batch([cache, other_cache], [tokens[2:], other], [4, 2], trees=[full, None])
    alone = runner.forward(runner.new_cache(), other, 2)
    assert torch.equal(second[4:], alone)
    rows = torch.cat([first, second[:4]])  # node i's row
    for node in range(6):
        _, line = _line(runner, prefix, tokens[tree.path_to(node)])
        assert torch.equal(rows[node], line[-1]), f"node {node}"


def test_tree_attention_is_checked():
    with pytest.raises(ValueError, match="parent"):
        TreeAttention(5, (4, 7))
    with pytest.raises(ValueError, match="base"):
        TreeAttention(0, ())
    tree = TreeAttention.of_tree(10, [-1, 0, -1, 2])
    assert tree.parents == (9, 10, 9, 12)
    assert tree.positions(8, 6) == [8, 9, 10, 11, 10, 11]
    assert tree.visible(13) == list(range(10)) + [12, 13]

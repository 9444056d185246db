"""Batched attention over a paged KV pool (quickdraft/models/paged_attention.py): one call per layer for a ragged
batch of plain rows, chains, prompts and token trees, every sequence's output equal to its batch-1 reference
(the sequence's keys and values in a line, visibility by models/tree_mask.tree_visibility, the convention of the
per-sequence forwards) in float32, with shared prefix blocks, copies on write, rollbacks and compactions in the
sequences' histories, GQA, sliding windows and padded (bucketed) sizes; SDPA over gathered blocks and
FlexAttention with a paged block mask alike. The step's tensors are built with no host read (checked on the meta
device, where any read of a value fails)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from quickdraft.kv.paged import PagedKVPool, PagedSequence
from quickdraft.models.base import TreeAttention
from quickdraft.models.paged_attention import (PagedStep, compiled_flex_attention, flex_paged_attention,
                                               paged_attention, tree_ancestors, write_kv)
from quickdraft.models.tree_mask import tree_visibility

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see conftest.one_thread

BS = 4
D = 8


def _reference(q, keys, values, start, tree, scale, window):
    """Batch-1 attention of one sequence's rows q [n, Hq, d] at slots start.. over its keys/values [end, Hkv, d]
    in a line: plain softmax(q k^T) v under tree_visibility, each kv head repeated for its query heads."""
    end = keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    seen = tree_visibility(tree if tree is not None else TreeAttention(end, ()), start, window)  # [n, end]
    k = keys.repeat_interleave(group, 1).transpose(0, 1)  # [Hq, end, d]
    v = values.repeat_interleave(group, 1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale
    return (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1)


class _Batch:
    """A pool with sequences, each with its keys and values per layer kept in a line beside the pool (what a
    batch-1 forward would hold), for the reference."""

    def __init__(self, layers=2, kv_heads=2, heads=4, num_blocks=48, seed=0):
        self.pool = PagedKVPool(layers, kv_heads, D, num_blocks, BS, dtype=torch.float32)
        self.heads, self.kv_heads = heads, kv_heads
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.lines: dict[int, list[torch.Tensor]] = {}  # id(seq) -> per layer [length, 2, Hkv, d]

    def _rows(self, n):
        return torch.randn(self.pool.num_layers, n, 2, self.kv_heads, D, generator=self.gen)

    def prompt(self, seq: PagedSequence, tokens: list[int], shared_from: PagedSequence | None = None) -> int:
        """Admit tokens (sharing kept blocks), write the rest directly (a prefill done elsewhere), commit."""
        hit = self.pool.match_prefix(seq, tokens)
        if hit:  # the shared slots hold what the first sequence wrote
            self.lines[id(seq)] = [line[:hit].clone() for line in self.lines[id(shared_from)]]
        else:
            self.lines[id(seq)] = [torch.zeros(0, 2, self.kv_heads, D)] * self.pool.num_layers
        slots = torch.tensor(self.pool.append_slots(seq, len(tokens) - hit))
        new = self._rows(len(tokens) - hit)
        for layer in range(self.pool.num_layers):
            write_kv(*self.pool.layer(layer), new[layer, :, 0], new[layer, :, 1], slots)
            self.lines[id(seq)][layer] = torch.cat([self.lines[id(seq)][layer], new[layer]])
        self.pool.commit(seq, tokens[hit:])
        return hit

    def fork(self, seq):
        child = self.pool.fork(seq)
        self.lines[id(child)] = [line.clone() for line in self.lines[id(seq)]]
        return child

    def rollback(self, seq, length):
        self.pool.rollback(seq, length)
        self.lines[id(seq)] = [line[:length] for line in self.lines[id(seq)]]

    def compact(self, seq, first, kept):
        self.pool.compact(seq, first, kept)
        self.lines[id(seq)] = [torch.cat([line[:first], line[kept]]) for line in self.lines[id(seq)]]

    def step(self, seqs, counts, trees, batch, rows, max_blocks, tree_size, windows=(None, 3), flex=True,
             scale=None):
        """One batched step: append the rows' slots, write their keys and values through the step's slot mapping,
        attend in one call per layer (and window); returns the largest difference from the references."""
        pool = self.pool
        starts = [seq.length for seq in seqs]
        for seq, count in zip(seqs, counts):
            pool.append_slots(seq, count)
        step = PagedStep.pack([seq.blocks for seq in seqs], starts, counts, trees, batch, rows, max_blocks,
                              tree_size, BS)
        scale = scale or 1 / math.sqrt(D)
        worst = 0.0
        for layer in range(pool.num_layers):
            new = torch.randn(batch, rows, 2, self.kv_heads, D, generator=self.gen)
            write_kv(*pool.layer(layer), new[:, :, 0].reshape(-1, self.kv_heads, D),
                     new[:, :, 1].reshape(-1, self.kv_heads, D), step.slot_mapping())
            for i, (seq, count) in enumerate(zip(seqs, counts)):
                self.lines[id(seq)][layer] = torch.cat([self.lines[id(seq)][layer], new[i, :count]])
            q = torch.randn(batch, rows, self.heads, D, generator=self.gen)
            for window in windows:
                outs = [paged_attention(q, *pool.layer(layer), step.block_tables,
                                        step.mask(window, self.heads // self.kv_heads), scale)]
                if flex:
                    outs.append(flex_paged_attention(q, *pool.layer(layer), step.block_mask(pool.num_blocks, window),
                                                     scale))
                for out in outs:
                    assert out.shape == q.shape and torch.isfinite(out).all()  # padded rows included
                for i, (seq, count, start, tree) in enumerate(zip(seqs, counts, starts, trees)):
                    line = self.lines[id(seq)][layer]
                    expected = _reference(q[i, :count], line[:, 0], line[:, 1], start, tree, scale, window)
                    for out in outs:
                        torch.testing.assert_close(out[i, :count], expected, rtol=1e-5, atol=1e-5)
                        worst = max(worst, float((out[i, :count] - expected).abs().max()))
        return worst


def _tokens(rng, n):
    return [rng.randrange(50) for _ in range(n)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_plain_chain_prompt_and_tree_rows_in_one_call_equal_their_batch_1_references(heads, kv_heads):
    batch = _Batch(kv_heads=kv_heads, heads=heads)
    rng = batch.rng
    shared = _tokens(rng, 9)
    a, b, c, d, e = (batch.pool.new_sequence() for _ in range(5))
    batch.prompt(a, shared + _tokens(rng, 3))
    assert batch.prompt(b, shared[:8] + _tokens(rng, 2), shared_from=a) == 8  # two blocks shared
    batch.prompt(c, _tokens(rng, 6))
    batch.prompt(d, _tokens(rng, 1))
    # e: rows below the tree's base (plain tokens appended in the same call), then a tree
    batch.prompt(e, _tokens(rng, 5))
    tree_c = TreeAttention.of_tree(6, [-1, -1, 0, 0, 2, 4])  # c: 6 tree nodes hanging off slot 5
    tree_e = TreeAttention(7, (6, 7, 6, 8))  # e: slots 5, 6 causal, then 4 tree slots from 7
    counts = [1, 5, 6, 7, 6]  # a: plain decoding, b: a K = 4 chain, c: tree, d: a prompt's rows, e: mixed
    worst = batch.step([a, b, c, d, e], counts, [None, None, tree_c, None, tree_e], batch=8, rows=8,
                       max_blocks=5, tree_size=8)
    assert worst < 1e-5
    assert batch.pool.ref_counts[a.blocks[0]] == 2  # the shared prefix is still one block, read by a and b


def test_histories_with_copy_on_write_rollback_compaction_and_growing_trees():
    batch = _Batch(seed=1)
    rng = batch.rng
    a, b = batch.pool.new_sequence(), batch.pool.new_sequence()
    batch.prompt(a, _tokens(rng, 7))
    batch.prompt(b, _tokens(rng, 5))
    fork = batch.fork(a)  # shares a's partial last block: the step's write into it copies it
    # step 1: a verifies a chain, fork decodes, b a tree
    tree_b = TreeAttention.of_tree(5, [-1, 0, 0, 1, -1])
    batch.step([a, fork, b], [5, 1, 5], [None, None, tree_b], batch=4, rows=8, max_blocks=4, tree_size=8)
    assert batch.pool.copies_on_write == 1
    batch.rollback(a, 9)  # two of the four drafts accepted: the stale slots stay in the pool, masked
    batch.compact(b, 5, [6, 8])  # the path 0 -> 1 -> 3 (slots 5, 6, 8) accepted
    assert b.length == 7
    # step 2: a's next chain overwrites its stale slots; b grows a tree over two calls (a draft's levels)
    first_level = TreeAttention(7, (6, 6))
    batch.step([a, fork, b], [3, 2, 2], [None, None, first_level], batch=4, rows=4, max_blocks=4, tree_size=4)
    second_level = TreeAttention(7, (6, 6, 7, 8, 7))  # slots 9..11 under slots 7 and 8, cached before
    batch.step([b, a], [3, 1], [second_level, None], batch=2, rows=4, max_blocks=4, tree_size=8)


def test_padded_buckets_do_not_change_the_real_rows():
    outs = []
    for batch_size, rows, max_blocks, tree_size in ((3, 4, 3, 4), (8, 16, 7, 16)):
        batch = _Batch(seed=2)
        seqs = [batch.pool.new_sequence() for _ in range(3)]
        for seq, n in zip(seqs, (9, 3, 6)):
            batch.prompt(seq, _tokens(batch.rng, n))
        pool, gen = batch.pool, torch.Generator().manual_seed(5)
        counts, trees = [1, 4, 3], [None, TreeAttention(3, (2, 3, 3, 4)), None]
        starts = [seq.length for seq in seqs]
        for seq, count in zip(seqs, counts):
            pool.append_slots(seq, count)
        step = PagedStep.pack([s.blocks for s in seqs], starts, counts, trees, batch_size, rows, max_blocks,
                              tree_size, BS)
        q = torch.zeros(batch_size, rows, 4, D)
        q[:3, :4] = torch.randn(3, 4, 4, D, generator=gen)
        out = paged_attention(q, *pool.layer(0), step.block_tables, step.mask(None, 2), 0.3)
        outs.append([out[i, :n] for i, n in enumerate(counts)])
    for small, large in zip(*outs):
        torch.testing.assert_close(small, large, rtol=1e-6, atol=1e-6)


def test_slot_mapping_positions_and_padding():
    pool = PagedKVPool(1, 1, D, 16, BS)
    a, b = pool.new_sequence(), pool.new_sequence()
    pool.append_slots(a, 6)
    pool.append_slots(b, 6)
    tree = TreeAttention(3, (2, 2, 4))  # slots 3, 4, 5 at depths 1, 1, 2: positions 3, 3, 4
    step = PagedStep.pack([a.blocks, b.blocks], [5, 3], [1, 3], [None, tree], batch=3, rows=4, max_blocks=2,
                          tree_size=4, block_size=BS)
    assert step.slot_mapping().view(3, 4).tolist() == [
        [a.blocks[1] * BS + 1, 0, 0, 0],
        [b.blocks[0] * BS + 3, b.blocks[1] * BS, b.blocks[1] * BS + 1, 0],
        [0, 0, 0, 0]]  # padded rows write the null block's slot 0
    assert step.positions.tolist() == [[5, 0, 0, 0], [3, 3, 4, 0], [0, 0, 0, 0]]
    mask = step.mask()[1, 0, :3]  # b's rows over its 8 logical slots
    assert mask[:, :6].tolist() == tree_visibility(tree, 3).tolist() and not mask[:, 6:].any()
    assert step.mask(window=2)[1, 0, :3, :6].tolist() == tree_visibility(tree, 3, window=2).tolist()
    padded = step.mask()[2, 0]  # a padding sequence: each row sees logical slot 0 only (finite, so no NaN)
    assert padded[:, 0].all() and not padded[:, 1:].any()
    assert step.mask()[0, 0, 1:, 0].all() and not step.mask()[0, 0, 1:, 1:].any()  # a's padded rows alike


def test_a_flat_layout_of_the_rows_maps_to_the_grid_and_back():
    pool = PagedKVPool(1, 1, D, 16, BS)
    seqs = [pool.new_sequence() for _ in range(3)]
    for seq, n in zip(seqs, (5, 2, 7)):
        pool.append_slots(seq, n)
    counts = [1, 2, 4]
    step = PagedStep.pack([s.blocks for s in seqs], [4, 0, 3], counts, None, batch=4, rows=4, max_blocks=2,
                          tree_size=0, block_size=BS)
    cells = step.flat_cells(10)  # 7 real rows, 3 padding rows
    assert cells.tolist() == [0, 4, 5, 8, 9, 10, 11, 16, 16, 16]
    flat = torch.arange(10.0)[:, None].expand(10, 3)
    grid = step.to_grid(flat, cells)
    assert grid.shape == (4, 4, 3) and grid[2, :4, 0].tolist() == [3, 4, 5, 6] and grid[3].abs().sum() == 0
    back = step.from_grid(grid, cells)
    assert back[:7].equal(flat[:7]) and not back[7:].any()
    flat_slots = step.from_grid(step.slot_mapping().view(4, 4), cells)
    expected = [slot for s, st, c in zip(seqs, [4, 0, 3], counts) for slot in pool.slots(s, st, c)]
    assert flat_slots[:7].tolist() == expected


def test_tree_ancestors_match_tree_attention():
    rng = random.Random(3)
    for _ in range(20):
        size, base = rng.randrange(1, 12), rng.randrange(1, 6)
        parents = tuple(rng.randrange(base - 1, base + i) for i in range(size))
        tree = TreeAttention(base, parents)
        closure = tree_ancestors(torch.tensor(parents)[None] - base)[0]
        for t in range(size):
            expected = {s - base for s in tree.visible(base + t) if s >= base}
            assert set(closure[t].nonzero().flatten().tolist()) == expected


def test_the_step_reads_no_value_on_the_host():
    """Built from a packed tensor on the meta device (no values at all), every tensor of the step and the
    attention call have their shapes: nothing reads a value back or sizes a tensor by one."""
    batch, rows, max_blocks, tree_size = 4, 5, 3, 6
    packed = torch.empty(batch, max_blocks + 3 + tree_size, dtype=torch.long, device="meta")
    step = PagedStep(packed, rows, max_blocks, BS)
    caches = [torch.empty(10, BS, 2, D, device="meta") for _ in range(2)]
    write_kv(*caches, torch.empty(batch * rows, 2, D, device="meta"), torch.empty(batch * rows, 2, D, device="meta"),
             step.slot_mapping())
    out = paged_attention(torch.empty(batch, rows, 4, D, device="meta"), *caches, step.block_tables,
                          step.mask(3, 2), 0.3)
    assert out.shape == (batch, rows, 4, D) and step.positions.shape == (batch, rows)
    cells = step.flat_cells(12)  # a flat layout of 12 rows, and back
    flat = step.from_grid(step.to_grid(torch.empty(12, 4, D, device="meta"), cells), cells)
    assert flat.shape == (12, 4, D)
    step.block_mask(10, 3)  # FlexAttention's block mask too


@pytest.mark.slow  # compiles FlexAttention (tens of seconds on the CPU)
def test_compiled_flex_attention_equals_the_gathered_sdpa():
    """The mask_mod and block mask compile (no graph break, no host read in them): on the CPU's fused kernel the
    outputs of a mixed step with a tree and a window equal SDPA's over gathered blocks."""
    batch = _Batch(seed=4)
    seqs = [batch.pool.new_sequence() for _ in range(3)]
    for seq, n in zip(seqs, (9, 6, 3)):
        batch.prompt(seq, _tokens(batch.rng, n))
    counts, trees = [1, 4, 3], [None, TreeAttention(6, (5, 6, 6, 8)), None]
    starts = [seq.length for seq in seqs]
    for seq, count in zip(seqs, counts):
        batch.pool.append_slots(seq, count)
    step = PagedStep.pack([s.blocks for s in seqs], starts, counts, trees, 4, 4, 4, 4, BS)
    q = torch.randn(4, 4, 4, D, generator=batch.gen)
    caches = batch.pool.layer(0)
    for window in (None, 3):
        expected = paged_attention(q, *caches, step.block_tables, step.mask(window, 2), 0.3)
        got = flex_paged_attention(q, *caches, step.block_mask(batch.pool.num_blocks, window), 0.3,
                                   compiled_flex_attention())
        for i, count in enumerate(counts):
            torch.testing.assert_close(got[i, :count], expected[i, :count], rtol=1e-5, atol=1e-5)


def test_pack_refuses_what_does_not_fit():
    pool = PagedKVPool(1, 1, D, 16, BS)
    seq = pool.new_sequence()
    pool.append_slots(seq, 9)
    with pytest.raises(ValueError):
        PagedStep.pack([seq.blocks], [5], [4], None, batch=1, rows=4, max_blocks=2, tree_size=0, block_size=BS)
    with pytest.raises(ValueError):
        PagedStep.pack([seq.blocks], [5], [4], None, batch=1, rows=3, max_blocks=3, tree_size=0, block_size=BS)
    with pytest.raises(ValueError):
        PagedStep.pack([seq.blocks], [5], [4], [TreeAttention(5, (4, 5, 6, 7))], batch=1, rows=4, max_blocks=3,
                       tree_size=2, block_size=BS)

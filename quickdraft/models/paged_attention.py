"""Attention over a ragged batch in one call per layer, reading each sequence's blocks of a paged KV pool
(kv/paged.py; issue 50). Pure tensor functions: nothing here syncs with the host or has a shape that depends on
the data, so a CUDA graph can capture a step of given padded sizes once and replay it.

A step is laid out as a grid of B sequences x R rows (both padded to buckets) over block tables of MB blocks
(max_len L = MB x block_size). `PagedStep` takes per sequence its block table, `start` (slots before this step),
`count` (its rows this step: 1 for plain decoding, K + 1 for a chain, the new nodes of a token tree, a prompt's
rows; 0 for a padding sequence) and its token tree (`base`, and the parent of every tree slot relative to base,
-1 for a child of the root; models.base.TreeAttention's conventions). Everything else is derived on the device,
once per step, for every layer:
- a row's slot (start + r), its position (the slot below base, base + depth - 1 in the tree: what rope needs),
  its pool slot (the slot mapping its keys and values are written to; padded rows write the null block),
- the ancestors of each tree slot (a transitive closure by log2(P) boolean matrix squarings: static shapes),
- which logical slots each row sees: a causal row (below base) the slots up to its own, a tree row the prefix,
  its ancestors and itself, only slots below the sequence's end, and under a sliding window only keys whose
  positions are above the row's minus the window (Gemma 3's local layers).
One rule (`_visible`) decides visibility for both backends:
- `paged_attention`: torch SDPA over the blocks gathered by the block tables into [B, Hkv, L, d] views, under
  a boolean mask [B, 1, G x R, L] built once per step and window. Grouped-query attention folds each kv head's
  G query heads into rows (no repeated keys; any SDPA backend takes it). Padded rows see their slot 0 (the
  null block's for a padding sequence: finite, as the pool keeps every slot), so no softmax row is empty.
- `flex_paged_attention`: FlexAttention over the pool's slots in place, no gather: a block mask whose kv blocks
  are each sequence's table (kv block = pool block) and a mask_mod mapping a pool slot back to the sequence's
  logical slot. Eager (a dense reference) or compiled (`compiled_flex_attention()`).
A runner whose linear layers run on the step's rows alone, not the padded grid, maps them by `flat_cells`.

Which backend (benchmarks/paged_attention_cpu.py, 16 sequences, Qwen2.5-1.5B's attention shape, one thread, a
loaded machine): on the CPU SDPA over gathered blocks, 1.2-3.8x the per-sequence calls at ~256 slots and as fast
as them within the noise at ~1024 (where its gather costs); compiled FlexAttention was about the per-sequence
calls, eager FlexAttention (dense over the pool) seconds a call. On CUDA, unmeasured:
SDPA over gathered blocks first (graph-safe, any SDPA kernel); compiled FlexAttention reads the pool in place,
where the gather writes and reads every sequence's keys and values once more a layer, so it should win at long
contexts; gpu_check should time both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from quickdraft.kv.paged import NULL_BLOCK
from quickdraft.models.base import TreeAttention, check_tree

Q_BLOCK = 128  # FlexAttention's query tile: rows of one sequence share a table, so a tile spans one sequence


class _Rows(NamedTuple):
    """What `_visible` reads: per row [B, R] and per tree slot [B, P'] (P' = max(P, 1)), on the device."""

    slot: torch.Tensor  # [B, R] the row's logical slot
    position: torch.Tensor  # [B, R] its position
    valid: torch.Tensor  # [B, R] a real row (not padding)
    in_tree: torch.Tensor  # [B, R] slot >= base
    ancestors: torch.Tensor  # [B, R, P'] whether tree slot base + t is the row's ancestor or itself
    tree_position: torch.Tensor  # [B, P'] the position of tree slot base + t
    base: torch.Tensor  # [B]
    end: torch.Tensor  # [B] start + count


def _visible(rows: _Rows, b: torch.Tensor, q: torch.Tensor, j: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether row q of sequence b sees its logical slot j (broadcasting index tensors, or FlexAttention's
    scalars). A negative j is a pool block the sequence does not hold."""
    base = rows.base[b]
    tree_slot = (j - base).clamp(0, rows.tree_position.shape[1] - 1)
    in_tree = j >= base
    seen = torch.where(in_tree, rows.in_tree[b, q] & rows.ancestors[b, q, tree_slot], j <= rows.slot[b, q])
    seen = seen & (j >= 0) & (j < rows.end[b]) & rows.valid[b, q]
    if window is not None:
        key_position = torch.where(in_tree, rows.tree_position[b, tree_slot], j)
        seen = seen & (key_position > rows.position[b, q] - window)
    return seen


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [..., P] (tree slot t's parent t' relative to base, -1: a child of the root) -> [..., P, P] bool:
    whether tree slot t' is t or one of its ancestors. A parent precedes its child, so a path is at most P - 1
    steps: (P - 1).bit_length() squarings of (identity | parent) close it, a count fixed by the shape."""
    size = parents.shape[-1]
    index = torch.arange(size, device=parents.device)
    reach = (parents[..., :, None] == index) | (index[:, None] == index)  # [..., P, P]
    for _ in range(max(size - 1, 0).bit_length()):
        as_float = reach.float()  # 0/1 products summed below 2^24: exact in float32 (and in TF32)
        reach = (as_float @ as_float) > 0
    return reach


class PagedStep:
    """One batched step's layout on the device (see the module doc), shared by every layer of the forward.

    Built from the packed int64 tensor `packed` [B, MB + 3 + P]: columns [0, MB) the block tables (null block
    padded), then start, count and base, then the P tree parents. `pack` makes it from the host's lists; a
    CUDA graph keeps a static `packed` buffer, copies the step's (`packed`) into it, and replays the ops derived
    here."""

    def __init__(self, packed: torch.Tensor, rows: int, max_blocks: int, block_size: int):
        batch = packed.shape[0]
        self.batch, self.rows, self.max_blocks, self.block_size = batch, rows, max_blocks, block_size
        self.max_len = max_blocks * block_size
        self.block_tables = packed[:, :max_blocks]
        # Copies, not views of `packed`: a compiled FlexAttention on the CPU takes no view in its mask.
        start, count, base = packed[:, max_blocks:max_blocks + 3].t().contiguous()
        parents = packed[:, max_blocks + 3:]
        device = packed.device
        slot = start[:, None] + torch.arange(rows, device=device)  # [B, R]
        in_tree = slot >= base[:, None]
        if parents.shape[1]:
            ancestors = tree_ancestors(parents)  # [B, P, P]
            tree_position = base[:, None] + ancestors.sum(-1) - 1  # depth - 1 past base
            tree_slot = (slot - base[:, None]).clamp(0, parents.shape[1] - 1)
            row_ancestors = ancestors.gather(1, tree_slot[:, :, None].expand(-1, -1, parents.shape[1]))
            position = torch.where(in_tree, tree_position.gather(1, tree_slot), slot)
        else:  # no tree in the step: every row is causal (base = end)
            row_ancestors = torch.zeros((batch, rows, 1), dtype=torch.bool, device=device)
            tree_position = torch.zeros((batch, 1), dtype=torch.long, device=device)
            position = slot
        valid = torch.arange(rows, device=device) < count[:, None]
        self.rows_layout = _Rows(slot, position, valid, in_tree, row_ancestors, tree_position, base, start + count)

    @staticmethod
    def pack(tables: list[list[int]], starts: list[int], counts: list[int],
             trees: list[TreeAttention | None] | None, batch: int, rows: int, max_blocks: int, tree_size: int,
             block_size: int, device: torch.device | str = "cpu") -> "PagedStep":
        """The step of len(tables) sequences padded to `batch` sequences of `rows` rows, `max_blocks` blocks and
        `tree_size` tree slots, in one host-to-device copy (see packed)."""
        packed = PagedStep.packed(tables, starts, counts, trees, batch, rows, max_blocks, tree_size, block_size)
        return PagedStep(packed.to(device), rows, max_blocks, block_size)

    @staticmethod
    def packed(tables: list[list[int]], starts: list[int], counts: list[int],
               trees: list[TreeAttention | None] | None, batch: int, rows: int, max_blocks: int, tree_size: int,
               block_size: int) -> torch.Tensor:
        """The packed int64 tensor of a step, on the host: what a CUDA graph's static buffer is refreshed from
        before a replay. tables: each sequence's block table (PagedSequence.blocks); starts: its slots before
        this step; counts: its rows; trees: per sequence None (causal rows) or the TreeAttention of its rows
        (ending at start + count). Padding sequences: null tables, no rows."""
        trees = trees or [None] * len(tables)
        if not len(tables) == len(starts) == len(counts) == len(trees) or len(tables) > batch:
            raise ValueError(f"PagedStep.packed: {len(tables)} tables, {len(starts)} starts, {len(counts)} counts, "
                             f"{len(trees)} trees for a batch of {batch}")
        lines = []
        for i, (table, start, count, tree) in enumerate(zip(tables, starts, counts, trees)):
            if count > rows or len(table) > max_blocks or -(-(start + count) // block_size) > len(table):
                raise ValueError(f"PagedStep.packed: sequence {i} ({count} rows from slot {start}, {len(table)} "
                                 f"blocks) does not fit {rows} rows and {max_blocks} blocks of {block_size}")
            base, parents = start + count, []
            if tree is not None:
                check_tree("PagedStep.packed", tree, start, count, f" (sequence {i})")
                if len(tree.parents) > tree_size:
                    raise ValueError(f"PagedStep.packed: a tree of {len(tree.parents)} slots, tree_size {tree_size}")
                base, parents = tree.base, [parent - tree.base for parent in tree.parents]
            lines.append(list(table) + [NULL_BLOCK] * (max_blocks - len(table)) + [start, count, base] + parents +
                         [-1] * (tree_size - len(parents)))
        padding = [NULL_BLOCK] * max_blocks + [0, 0, 0] + [-1] * tree_size  # no rows; its rows see slot 0 only
        return torch.tensor(lines + [padding] * (batch - len(lines)), dtype=torch.long).view(batch, -1)

    @property
    def positions(self) -> torch.Tensor:
        """[B, R] each row's position (rope's row); padded rows at 0."""
        return torch.where(self.rows_layout.valid, self.rows_layout.position, 0)

    def flat_cells(self, total_rows: int) -> torch.Tensor:
        """[total_rows] the grid cell b x R + r of each row of a flat layout (sequence 0's rows, then sequence 1's,
        .., then padding rows, which get cell B x R, one past the grid): what a runner whose linear layers run on
        the step's rows alone (not on the padded grid) gathers and scatters by (to_grid, from_grid)."""
        count = self.rows_layout.end - self.rows_layout.slot[:, 0]  # [B] rows per sequence
        ends = count.cumsum(0)
        t = torch.arange(total_rows, device=ends.device)
        seq = torch.searchsorted(ends, t, right=True)  # [T] in [0, B]; B past the last real row
        row = t - (ends - count)[seq.clamp(max=self.batch - 1)]
        return torch.where(seq < self.batch, seq * self.rows + row, self.batch * self.rows)

    def to_grid(self, flat: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        """Rows [T, ...] of the flat layout -> [B, R, ...] (padded cells zero)."""
        grid = flat.new_zeros((self.batch * self.rows + 1,) + tuple(flat.shape[1:]))
        grid.index_copy_(0, cells, flat)  # padding rows all land on the spare cell, cut off below
        return grid[:-1].view((self.batch, self.rows) + tuple(flat.shape[1:]))

    def from_grid(self, grid: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        """[B, R, ...] -> the flat layout's rows [T, ...] (padding rows read a zero row)."""
        rows = grid.reshape((self.batch * self.rows,) + tuple(grid.shape[2:]))
        return torch.cat([rows, rows.new_zeros((1,) + tuple(rows.shape[1:]))]).index_select(0, cells)

    def slot_mapping(self) -> torch.Tensor:
        """[B * R] the pool slot each row's keys and values go to (padded rows: the null block's slot 0)."""
        layout, bs = self.rows_layout, self.block_size
        block = self.block_tables.gather(1, (layout.slot // bs).clamp(0, self.max_blocks - 1))
        return torch.where(layout.valid, block * bs + layout.slot % bs, NULL_BLOCK * bs).reshape(-1)

    def mask(self, window: int | None = None, group: int = 1) -> torch.Tensor:
        """[B, 1, group x R, L] bool: which logical slots each row sees, the rows repeated for `group` query
        heads per kv head (paged_attention's layout); a padded row sees its slot 0 only."""
        device = self.block_tables.device
        b = torch.arange(self.batch, device=device)[:, None, None]
        q = torch.arange(self.rows, device=device)[None, :, None]
        j = torch.arange(self.max_len, device=device)[None, None, :]
        seen = _visible(self.rows_layout, b, q, j, window)  # [B, R, L]
        seen = seen | (~self.rows_layout.valid[:, :, None] & (j == 0))
        return seen[:, None].expand(-1, group, -1, -1).reshape(self.batch, 1, group * self.rows, self.max_len)

    def block_mask(self, num_pool_blocks: int, window: int | None = None):
        """FlexAttention's BlockMask over the pool's slots [0, num_pool_blocks x block_size): each sequence's
        kv blocks are its table's, a pool slot maps back to its logical slot for `_visible`."""
        from torch.nn.attention.flex_attention import BlockMask

        bs, tables = self.block_size, self.block_tables
        used = torch.div(self.rows_layout.end + bs - 1, bs, rounding_mode="floor")  # [B] blocks in use
        tiles = -(-self.rows // Q_BLOCK)
        logical = torch.full((self.batch, num_pool_blocks), -1, dtype=torch.int32, device=tables.device)
        order = torch.arange(self.max_blocks, dtype=torch.int32, device=tables.device).expand(self.batch, -1)
        logical.scatter_(1, tables, order)  # padded entries all hit the null block, never read: used stops first
        layout, last_row = self.rows_layout, self.rows - 1

        def mask_mod(b, h, q_idx, kv_idx):
            j = logical[b, kv_idx // bs].long() * bs + kv_idx % bs
            return _visible(layout, b, q_idx.clamp(max=last_row), j, window)

        num_blocks = used.to(torch.int32)[:, None, None].expand(-1, 1, tiles).contiguous()
        # Indices as wide as the pool's blocks (compiled kernels check the mask covers the kv length); only the
        # first `used` of each row are read.
        indices = torch.zeros((self.batch, 1, tiles, num_pool_blocks), dtype=torch.int32, device=tables.device)
        indices[..., :self.max_blocks] = tables.to(torch.int32)[:, None, None, :]
        # No block is "full" (mask_mod applies everywhere), said explicitly: torch 2.13's compiled CPU decoding
        # kernel (one row, long kv) reads the full-block counts whether or not they were given.
        return BlockMask.from_kv_blocks(num_blocks, indices, torch.zeros_like(num_blocks), torch.zeros_like(indices),
                                        BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
                                        seq_lengths=(self.rows, num_pool_blocks * bs), compute_q_blocks=False)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write rows' keys and values [N, Hkv, d] to pool slots slot_mapping [N] of one layer's caches
    [num_blocks, block_size, Hkv, d] (vLLM's reshape_and_cache). Padded rows all write the null block."""
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, keys.reshape(-1, heads, dim).to(key_cache.dtype))
    value_cache.view(-1, heads, dim).index_copy_(0, slot_mapping,
                                                 values.reshape(-1, heads, dim).to(value_cache.dtype))


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA over gathered blocks: queries q [B, R, Hq, d] over each sequence's blocks of one layer's caches
    [num_blocks, block_size, Hkv, d] by block_tables [B, MB], under mask [B, 1, G x R, L] (PagedStep.mask with
    group G = Hq // Hkv). Returns [B, R, Hq, d]."""
    batch, rows, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    # One index_select of whole blocks (rows of a 2-D view): several times faster than advanced indexing on the CPU.
    pages = block_tables.reshape(-1)
    keys = key_cache.flatten(1).index_select(0, pages).view(batch, -1, kv_heads, dim).transpose(1, 2)  # [B, Hkv, L, d]
    values = value_cache.flatten(1).index_select(0, pages).view(batch, -1, kv_heads, dim).transpose(1, 2)
    # Query head h reads kv head h // G: its G heads become rows g x R + r of that kv head's matrix.
    q = q.view(batch, rows, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * rows, dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)  # [B, Hkv, G x R, d]
    return out.view(batch, kv_heads, group, rows, dim).permute(0, 3, 1, 2, 4).reshape(batch, rows, heads, dim)


_COMPILED_FLEX = None


def compiled_flex_attention():
    """torch.compile(flex_attention), made once (FlexAttention's fused kernels; eager it is a dense reference)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def flex_paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_mask,
                         scale: float, kernel=None) -> torch.Tensor:
    """FlexAttention over the pool in place: queries q [B, R, Hq, d] over one layer's caches [num_blocks,
    block_size, Hkv, d] under PagedStep.block_mask. kernel: flex_attention (eager, the default) or
    compiled_flex_attention(). Returns [B, R, Hq, d]; a padded row is zeros."""
    if kernel is None:
        from torch.nn.attention.flex_attention import flex_attention as kernel
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    keys = key_cache.view(-1, heads, dim).transpose(0, 1)[None]  # [1, Hkv, num_blocks x block_size, d]
    values = value_cache.view(-1, heads, dim).transpose(0, 1)[None]
    out = kernel(q.transpose(1, 2), keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)

"""The CUDA runner: a batch's keys and values in one paged KV pool, a step's attention in one call per layer, and
every step of a bucketed shape captured once as a CUDA graph and replayed (issue 50).

Eagerly, a decoding step of a 1.5B model on a GPU is launch-bound: ~35 kernels a layer from Python, 11-19 ms
whatever its rows, where its graph replays in ~3 ms (benchmarks/RESULTS.md, session 32). So a forward here has no
shape that depends on where its rows sit, and nothing in it depends on which sequences it serves:
- every sequence's keys and values live in blocks of the runner's PagedKVPool (kv/paged.py: one tensor, block
  tables, prompt prefixes shared by reference); its cache is a PagedSequenceCache (kv/paged_cache.py);
- a step's token ids, the rows whose logits are wanted, and the PagedStep layout (block tables, each sequence's
  start, rows and token tree's parents: models/paged_attention.py) travel in ONE int64 tensor, one host-to-device
  copy a step, no device-to-host read;
- the linear layers run on the step's rows (flat: sequence 0's rows, then 1's, .., then padding rows); rope reads
  the rows' positions, keys and values are written by a slot mapping (write_kv), and attention is one SDPA call a
  layer over the blocks gathered by the tables (paged_attention) for chains, token trees and plain rows alike
  (or, with attention = "flex", FlexAttention over the pool in place under a paged block mask);
- a step is padded to buckets: sequences to BATCH_BUCKETS (padding sequences have null block tables and no rows),
  a sequence's rows to ROW_BUCKETS, the step's rows and logits to TOTAL_BUCKETS, the tables to a bucket of blocks
  (block_bucket), a tree's slots to ROW_BUCKETS. Padded rows write the pool's null block, which no row attends.
The graph key is the padded shape (sequences, rows, blocks, tree slots, total rows, logits, hidden, embeds): one
graph serves any sequences of that shape, since the pool's address never changes and the tables are data. A shape
seen a second time is captured (all graphs share one memory pool) and replayed from then on. Steps that fit no
bucket (more than 64 sequences or rows, prefills) run eagerly, unpadded, a long prompt's attention in a call of
its own; `unbucketed_steps` counts them, `eager_steps` every forward not replayed, `graph_replays` the others.

On device="cpu" the same padded path runs eagerly with no graph: tests/models/test_cuda_graphs.py and
tests/models/test_cuda_paged.py check it there against the reference runner (models/torch_runner.py),
tests/test_cuda.py through the engine.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.kv.paged import PagedKVPool
from quickdraft.kv.paged_cache import PagedSequenceCache
from quickdraft.kv.pool import KVPoolFull, available_memory
from quickdraft.models.decoder import DecoderRunner
from quickdraft.models.paged_attention import (PagedStep, compiled_flex_attention, flex_paged_attention,
                                               paged_attention, write_kv)
from quickdraft.models.weights import DecoderWeights, Layer
from quickdraft.sampling import argmax_rows

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # sequences of a step, padded (vLLM's capture sizes)
ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # a sequence's rows (and a tree's slots), padded
TOTAL_BUCKETS = ROW_BUCKETS + (96, 128, 192, 256, 384, 512)  # a step's rows and logits, padded
GRAPH_MAX_ROWS = ROW_BUCKETS[-1]  # a sequence with more rows (a prompt) makes the step unbucketed: eager
KV_BLOCKS_BUCKET = 8  # tables are padded to a multiple of max(8 blocks, a quarter of their power of 2)
GRAPHS_KEPT = 32  # graphs a runner keeps, most recently used (their outputs hold memory: logits [rows, V])
SIGHTINGS_KEPT = 256  # shapes remembered as seen once (captured at their second sighting)
POOL_GPU_FRACTION = 0.5  # of the device memory free when the pool is made, by default
POOL_CPU_SEQUENCES = 16  # on the CPU the default pool holds this many full contexts,
POOL_CPU_MAX_BYTES = 256 << 20  # up to this many bytes


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= value; None past the last."""
    return next((b for b in buckets if b >= value), None)


def row_bucket(rows: int) -> int:
    """The padded row count of a sequence's `rows` new rows (itself past the last bucket)."""
    return bucket(rows, ROW_BUCKETS) or rows


def block_bucket(blocks: int, limit: int) -> int:
    """A block table's padded width: `blocks` rounded up to a multiple of max(KV_BLOCKS_BUCKET, a quarter of its
    power of 2) (at most a quarter more keys attended than live), within `limit` (a context's blocks)."""
    granule = max(KV_BLOCKS_BUCKET, (1 << (max(blocks, 1).bit_length() - 1)) // 4)
    return max(min(-(-blocks // granule) * granule, limit), blocks)


@dataclass
class _Group:
    """Sequences whose attention is one call: a PagedStep's padded shape and which of the step's rows are theirs."""

    batch: int
    rows: int
    blocks: int
    tree: int
    total: int  # its rows in the flat layout (padding rows included)
    row_index: list[int] | None = None  # the step's flat rows of its sequences, None: all of them, in order

    @property
    def width(self) -> int:
        return self.blocks + 3 + self.tree

    def key(self) -> tuple:
        return self.batch, self.rows, self.blocks, self.tree, self.total


@dataclass
class _Step:
    """One forward, described on the host: its padded shapes (the graph key) and the int64 tensor its rows read
    ([total] ids | [logits] output rows | each group's packed PagedStep)."""

    groups: list[_Group]
    total: int
    logits: int
    counts: list[int]
    wanted: list[int]
    embeds: bool
    hidden: bool
    bucketed: bool
    host: torch.Tensor | None = None
    device_ids: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # ids already on the device

    def key(self) -> tuple:
        return self.total, self.logits, self.embeds, self.hidden, tuple(g.key() for g in self.groups)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    buffer: torch.Tensor  # its input buffers
    embeds: torch.Tensor | None
    logits: torch.Tensor | None  # its outputs
    hidden: torch.Tensor | None
    tables: list  # the rope tables it reads (kept alive while it lives)


class CudaRunner(DecoderRunner):
    """The paged, bucketed forward; graphs on CUDA (capture_graphs), eager elsewhere."""

    backend = "cuda"

    def __init__(self, weights: DecoderWeights, name: str = "model"):
        super().__init__(weights, name)
        # On CUDA each shape is captured at its second sighting; False runs every forward eagerly (the same
        # kernels, so the same results: what tests compare the graphs with).
        self.capture_graphs = self.device.type == "cuda"
        # "sdpa": SDPA over each sequence's gathered blocks (the default); "flex": FlexAttention over the pool in
        # place under a paged block mask (compiled on CUDA, eager elsewhere: a dense reference, slow).
        self.attention = "sdpa"
        self.kv_pool_bytes: int | None = None  # the pool's size; None: the default (kv_pool)
        self._kv_pool: PagedKVPool | None = None
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: OrderedDict[tuple, str] = OrderedDict()  # shapes not captured: "once" seen, or "failed"
        self._graph_pool = None  # the memory pool every graph of this runner captures into
        self.graph_replays = 0  # forwards that replayed a graph (metrics, tests)
        self.graph_captures = 0
        self.eager_steps = 0  # forwards run eagerly (first sightings, unbucketed steps, no graphs)
        self.unbucketed_steps = 0  # of them, steps that fit no bucket

    # --- the pool ---
    @property
    def kv_pool(self) -> PagedKVPool:
        """The paged KV pool every cache of this runner draws on, made at first use: kv_pool_bytes if set, else
        POOL_GPU_FRACTION of the device memory free then (on CUDA), or POOL_CPU_SEQUENCES full contexts up to
        POOL_CPU_MAX_BYTES (elsewhere)."""
        if self._kv_pool is None:
            self._kv_pool = PagedKVPool(self.num_layers, self.num_kv_heads, self.head_dim, self._pool_blocks(),
                                        dtype=self.dtype, device=self.device)
        return self._kv_pool

    def size_kv_pool(self, budget_bytes: int) -> None:
        """Size the pool to budget_bytes (an LLM's kv_cache_memory); refused once a sequence holds blocks."""
        pool, self.kv_pool_bytes = self._kv_pool, int(budget_bytes)
        if pool is None or pool.num_blocks == self._pool_blocks():
            return
        if pool.num_used_blocks:
            raise QuickdraftError(f"{self.name}: the KV pool cannot be resized while sequences hold blocks")
        self._kv_pool = None
        self._graphs.clear()  # they read the old pool
        self._seen.clear()

    def _pool_blocks(self) -> int:
        budget = self.kv_pool_bytes
        if budget is None and self.device.type == "cuda":
            budget = int(available_memory(self.device) * POOL_GPU_FRACTION)
        if budget is None:
            budget = min(POOL_CPU_MAX_BYTES, POOL_CPU_SEQUENCES * (self.max_len + 16) * self.kv_bytes_per_token)
        return PagedKVPool.blocks_for_budget(budget, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def new_cache(self) -> PagedSequenceCache:
        return PagedSequenceCache(self.kv_pool)

    def kv_pool_metrics(self) -> dict[str, int]:
        """The pool's blocks (used, cached, free, total) and how this runner's forwards ran: for /metrics."""
        return {**(self._kv_pool.usage() if self._kv_pool is not None else {}),
                "graph_replays": self.graph_replays, "graph_captures": self.graph_captures,
                "eager_steps": self.eager_steps, "unbucketed_steps": self.unbucketed_steps}

    # --- the forward ---
    def forward_batch(self, caches: list[PagedSequenceCache], tokens: list[torch.Tensor], num_logits: list[int],
                      inputs_embeds: list[torch.Tensor] | None = None, return_hidden: bool = False,
                      trees=None, argmax_only: bool = False):
        """DecoderRunner.forward_batch on the paged path (module docstring); argmax_only takes the argmax of the
        graph's logits on the device."""
        with torch.inference_mode():
            flat, trees = self._checked(caches, tokens, num_logits, inputs_embeds, trees)
            pool = self.kv_pool
            for cache in caches:
                if not isinstance(cache, PagedSequenceCache) or cache.pool is not pool:
                    raise QuickdraftError(f"{self.name}: a cache of {type(cache).__name__}; this runner's forwards "
                                          "take the caches its new_cache() makes")
            wanted = [int(k) for k in num_logits]
            starts = [len(cache) for cache in caches]
            self._append(caches, flat)
            try:
                step = self._plan(caches, flat, starts, wanted, trees, inputs_embeds is not None, return_hidden)
                embeds = None
                if inputs_embeds is not None:
                    embeds = self._padded_embeds(step, inputs_embeds)
                logits, hidden = self._run(step, embeds)
            except BaseException:  # the slots go back: the caches hold what they held
                for cache, start in zip(caches, starts):
                    cache.pool.rollback(cache.seq, start)
                raise
            for cache, ids in zip(caches, flat):
                cache.record(ids)
            self.forwards += 1
            real = sum(step.counts)
            total = sum(wanted)
            logits = logits[:total] if logits is not None and total else \
                torch.zeros((0, self.vocab_size), dtype=torch.float32, device=self.device)
            # The graph's output is overwritten by its next replay: what is handed out is a copy, or its argmax.
            logits = argmax_rows(logits) if argmax_only else logits.clone()
            return (logits, hidden[:real].clone()) if return_hidden else logits

    @staticmethod
    def _append(caches: list[PagedSequenceCache], flat: list[torch.Tensor]) -> None:
        """Every sequence's slots for its rows, all or none (KVPoolFull leaves every cache as it was)."""
        done = []
        try:
            for cache, ids in zip(caches, flat):
                start = len(cache)
                cache.append(int(ids.shape[0]))
                done.append((cache, start))
        except KVPoolFull:
            for cache, start in done:
                cache.pool.rollback(cache.seq, start)
            raise

    # --- the host's part: plan, stage, replay ---
    def _plan(self, caches, flat, starts, wanted, trees, embeds: bool, hidden: bool) -> _Step:
        """The step's padded shapes and its int64 tensor (module docstring)."""
        bs = self.kv_pool.block_size
        counts = [int(ids.shape[0]) for ids in flat]
        trees = trees or [None] * len(caches)
        tables = [cache.seq.blocks[:-(-(start + n) // bs)] for cache, start, n in zip(caches, starts, counts)]
        tree_sizes = [0 if tree is None else len(tree.parents) for tree in trees]
        limit = -(-self.max_len // bs)
        batch, rows = bucket(len(caches), BATCH_BUCKETS), bucket(max(counts), ROW_BUCKETS)
        total = bucket(sum(counts), TOTAL_BUCKETS)
        logits = bucket(sum(wanted), TOTAL_BUCKETS) if sum(wanted) else 0
        bucketed = None not in (batch, rows, total, logits) and max(counts) <= GRAPH_MAX_ROWS
        if bucketed:
            total = min(total, batch * rows)
            tree = row_bucket(max(tree_sizes)) if any(tree_sizes) else 0
            groups = [_Group(batch, rows, block_bucket(max(map(len, tables)), limit), tree, total)]
            members = [list(range(len(caches)))]
        else:  # a long prompt's attention alone, the others' together: no grid of a prompt's rows per sequence
            total, logits = sum(counts), sum(wanted)
            long = [i for i, n in enumerate(counts) if n > GRAPH_MAX_ROWS]
            rest = [i for i, n in enumerate(counts) if n <= GRAPH_MAX_ROWS]
            members = [[i] for i in long] + ([rest] if rest else [])
            offsets = [sum(counts[:i]) for i in range(len(counts))]
            groups = []
            for group in members:
                index = [offsets[i] + r for i in group for r in range(counts[i])]
                groups.append(_Group(len(group), max(counts[i] for i in group),
                                     max(len(tables[i]) for i in group), max(tree_sizes[i] for i in group),
                                     len(index), None if len(members) == 1 else index))
        step = _Step(groups, total, logits, counts, wanted, embeds, hidden, bucketed)
        ids, out_rows, offset = [], [], 0
        for ids_i, n, k in zip(flat, counts, wanted):
            if ids_i.device.type == "cpu":
                ids.extend(ids_i.tolist())
            else:  # a draft's tokens on the device: copied there, device to device, after the tensor
                step.device_ids.append((offset, ids_i))
                ids.extend([0] * n)
            out_rows.extend(range(offset + n - k, offset + n))
            offset += n
        ids.extend([0] * (total - offset))
        out_rows.extend([out_rows[-1] if out_rows else 0] * (logits - len(out_rows)))
        parts = [torch.tensor(ids + out_rows, dtype=torch.long)]
        for group, who in zip(groups, members):
            parts.append(PagedStep.packed([tables[i] for i in who], [starts[i] for i in who],
                                          [counts[i] for i in who], [trees[i] for i in who], group.batch, group.rows,
                                          group.blocks, group.tree, bs).view(-1))
        step.host = parts[0] if len(parts) == 1 else torch.cat(parts)
        return step

    def _padded_embeds(self, step: _Step, inputs_embeds: list[torch.Tensor]) -> torch.Tensor:
        """The input rows of every sequence, then zero padding rows, in the residual stream's dtype: [total, hidden]."""
        dtype = self.weights.residual_dtype
        parts = [embeds.to(device=self.device, dtype=dtype) for embeds in inputs_embeds]
        real = sum(step.counts)
        if step.total > real:
            parts.append(torch.zeros(step.total - real, parts[0].shape[-1], dtype=dtype, device=self.device))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _staged(self, step: _Step, into: torch.Tensor | None = None) -> torch.Tensor:
        """The step's tensor on the device (in `into`, a graph's buffer, or a new tensor): one copy from pinned
        host memory that does not wait for the device, then the draft tokens already there."""
        host = step.host
        if self.device.type == "cuda":
            host = host.pin_memory()
        if into is None:
            if self.device.type == "cpu":
                into = host
            else:
                into = torch.empty(host.shape, dtype=torch.long, device=self.device)
        if into is not host:
            into.copy_(host, non_blocking=True)
        for offset, ids in step.device_ids:
            into[offset: offset + ids.shape[0]].copy_(ids)
        return into

    def _tables(self, step: _Step) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The rope tables the forward gathers from, long enough for every slot it attends (built before a
        capture: a capture allocates nothing it must keep)."""
        end = max(g.blocks for g in step.groups) * self.kv_pool.block_size + 1
        return {kind: self._rope(kind, end) for kind in sorted({layer.rope for layer in self.weights.layers})}

    def _run(self, step: _Step, embeds: torch.Tensor | None):
        """(logits [step.logits, V] or None, hidden [step.total, hidden] or None) of the step: a replayed graph,
        a new capture, or an eager run."""
        tables = self._tables(step)
        if not step.bucketed:
            self.unbucketed_steps += 1
        if not (self.capture_graphs and self.device.type == "cuda" and step.bucketed):
            return self._eager(step, embeds, tables)
        key = step.key()
        entry = self._graphs.get(key)
        if entry is None:
            if self._seen.get(key, "new") != "once":  # first sighting (or a failed capture): eagerly
                if key not in self._seen:
                    self._seen[key] = "once"  # a shape seen once is not worth a capture
                    while len(self._seen) > SIGHTINGS_KEPT:
                        self._seen.popitem(last=False)
                return self._eager(step, embeds, tables)
            try:
                entry = self._capture(step, embeds, tables)
            except RuntimeError as error:  # the warm-up wrote this step's keys: the eager run writes the same
                self._seen[key] = "failed"
                log.warning("%s: a CUDA graph capture failed, this shape runs eagerly (%s)", self.name,
                            str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
                return self._eager(step, embeds, tables)
            self._graphs[key] = entry
            while len(self._graphs) > GRAPHS_KEPT:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        self._staged(step, entry.buffer)
        if embeds is not None:
            entry.embeds.copy_(embeds)
        entry.graph.replay()
        self.graph_replays += 1
        return entry.logits, entry.hidden

    def _eager(self, step: _Step, embeds, tables):
        self.eager_steps += 1
        return self._paged_forward(step, self._staged(step), embeds, tables)

    def _capture(self, step: _Step, embeds: torch.Tensor | None, tables) -> _Graph:
        """A CUDA graph of the step's forward. Warmed up once on a side stream first, as torch asks (the warm-up
        computes this very step: it writes the same keys the replay then writes again)."""
        buffer = self._staged(step)
        static_embeds = None if embeds is None else embeds.clone()
        device = self.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._paged_forward(step, buffer, static_embeds, tables)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits, hidden = self._paged_forward(step, buffer, static_embeds, tables)
        self.graph_captures += 1
        return _Graph(graph, buffer, static_embeds, logits, hidden, list(tables.values()))

    # --- the device's part: one forward, every shape fixed by the step ---
    def _paged_forward(self, step: _Step, buffer: torch.Tensor, embeds: torch.Tensor | None,
                       tables: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits [step.logits, V] or None, final-normed hidden rows [step.total, hidden] or None): device ops
        only, no host read, shapes from the step alone."""
        w, pool = self.weights, self.kv_pool
        total = step.total
        ids, out_rows = buffer[:total], buffer[total: total + step.logits]
        offset = total + step.logits
        group_size = w.num_heads // w.num_kv_heads
        windows = sorted({layer.sliding_window for layer in w.layers}, key=lambda window: window or 0)
        layouts = []  # per group: its PagedStep, flat cells, slot mapping, masks by window, row index
        positions = None
        for group in step.groups:
            packed = buffer[offset: offset + group.batch * group.width].view(group.batch, group.width)
            offset += group.batch * group.width
            paged = PagedStep(packed, group.rows, group.blocks, pool.block_size)
            cells = paged.flat_cells(group.total)
            grid = torch.stack([paged.slot_mapping().view(group.batch, group.rows), paged.positions], -1)
            slots, rows_positions = paged.from_grid(grid, cells).unbind(-1)  # padding rows: slot 0, position 0
            index = None if group.row_index is None else torch.tensor(group.row_index, device=self.device)
            if index is None:
                positions = rows_positions
            else:
                if positions is None:
                    positions = torch.zeros(total, dtype=torch.long, device=self.device)
                positions.index_copy_(0, index, rows_positions)
            if self.attention == "flex":
                masks = {window: paged.block_mask(pool.num_blocks, window) for window in windows}
            else:
                masks = {window: paged.mask(window, group_size) for window in windows}
            layouts.append((paged, cells, slots, masks, index))
        ropes = {kind: (cos.index_select(0, positions), sin.index_select(0, positions))
                 for kind, (cos, sin) in tables.items()}
        flex = None
        if self.attention == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            flex = compiled_flex_attention() if self.device.type == "cuda" else flex_attention

        def attend(index: int, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = self._roped(qkv, layer, *ropes[layer.rope])
            key_cache, value_cache = pool.layer(index)
            out = None if len(layouts) == 1 else q.new_empty(q.shape)
            for paged, cells, slots, masks, rows in layouts:
                q_g, k_g, v_g = (q, k, v) if rows is None else (q[rows], k[rows], v[rows])
                write_kv(key_cache, value_cache, k_g, v_g, slots)
                mask = masks[layer.sliding_window]
                if flex is not None:
                    o = flex_paged_attention(paged.to_grid(q_g, cells), key_cache, value_cache, mask, w.scale, flex)
                else:
                    o = paged_attention(paged.to_grid(q_g, cells), key_cache, value_cache, paged.block_tables, mask,
                                        w.scale)
                o = paged.from_grid(o, cells)
                if out is None:
                    out = o
                else:
                    out.index_copy_(0, rows, o)
            return out.reshape(out.shape[0], -1)

        x = embeds if embeds is not None else self._input_rows(ids)
        x = self._decoder_layers(x, attend)
        hidden = self._final_norm(x).to(w.dtype) if step.hidden else None  # what an EAGLE head reads
        if step.logits == 0:
            return None, hidden
        normed = self._final_norm(x.index_select(0, out_rows))  # the output head on the wanted rows only
        return self.output_logits(normed), hidden

"""The CUDA runner: static shapes, every forward captured once per shape bucket as a CUDA graph and replayed.

Eagerly, a decoding step of a 1.5B model on a GPU is launch-bound: ~35 kernels a layer from Python, 11-19 ms
whatever its rows, where its graph replays in ~3 ms (benchmarks/RESULTS.md, session 32). So every forward here
is written so that no shape depends on where its rows sit:
- the rows' token ids, cache slots, rope positions, the rows whose logits are wanted and each tree's parents
  travel in one int64 tensor (one host-to-device copy a step, no device-to-host read);
- rope rows are gathered by the positions, keys and values are written by index_copy_ at the slots;
- attention is torch's scaled_dot_product_attention over the cache's first L slots (the live prefix rounded up
  to a bucket, not the whole capacity) under a boolean mask built on the device (models/tree_mask.py
  static_visibility: causal, windowed, or a token tree whose ancestors are closed on the device);
- a sequence's rows are padded to a bucket (1, 2, 4, 8, 12, 16, 24, 32, 48, 64): padded rows read token 0 at
  position 0 and write their keys to a scratch slot past the cache's capacity, which no row attends.
One forward serves one sequence or a batch (each sequence on its own cache), chains, token trees, the rows'
hidden states (an EAGLE head's features) and input embeddings. Each distinct shape (the caches' tensors, rows,
attended slots, logits, tree sizes) is a key: seen a second time, it is captured as a CUDA graph (all of this
runner's graphs share one memory pool) and replayed from then on. Forwards of more than GRAPH_MAX_ROWS rows
(prefills) run the same path eagerly, unpadded.

On device="cpu" the same path runs eagerly with no graph: tests/models/test_cuda_graphs.py checks it there
against the reference runner (models/torch_runner.py), tests/test_cuda.py through the engine.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quickdraft.errors import QuickdraftError
from quickdraft.kv.static_cache import StaticSequenceCache
from quickdraft.models.base import TreeAttention
from quickdraft.models.decoder import DecoderRunner
from quickdraft.models.tree_mask import static_visibility
from quickdraft.models.weights import DecoderWeights, Layer

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # a sequence's rows are padded to one of these
GRAPH_MAX_ROWS = ROW_BUCKETS[-1]  # forwards of more rows in all (prefills) run eagerly: launches matter little
GRAPHS_KEPT = 24  # graphs a runner keeps, most recently used (their outputs hold memory: logits [rows, V])
SIGHTINGS_KEPT = 256  # shapes remembered as seen once (captured at their second sighting)
KV_BUCKET = 128  # attended slots are rounded up to a multiple of max(KV_BUCKET, a quarter of their power of 2)


def row_bucket(rows: int) -> int:
    """The padded row count of a sequence's `rows` new rows (itself past the last bucket)."""
    return next((bucket for bucket in ROW_BUCKETS if bucket >= rows), rows)


def kv_bucket(end: int, capacity: int) -> int:
    """How many of a cache's slots a forward ending at slot `end` attends: end rounded up to a multiple of
    max(KV_BUCKET, 2^floor(log2 end) / 4) (at most a quarter more keys than live), within the capacity."""
    granule = max(KV_BUCKET, (1 << (max(end, 1).bit_length() - 1)) // 4)
    return min(-(-end // granule) * granule, capacity)


class CudaSequenceCache(StaticSequenceCache):
    """The CUDA runner's cache: StaticSequenceCache's layout (keys and values [layers, Hkv, capacity, d]), zeroed
    when allocated (attention reads slots past the sequence under a mask, and 0 x NaN from uninitialised memory
    would be NaN) and with one scratch slot past its capacity, where padded rows write."""

    @property
    def capacity(self) -> int:
        return 0 if self.values is None else self.values.shape[2] - 1

    @property
    def scratch_slot(self) -> int:
        return self.capacity

    def _allocate(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        shape = (r.num_layers, r.num_kv_heads, capacity + 1, r.head_dim)
        return (torch.zeros(shape, dtype=r.key_dtype, device=r.device),
                torch.zeros(shape, dtype=r.dtype, device=r.device))


@dataclass
class _Plan:
    """One static forward, described on the host: its graph key and the int64 metadata its rows read."""

    rows: list[int]  # per sequence: rows computed (its new rows, padded to a bucket where graphs apply)
    counts: list[int]  # per sequence: its new rows
    keys: list[int]  # per sequence: the cache slots attended
    outputs: list[int]  # per sequence: the rows whose logits are computed (the wanted first, then padding)
    wanted: list[int]  # per sequence: num_logits
    tree_sizes: list[int]  # per sequence: tree slots given to the mask (a bucket), 0 without a tree
    embeds: bool
    hidden: bool
    metadata: list[int] = field(default_factory=list)  # ids, slots, positions, output rows, then each tree's
    device_ids: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # ids already on the device

    @property
    def total(self) -> int:
        return sum(self.rows)

    def key(self, caches: list[StaticSequenceCache]) -> tuple:
        """What a graph of this forward fixes: every cache's tensors and every shape."""
        return (self.embeds, self.hidden, tuple(
            (cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity, rows, keys, outputs, wanted, tree)
            for cache, rows, keys, outputs, wanted, tree in zip(caches, self.rows, self.keys, self.outputs,
                                                                 self.wanted, self.tree_sizes)))


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    metadata: torch.Tensor  # its input buffers
    embeds: torch.Tensor | None
    logits: torch.Tensor | None  # its outputs
    hidden: torch.Tensor | None
    tables: list  # the rope tables it reads (kept alive while it lives)


class CudaRunner(DecoderRunner):
    """The static-shape forward; graphs on CUDA (capture_graphs), eager elsewhere."""

    backend = "cuda"
    cache_class = CudaSequenceCache

    def __init__(self, weights: DecoderWeights, name: str = "model"):
        super().__init__(weights, name)
        # On CUDA each shape is captured at its second sighting; False runs every forward eagerly (the same
        # kernels, so the same results: what tests compare the graphs with).
        self.capture_graphs = self.device.type == "cuda"
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: OrderedDict[tuple, str] = OrderedDict()  # shapes not captured: "once" seen, or "failed"
        self._pool = None  # the memory pool every graph of this runner captures into
        self.graph_replays = 0  # forwards that replayed a graph (metrics, tests)
        self.graph_captures = 0

    def forward_batch(self, caches: list[StaticSequenceCache], tokens: list[torch.Tensor], num_logits: list[int],
                      inputs_embeds: list[torch.Tensor] | None = None, return_hidden: bool = False,
                      trees: list[TreeAttention | None] | None = None):
        """DecoderRunner.forward_batch on the static path (module docstring)."""
        with torch.inference_mode():
            flat, trees = self._checked(caches, tokens, num_logits, inputs_embeds, trees)
            for cache in caches:
                if not isinstance(cache, CudaSequenceCache):
                    raise QuickdraftError(f"{self.name}: a cache of {type(cache).__name__}; this runner's forwards "
                                          "take the caches its new_cache() makes")
            plan = self._plan(caches, flat, [int(k) for k in num_logits], trees, inputs_embeds is not None,
                              return_hidden)
            embeds = None
            if inputs_embeds is not None:
                embeds = self._padded_embeds(plan, inputs_embeds)
            logits, hidden = self._run(plan, caches, embeds)
            for cache, ids in zip(caches, flat):
                cache.record(ids)
            self.forwards += 1
            logits = self._real_rows(logits, plan.outputs, plan.wanted, self.vocab_size)
            if not return_hidden:
                return logits
            return logits, self._real_rows(hidden, plan.rows, plan.counts, self.weights.hidden_size)

    # --- the host's part: plan, stage, replay ---
    def _plan(self, caches, flat, wanted, trees, embeds: bool, hidden: bool) -> _Plan:
        """The shapes and metadata of a forward; reserves every cache's room (growth happens here, never inside a
        captured forward)."""
        counts = [int(ids.shape[0]) for ids in flat]
        padded = sum(row_bucket(n) for n in counts) <= GRAPH_MAX_ROWS
        rows = [row_bucket(n) if padded else n for n in counts]
        outputs = [0 if k == 0 else min(row_bucket(k), r) if padded else k for k, r in zip(wanted, rows)]
        trees = trees or [None] * len(caches)
        starts = [len(cache) for cache in caches]
        for cache, start, n in zip(caches, starts, counts):
            cache.reserve(start + n)
        tree_sizes = [0 if tree is None else row_bucket(tree.end - tree.base) if padded else tree.end - tree.base
                      for tree in trees]
        plan = _Plan(rows, counts, [kv_bucket(start + n, cache.capacity) for cache, start, n in
                                    zip(caches, starts, counts)], outputs, wanted, tree_sizes, embeds, hidden)
        ids, slots, positions, out_rows, tree_parts = [], [], [], [], []
        offset = 0
        for cache, ids_i, start, n, r, m, k, tree, size in zip(caches, flat, starts, counts, rows, outputs,
                                                                 wanted, trees, tree_sizes):
            if ids_i.device.type == "cpu":
                ids.extend(ids_i.tolist())
            else:  # a draft's tokens on the device: copied there, device to device, after the metadata
                plan.device_ids.append((offset, ids_i))
                ids.extend([0] * n)
            ids.extend([0] * (r - n))
            slots.extend(range(start, start + n))
            slots.extend([cache.scratch_slot] * (r - n))
            positions.extend(range(start, start + n) if tree is None else tree.positions(start, n))
            positions.extend([0] * (r - n))
            out_rows.extend(range(offset + n - k, offset + n))  # the wanted rows first, then the last repeated
            out_rows.extend([offset + n - 1] * (m - k))
            if tree is not None:
                tree_parts.extend(p - tree.base if p >= tree.base else -1 for p in tree.parents)
                tree_parts.extend([-1] * (size - (tree.end - tree.base)))
                tree_parts.append(tree.base)
            offset += r
        plan.metadata = ids + slots + positions + out_rows + tree_parts
        return plan

    def _padded_embeds(self, plan: _Plan, inputs_embeds: list[torch.Tensor]) -> torch.Tensor:
        """The input rows of every sequence, padded rows zero, in the residual stream's dtype: [total, hidden]."""
        parts = []
        for rows, count, embeds in zip(plan.rows, plan.counts, inputs_embeds):
            parts.append(embeds.to(device=self.device, dtype=self.weights.residual_dtype))
            if rows > count:
                parts.append(torch.zeros(rows - count, embeds.shape[-1], dtype=self.weights.residual_dtype,
                                         device=self.device))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _staged(self, plan: _Plan, into: torch.Tensor | None = None) -> torch.Tensor:
        """The plan's metadata on the device (in `into`, a graph's buffer, or a new tensor): one copy from pinned
        host memory that does not wait for the device, then the draft tokens already there."""
        host = torch.tensor(plan.metadata, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        if into is None:
            into = torch.empty(host.shape, dtype=torch.long, device=self.device)
        into.copy_(host, non_blocking=True)
        for offset, ids in plan.device_ids:
            into[offset: offset + ids.shape[0]].copy_(ids)
        return into

    def _tables(self, plan: _Plan) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The rope tables the forward gathers from, long enough for every slot it attends (built before a
        capture: a capture allocates nothing it must keep)."""
        end = max(plan.keys)
        return {kind: self._rope(kind, end) for kind in sorted({layer.rope for layer in self.weights.layers})}

    def _run(self, plan: _Plan, caches, embeds: torch.Tensor | None):
        """(logits [sum(outputs), V] or None, hidden [total, hidden] or None) of the plan: a replayed graph, a
        new capture, or an eager run."""
        tables = self._tables(plan)
        if not (self.capture_graphs and self.device.type == "cuda" and plan.total <= GRAPH_MAX_ROWS):
            return self._static_forward(plan, caches, self._staged(plan), embeds, tables)
        key = plan.key(caches)
        entry = self._graphs.get(key)
        if entry is None:
            if self._seen.get(key, "new") != "once":  # first sighting (or a failed capture): eagerly
                if key not in self._seen:
                    self._seen[key] = "once"  # a shape seen once is not worth a capture
                    while len(self._seen) > SIGHTINGS_KEPT:
                        self._seen.popitem(last=False)
                return self._static_forward(plan, caches, self._staged(plan), embeds, tables)
            try:
                entry = self._capture(plan, caches, embeds, tables)
            except RuntimeError as error:  # the warm-up wrote this step's keys: the eager run writes the same
                self._seen[key] = "failed"
                log.warning("%s: a CUDA graph capture failed, this shape runs eagerly (%s)", self.name,
                            str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
                return self._static_forward(plan, caches, self._staged(plan), embeds, tables)
            self._graphs[key] = entry
            while len(self._graphs) > GRAPHS_KEPT:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        self._staged(plan, entry.metadata)
        if embeds is not None:
            entry.embeds.copy_(embeds)
        entry.graph.replay()
        self.graph_replays += 1
        return entry.logits, entry.hidden

    def _capture(self, plan: _Plan, caches, embeds: torch.Tensor | None, tables) -> _Graph:
        """A CUDA graph of the plan's forward on these caches. Warmed up once on a side stream first, as torch asks
        (the warm-up computes this very step: it writes the same keys the replay then writes again)."""
        metadata = self._staged(plan)
        static_embeds = None if embeds is None else embeds.clone()
        device = self.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._static_forward(plan, caches, metadata, static_embeds, tables)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hidden = self._static_forward(plan, caches, metadata, static_embeds, tables)
        self.graph_captures += 1
        return _Graph(graph, metadata, static_embeds, logits, hidden, list(tables.values()))

    def _real_rows(self, rows: torch.Tensor | None, sizes: list[int], kept: list[int], width: int) -> torch.Tensor:
        """The first kept[i] of each sequence's sizes[i] rows of `rows`, copied (a graph's next replay overwrites
        its outputs): [sum(kept), width]."""
        if rows is None or sum(kept) == 0:
            return torch.zeros((0, width), dtype=torch.float32 if rows is None else rows.dtype, device=self.device)
        parts, offset = [], 0
        for size, keep in zip(sizes, kept):
            if keep:
                parts.append(rows[offset: offset + keep])
            offset += size
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts)

    # --- the device's part: one forward, every shape fixed by the plan ---
    def _static_forward(self, plan: _Plan, caches, metadata: torch.Tensor, embeds: torch.Tensor | None,
                        tables: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits [sum(outputs), V] or None, final-normed hidden rows [total, hidden] or None): device ops only,
        no host read, shapes from the plan alone."""
        w = self.weights
        total, wanted = plan.total, sum(plan.outputs)
        ids, slots = metadata[:total], metadata[total: 2 * total]
        positions = metadata[2 * total: 3 * total]
        out_rows = metadata[3 * total: 3 * total + wanted]
        cursor = 3 * total + wanted
        windows = sorted({layer.sliding_window for layer in w.layers}, key=lambda window: window or 0)
        group = w.num_heads // w.num_kv_heads
        bounds, masks = [0], []  # per sequence: its rows, and its mask per window (repeated for the query groups)
        for rows, keys, size in zip(plan.rows, plan.keys, plan.tree_sizes):
            lo = bounds[-1]
            bounds.append(lo + rows)
            tree = None
            if size:
                tree = (metadata[cursor: cursor + size], metadata[cursor + size: cursor + size + 1])
                cursor += size + 1
            masks.append({window: static_visibility(slots[lo: lo + rows], positions[lo: lo + rows], keys, window,
                                                    tree).repeat(group, 1) for window in windows})
        ropes = {kind: (cos.index_select(0, positions), sin.index_select(0, positions))
                 for kind, (cos, sin) in tables.items()}

        def attend(index: int, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = self._roped(qkv, layer, *ropes[layer.rope])
            parts = []
            for i, cache in enumerate(caches):
                lo, hi = bounds[i], bounds[i + 1]
                keys, values = cache.keys[index], cache.values[index]  # [Hkv, capacity + 1, d]
                keys.index_copy_(1, slots[lo:hi], k[lo:hi].transpose(0, 1).to(keys.dtype))
                values.index_copy_(1, slots[lo:hi], v[lo:hi].transpose(0, 1).to(values.dtype))
                parts.append(self._attention(q[lo:hi], keys[:, : plan.keys[i]], values[:, : plan.keys[i]],
                                             masks[i][layer.sliding_window]))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        x = embeds if embeds is not None else self._input_rows(ids)
        x = self._decoder_layers(x, attend)
        hidden = self._final_norm(x).to(w.dtype) if plan.hidden else None  # what an EAGLE head reads
        if wanted == 0:
            return None, hidden
        normed = self._final_norm(x.index_select(0, out_rows))  # the output head on the wanted rows only
        return self.output_logits(normed), hidden

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """SDPA of queries q [n, Hq, d] over keys/values [Hkv, L, d] under a bool mask [group * n, L] (the rows'
        mask repeated for each kv head's query group): [n, Hq * d]. A kv head's queries are the rows of one
        attention (no repeated keys)."""
        n, h_q, d = q.shape
        h_kv = keys.shape[0]
        group = h_q // h_kv
        q = q.reshape(n, h_kv, group, d).permute(1, 2, 0, 3).reshape(1, h_kv, group * n, d)
        out = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask,
                                             scale=self.weights.scale)  # [1, Hkv, group * n, d]
        return out.view(h_kv, group, n, d).permute(2, 0, 1, 3).reshape(n, h_q * d)

"""The torch reference runner: quickdraft's decoder on eager torch ops, on any device and dtype.

It runs where the CPU kernels do not (float32, CPUs without AVX512-BF16, QUICKDRAFT_NO_KERNELS=1, head sizes
the kernels do not take) and it is what the other backends are checked against: the CUDA runner's static path
(tests/models/test_cuda_graphs.py) and the transformers forward (tests/models/test_families.py). Every linear
layer, norm and activation takes the rows of all sequences at once; rotary embedding, the cache write and
attention run per sequence on its own cache: attention as two matmuls over the prefix with a float32 softmax,
under a causal, windowed or token-tree mask (models/tree_mask.py).
"""

from __future__ import annotations

import torch

from quickdraft.kv.static_cache import StaticSequenceCache
from quickdraft.models.decoder import DecoderRunner
from quickdraft.models.tree_mask import additive_mask, tree_positions, tree_visibility, visible_keys
from quickdraft.models.weights import Layer


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Queries q [n, Hq, d] over keys/values [Hkv, end, d] under an additive mask [n, end]: [n, Hq * d].
    Grouped-query attention without repeating keys: a kv head's queries are rows of one matmul."""
    n, h_q, d = q.shape
    h_kv, end = keys.shape[0], keys.shape[1]
    group = h_q // h_kv
    q = q.reshape(n, h_kv, group, d).permute(1, 2, 0, 3).reshape(h_kv, group * n, d)
    scores = (q @ keys.transpose(1, 2)).view(h_kv, group, n, end)
    probs = torch.add(mask, scores, alpha=scale).softmax(-1).to(q.dtype)  # float32 softmax
    attn = probs.view(h_kv, group * n, end) @ values
    return attn.view(h_kv, group, n, d).permute(2, 0, 1, 3).reshape(n, h_q * d)


class TorchRunner(DecoderRunner):
    """Eager torch ops over per-sequence caches [layers, Hkv, capacity, d]."""

    backend = "torch"
    cache_class = StaticSequenceCache

    def _layers(self, x, caches, starts, counts, trees) -> torch.Tensor:
        w = self.weights
        ends = [start + count for start, count in zip(starts, counts)]
        bounds = [0]  # rows of sequence i: bounds[i]:bounds[i + 1]
        for count in counts:
            bounds.append(bounds[-1] + count)
        trees = trees or [None] * len(caches)
        # The rows of each sequence's positions in the rope tables: its slots, or its tree's positions.
        rope_rows = [slice(start, end) if tree is None else tree_positions(tree)[start:].to(self.device)
                     for start, end, tree in zip(starts, ends, trees)]
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: list[dict[int | None, torch.Tensor]] = [{} for _ in caches]  # per sequence, per window

        def attend(index: int, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:
            if layer.rope not in ropes:  # the rows of every token's position: [num_tokens, head_dim]
                cos, sin = self._rope(layer.rope, max(ends))
                ropes[layer.rope] = (torch.cat([cos[rows] for rows in rope_rows]) if len(caches) > 1
                                     else cos[rope_rows[0]],
                                     torch.cat([sin[rows] for rows in rope_rows]) if len(caches) > 1
                                     else sin[rope_rows[0]])
            q, k, v = self._roped(qkv, layer, *ropes[layer.rope])
            parts = []
            for i, (cache, start, end, tree) in enumerate(zip(caches, starts, ends, trees)):
                lo, hi = bounds[i], bounds[i + 1]
                keys, values = cache.keys[index], cache.values[index]
                keys[:, start:end] = k[lo:hi].transpose(0, 1)
                values[:, start:end] = v[lo:hi].transpose(0, 1)
                window = layer.sliding_window
                if window not in masks[i]:
                    allowed = (tree_visibility(tree, start, window).to(self.device) if tree is not None
                               else visible_keys(torch.arange(start, end, device=self.device), end, window))
                    masks[i][window] = additive_mask(allowed)  # [rows, end]
                parts.append(attention(q[lo:hi], keys[:, :end], values[:, :end], masks[i][window], w.scale))
            return parts[0] if len(parts) == 1 else torch.cat(parts)  # [num_tokens, Hq * head_dim]

        return self._decoder_layers(x, attend)


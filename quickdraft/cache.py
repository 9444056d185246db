"""Per-sequence KV cache with O(1) rollback.

The cache holds the keys and values of the tokens in `token_ids`, position i for token i. Appending
happens inside the model's forward; rolling back rejected draft positions only shortens the cached
tensors (a view, no copy and no recomputation of the prefix).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class SequenceCache:
    def __init__(self) -> None:
        # No config on purpose: every layer, sliding-window ones included, keeps all its positions, so a
        # rollback never needs a key that a sliding window already evicted. Masks still apply the window.
        self.kv = self._new_kv()
        self._token_ids: list[int] = []
        self._pending: list[torch.Tensor] = []  # device tensors appended but not yet read back to the host
        self._num_pending = 0  # their tokens (len() is asked several times a step of every cache)
        # The length its sequence will likely reach, step rows included (0: unknown): a cache that grows by
        # copying may allocate toward it at once (kv.static_cache); others ignore it.
        self.length_hint = 0

    def _new_kv(self):
        """The structure that holds the keys and values (transformers' cache here; subclasses keep their own)."""
        return DynamicCache()

    def __len__(self) -> int:
        return len(self._token_ids) + self._num_pending

    @property
    def nbytes(self) -> int:
        """The bytes its tensors take now, as the scheduler measures them; transformers' growing cache is not
        measured (0), a native runner's preallocated one is (kv.static_cache.StaticSequenceCache)."""
        return 0

    @property
    def token_ids(self) -> list[int]:
        if self._pending:  # one forward's tokens as a rule: read without a concatenation (a step reads every cache)
            pending = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)
            self._token_ids.extend(pending.tolist())
            self._pending.clear()
            self._num_pending = 0
        return self._token_ids

    def record(self, tokens: torch.Tensor) -> None:
        """Note tokens whose keys and values the model just appended (kept on the device until needed)."""
        if tokens.dim() != 1:  # a feed's view is [n] already (this runs for every cache every step)
            tokens = tokens.reshape(-1)
        self._pending.append(tokens)
        self._num_pending += tokens.shape[0]

    def record_ids(self, token_ids: list[int]) -> None:
        """record() of tokens already on the host (a CPU runner reads a forward's ids once for every cache)."""
        if self._pending:
            self.token_ids  # noqa: B018 (the device tensors before them are read first, in order)
        self._token_ids.extend(token_ids)

    def rollback(self, length: int) -> None:
        """Forget every position >= length."""
        if length == len(self):  # nothing to drop (a plain step's, or an all-accepted chain's): no read of the ids
            return
        ids = self.token_ids
        if length < 0 or length > len(ids):
            raise ValueError(f"cannot roll back a cache of {len(ids)} positions to {length}")
        removed = len(ids) - length
        if removed:
            self._drop_kv(removed)
            del ids[length:]

    def _drop_kv(self, count: int) -> None:
        """Forget the keys and values of the last `count` positions."""
        self.kv.crop(-count)

    def compact(self, first: int, kept: list[int]) -> None:
        """After a token tree's verification: keep slots [0, first), move the slots `kept` (ascending, >= first:
        the accepted path) to first, first + 1, ..., and drop every other slot. A path's keys were computed at
        the positions they now hold (models.base.TreeAttention), so nothing is recomputed; where kept is
        already first.. it is a plain rollback (a chain)."""
        ids = self.token_ids
        if not 0 <= first <= len(ids) or any(not first <= s < len(ids) for s in kept) or \
                any(a >= b for a, b in zip(kept, kept[1:])):
            raise ValueError(f"compact: keep [0, {first}) and ascending slots in [{first}, {len(ids)}), got {kept}")
        moves = [(src, first + j) for j, src in enumerate(kept) if src != first + j]
        if moves:
            with torch.inference_mode():  # the caches are inference tensors (written inside the model's forward)
                self._move_kv([src for src, _ in moves], [dst for _, dst in moves])
            for src, dst in moves:
                ids[dst] = ids[src]
        self.rollback(first + len(kept))

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of slots src to slots dst (every dst < its src, all below len(self))."""
        s = torch.tensor(src)
        d = torch.tensor(dst)
        for layer in self.kv.layers:  # transformers' DynamicLayer: keys, values [batch, heads, length, head_dim]
            for t in (layer.keys, layer.values):
                t[:, :, d.to(t.device)] = t[:, :, s.to(t.device)]

    def sync(self, history: list[int]) -> int:
        """Roll back to the longest common prefix of the cached tokens and `history`; returns its length.
        The caller then feeds history[length:]."""
        ids = self.token_ids
        common = min(len(ids), len(history))
        if ids[:common] != history[:common]:  # a C-level compare; the loop below runs only on a mismatch
            common = next(i for i, (a, b) in enumerate(zip(ids, history)) if a != b)
        self.rollback(common)
        return common

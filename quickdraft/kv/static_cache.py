"""The native runner's per-sequence KV cache: preallocated tensors grown a block of 16 positions at a time.

`StaticSequenceCache`: a native runner's keys and values for one sequence in preallocated tensors, grown a
block of 16 positions (the packed key layout's unit) at a time; rollback is a length change. Under a KV budget
it is a `PoolGrantedCache`: it holds exactly what the pool granted.
"""

from __future__ import annotations

from typing import Any

import torch

from quickdraft.cache import SequenceCache
from quickdraft.kv.pool import BLOCK_SIZE, KVPool, PoolGrantedCache, round_up, runner_bytes_per_token


def block_views(keys: torch.Tensor, values: torch.Tensor, packed_keys: bool, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the keys and values of positions [16 index, 16 index + 16) (all layers and heads) of a cache's
    tensors."""
    lo, hi = index * BLOCK_SIZE, (index + 1) * BLOCK_SIZE
    return (keys[:, :, index] if packed_keys else keys[:, :, lo:hi]), values[:, :, lo:hi]


class StaticSequenceCache(SequenceCache, PoolGrantedCache):
    """A native runner's keys and values for one sequence in preallocated tensors [layers, kv_heads, capacity,
    head_dim] (keys packed [layers, kv_heads, capacity/16, head_dim/2, 16, 2] where the CPU kernels read
    them, in the runner's key_dtype: float16 beside a float32 residual stream), position i at index i. Rolling
    back only shortens the token list (SequenceCache.rollback): later writes overwrite the rejected positions.

    Growth is block-granular: the capacity is a multiple of 16 positions and grows by max(64 positions, 25%),
    capped at the runner's max_len, keeping the contents. Growing copies what the cache holds (at 64 sequences
    of a few hundred positions, about one such copy a step, ~0.5 ms of host time on a 2-core CPU), so with no
    budget a cache that knows the length its sequence will reach (`length_hint`: prompt + max_tokens + a step's
    rows) allocates up to it at once, at most HINT_AHEAD positions past what is needed. With a KV pool attached
    (the scheduler's memory budget) the hint is not used, since room held ahead is room another sequence
    cannot be admitted to; the cache asks the pool first and holds exactly what it granted: between what was
    asked for and the policy's size, or KVPoolFull."""

    BLOCK = BLOCK_SIZE
    HINT_AHEAD = 256  # positions a hint may allocate past the current need (max_tokens may be far from used)

    def __init__(self, runner: Any):  # a runner of quickdraft.models.decoder (it declares the layout)
        super().__init__()
        self._runner = runner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pool: KVPool | None = None  # granting this cache's growth; None: no budget
        # The prefix digests of its first full blocks (PrefixCache's bookkeeping; cut on rollback).
        self.block_digests: list[bytes] = []
        # Every digest a prefix cache registered as living here, a rollback's cut ones too (PrefixCache.adopt
        # drops the entries this cache no longer holds, so that they do not keep it alive).
        self.kept_digests: list[bytes] = []

    @property
    def runner(self) -> Any:
        return self._runner

    @property
    def capacity(self) -> int:
        return 0 if self.values is None else self.values.shape[2]

    @property
    def bytes_per_token(self) -> int:
        return runner_bytes_per_token(self._runner)

    @property
    def nbytes(self) -> int:
        """The bytes its tensors take now."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def attach_pool(self, pool: KVPool) -> None:
        if self.pool is not None and self.pool is not pool:
            raise ValueError("this cache already draws on another KV pool")
        self.pool = pool

    def reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        need = round_up(length, self.BLOCK)
        limit = max(round_up(self._runner.max_len, self.BLOCK), need)
        want = min(max(need, round_up(self.capacity + max(64, self.capacity // 4), self.BLOCK)), limit)
        if self.pool is not None:
            want = self.pool.grant(self, self.bytes_per_token, need, want)  # raises KVPoolFull below `need`
        elif self.length_hint > want:
            want = min(round_up(min(self.length_hint, need + self.HINT_AHEAD), self.BLOCK), limit)
        self._resize(want)

    def _allocate(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for `capacity` positions in the runner's layout, uninitialised (a subclass may allocate
        otherwise)."""
        r = self._runner
        shape = (r.num_layers, r.num_kv_heads, capacity, r.head_dim)
        values = torch.empty(shape, dtype=r.dtype, device=r.device)
        if r.packed_keys:  # each head's keys packed like a weight (see kernels/cpu_attention.cpp)
            keys = torch.empty((r.num_layers, r.num_kv_heads, capacity // 16, r.head_dim // 2, 16, 2),
                               dtype=r.key_dtype, device=r.device)
        else:
            keys = torch.empty(shape, dtype=r.dtype, device=r.device)
        return keys, values

    def _resize(self, capacity: int) -> None:
        r = self._runner
        keys, values = self._allocate(capacity)
        if self.keys is not None:
            used = len(self)
            filled = -(-used // 16) if r.packed_keys else used  # blocks of 16 positions, or positions
            keys[:, :, :filled] = self.keys[:, :, :filled]
            values[:, :, :used] = self.values[:, :, :used]
        self.keys, self.values = keys, values

    def release(self) -> None:
        """Drop every position and the tensors, and give the blocks back to the pool."""
        if self.pool is not None:
            self.pool.release(self)
        self.keys = self.values = None
        self._token_ids = []
        self._pending = []
        self._num_pending = 0
        self.block_digests = []
        self.kept_digests = []

    def block(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values of positions [16 index, 16 index + 16) (all layers and heads)."""
        return block_views(self.keys, self.values, self._runner.packed_keys, index)

    def read_block(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of positions [16 index, 16 index + 16) (all layers and heads)."""
        keys, values = self.block(index)
        return keys.clone(), values.clone()

    def write_blocks(self, blocks: list[tuple[torch.Tensor, torch.Tensor]], token_ids: list[int]) -> None:
        """Fill an empty cache with `blocks` (read_block's copies) as the positions of token_ids (16 per
        block). The caller reserved room for them."""
        if len(self) or len(token_ids) != len(blocks) * self.BLOCK or self.capacity < len(token_ids):
            raise ValueError("write_blocks: an empty cache with room for exactly the blocks' tokens")
        for index, (keys, values) in enumerate(blocks):
            lo, hi = index * self.BLOCK, (index + 1) * self.BLOCK
            if self._runner.packed_keys:
                self.keys[:, :, index] = keys
            else:
                self.keys[:, :, lo:hi] = keys
            self.values[:, :, lo:hi] = values
        self._token_ids = list(token_ids)

    def compact(self, first: int, kept: list[int]) -> None:
        super().compact(first, kept)  # checks its arguments before it changes anything
        del self.block_digests[first // self.BLOCK:]  # blocks from `first` on changed

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        s, d = torch.tensor(src, device=self.values.device), torch.tensor(dst, device=self.values.device)
        self.values[:, :, d] = self.values[:, :, s]
        if self._runner.packed_keys:  # position p at [:, :, p // 16, :, p % 16, :]
            self.keys[:, :, d // 16, :, d % 16] = self.keys[:, :, s // 16, :, s % 16]
        else:
            self.keys[:, :, d] = self.keys[:, :, s]

    def _new_kv(self) -> None:
        return None  # keys and values live in self.keys / self.values

    def _drop_kv(self, count: int) -> None:
        # Positions past the length are overwritten by the next writes; the blocks no longer full lose their digests.
        del self.block_digests[(len(self) - count) // self.BLOCK:]

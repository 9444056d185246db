"""A sequence's cache in a paged KV pool (kv/paged.py): the SequenceCache interface the engine, the drafts and the
scheduler use, over a PagedSequence (a block table into the pool that every sequence of the runner shares).

What the engine does to a cache maps onto the pool without copies: a forward appends slots (the runner asks for
them: `append`), a rejected draft is a rollback (a length change; blocks past the end go back to the pool), a
token tree's accepted path is compacted inside the sequence's own blocks, and finishing, aborting or preempting
a sequence frees its blocks (`release`; also when the cache is dropped without one: a finalizer frees them, so
a cache made and forgotten outside a scheduler leaks nothing). The scheduler reserves a step's blocks ahead
(`reserve`, KVPoolFull when the pool cannot), loads a kept prompt prefix by reference (`load_prefix`: the
sequence's table points at the kept blocks) and keeps the full blocks of committed tokens by their prefix
(`store_prefix`), through kv/memory.py.
"""

from __future__ import annotations

import weakref

import torch

from quickdraft.cache import SequenceCache
from quickdraft.kv.paged import PagedKVPool


class PagedSequenceCache(SequenceCache):
    """One sequence's slots in `pool` (see the module doc). Its tokens are SequenceCache's (every slot written,
    accepted or not); the pool's PagedSequence holds the table, the slots in use and the committed tokens that
    key prefix blocks."""

    def __init__(self, pool: PagedKVPool):
        super().__init__()
        self.pool = pool
        self.seq = pool.new_sequence()
        # A cache dropped without release (a tool's, a test's, an engine run's) gives its blocks back when collected.
        self._finalizer = weakref.finalize(self, pool.free, self.seq)

    def __len__(self) -> int:
        return self.seq.length

    @property
    def nbytes(self) -> int:
        """The bytes of the blocks its table holds (a block shared with other tables counted in each)."""
        return len(self.seq.blocks) * self.pool.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_block // self.pool.block_size

    # --- what the runner does ---
    def append(self, count: int) -> list[int]:
        """Slots for a forward's `count` new rows: their pool slot indices (KVPoolFull when the pool is out)."""
        return self.pool.append_slots(self.seq, count)

    # --- what the scheduler does ---
    def reserve(self, length: int) -> None:
        """Hold the blocks slots up to `length` need before a step writes them; KVPoolFull if the pool cannot."""
        self.pool.reserve(self.seq, length)

    def release(self) -> None:
        """Give every block back (finished, aborted or preempted): the cache is empty and may be refilled."""
        self.pool.free(self.seq)
        self._token_ids = []
        self._pending = []
        self._num_pending = 0

    def load_prefix(self, token_ids: list[int]) -> int:
        """Point the empty cache's table at the kept blocks of token_ids' longest kept prefix (no copy); returns the
        positions it then holds (at least the last token is left to compute)."""
        if len(self):
            return 0
        loaded = self.pool.match_prefix(self.seq, token_ids)
        self._token_ids = list(token_ids[:loaded])
        return loaded

    def store_prefix(self) -> None:
        """Commit the cached tokens (after a step they are all accepted): their full blocks are kept by prefix."""
        committed = len(self.seq.token_ids)
        ids = self.token_ids
        if len(ids) > committed:
            self.pool.commit(self.seq, ids[committed:])

    # --- SequenceCache ---
    def rollback(self, length: int) -> None:
        super().rollback(length)
        self.pool.rollback(self.seq, length)  # also returns blocks reserved past it

    def compact(self, first: int, kept: list[int]) -> None:
        ids = self.token_ids
        with torch.inference_mode():
            self.pool.compact(self.seq, first, kept)  # checks its arguments before it changes anything
        ids[:] = ids[:first] + [ids[slot] for slot in kept]

    def _new_kv(self) -> None:
        return None  # the pool holds the keys and values

    def _drop_kv(self, count: int) -> None:
        pass  # rollback returns the blocks

    # --- reading (tests, tools) ---
    @property
    def keys(self) -> torch.Tensor:
        """A copy of its keys in slot order, [layers, kv_heads, slots of its blocks, head_dim]."""
        return self._gathered(0)

    @property
    def values(self) -> torch.Tensor:
        return self._gathered(1)

    def _gathered(self, which: int) -> torch.Tensor:
        pool = self.pool
        blocks = torch.tensor(self.seq.blocks, dtype=torch.long, device=pool.kv.device)
        part = pool.kv[:, which].index_select(1, blocks)  # [layers, blocks, block_size, Hkv, d]
        return part.flatten(1, 2).transpose(1, 2)

"""A paged KV pool for a batch (issue 50): every layer's keys and values in fixed-size blocks of one tensor, a
block table per sequence (vLLM's PagedAttention layout), prompt prefixes shared by reference.

Layout: one tensor `kv` [num_layers, 2 (keys, values), num_blocks, block_size, kv_heads, head_dim], zeroed.
- One allocation: its address never changes, so a CUDA graph captures the per-layer views (`layer(i)`) once.
- Token-major pages ([block_size, kv_heads, head_dim]): a row's keys of every head are contiguous, so writing
  a step's new rows is one `index_copy_` into the flat view [num_blocks * block_size, kv_heads, head_dim] by a
  slot mapping (vLLM's reshape_and_cache), gathering a batch's pages for SDPA is one index by the block tables
  ([B, max_blocks, block_size, ...] viewed [B, max_len, ...] with no further copy), and FlexAttention reads the
  flat view in place (models/paged_attention.py).
- Layers outermost, keys/values second: copy-on-write and a tree's compaction move a block or slots of EVERY
  layer in one indexed copy.
Block 0 is the null block, never allocated: padded block-table entries and padded rows' slot mappings point
there, so a padded step is still a valid gather and write. Slots not holding a live token keep finite numbers
(zeroed at first, later a stale row): attention masks them, and a masked 0 x NaN would still be NaN.

Accounting. A block is in exactly one of three states: referenced (ref count > 0: the number of block tables
holding it), cached (ref 0, holding a full block of committed tokens kept by its prefix hash, evictable least
recently used first) or free. `num_free_blocks` counts free + cached: what an allocation can take now.
- Prefix sharing: a full block of committed tokens is keyed by a hash of its tokens chained with its prefix's
  hash (vLLM's prefix caching). `match_prefix` points a new sequence's table at the kept blocks (ref + 1); no
  copy. The prompt's last token is always computed (its logits are needed): a prompt that is all kept full
  blocks shares every block and recomputes only its last slot, which copies that one block on write.
- Copy-on-write: only a sequence's LAST block can be written (earlier slots are final), and only from the
  sequence's length on. Appending into a partial last block that another table also holds (a fork, or the
  prompt case above) copies it to a fresh block first; a last block held by this table alone but kept by its
  hash (it became partial by a rollback) is dropped from the hash index instead, with no copy (the slots
  written next would no longer be what its hash says).
- Rollback of rejected drafts is a length change plus returning the blocks past the new end; a tree's accepted
  path is compacted next to the prefix by copying those slots inside the sequence's own blocks.
- Abort, preemption and finishing `free` a sequence: each block's count drops, and blocks of committed full
  prefixes go to the cached list (tail first, so a prefix is evicted from its end) for a later prefix hit.
Whether a kept block holds what a fresh prefill would compute bitwise is the runner's property (rows computed
alike whatever the batch); the caller turns prefix sharing on only where it holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.kv.pool import BLOCK_SIZE, KVPoolFull

NULL_BLOCK = 0


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: its tokens chained with its prefix's key (b"" for the first block). A
    cryptographic digest, so that two different prefixes never share a key (a collision would be wrong keys and
    values, silently)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PagedSequence:
    """One sequence's view of the pool: its block table, the slots in use, and its committed tokens.

    `length`: slots [0, length) are in use (committed tokens, then slots written by the last step that are not
    yet accepted or rejected); the table holds ceil(length / block_size) blocks, and any reserved ahead for the
    next step (PagedKVPool.reserve). `token_ids`: the
    committed tokens, slot i holding token i (a prefix of the slots in use). `block_hashes`: the prefix keys of
    the full blocks of committed tokens."""

    __slots__ = ("blocks", "length", "token_ids", "block_hashes")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.length = 0
        self.token_ids: list[int] = []
        self.block_hashes: list[bytes] = []

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"PagedSequence(length={self.length}, committed={len(self.token_ids)}, blocks={self.blocks})"


class PagedKVPool:
    """The paged KV pool of one runner (see the module doc). Every method that allocates either succeeds or
    raises KVPoolFull having changed nothing."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if min(num_layers, num_kv_heads, head_dim, block_size) <= 0:
            raise QuickdraftError("PagedKVPool: layers, kv heads, head_dim and block_size must be > 0")
        if num_blocks < 2:
            raise QuickdraftError(f"PagedKVPool: {num_blocks} blocks; it needs the null block and at least one more "
                                  "(raise the KV budget)")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv = torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype,
                              device=device)
        self.ref_counts = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # popped from the end: 1, 2, ...
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, kept by hash; least recently used first
        self._hash_of: dict[int, bytes] = {}  # block -> its prefix key (referenced or cached)
        self._block_of: dict[bytes, int] = {}  # prefix key -> the block kept for it
        self.queried_tokens = 0  # prompt tokens looked up by match_prefix
        self.hit_tokens = 0  # of them, found in kept blocks
        self.evictions = 0
        self.copies_on_write = 0

    @staticmethod
    def blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, block_size: int = BLOCK_SIZE) -> int:
        """How many blocks (the null block included) `budget_bytes` holds."""
        per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return int(budget_bytes) // per_block

    # --- figures the scheduler's budget reads ---
    @property
    def total_blocks(self) -> int:
        """Blocks sequences can hold (every block but the null one)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks held by no sequence but kept for their prefix (evictable)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence, each counted once however many tables point at it."""
        return self.total_blocks - self.num_free_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def usage(self) -> dict[str, int]:
        return {"used_blocks": self.num_used_blocks, "cached_blocks": self.num_cached_blocks,
                "free_blocks": self.num_free_blocks, "total_blocks": self.total_blocks,
                "block_size": self.block_size, "used_bytes": self.num_used_blocks * self.bytes_per_block,
                "budget_bytes": self.total_blocks * self.bytes_per_block}

    def blocks_needed(self, seq: PagedSequence, count: int) -> int:
        """Blocks `append_slots(seq, count)` takes from num_free_blocks: the new blocks past the table's end, and
        one more where the partial last block is shared and is copied on write. Summed over a batch it is an upper
        bound: of two sequences sharing a partial last block (a fork), only the first to write copies it."""
        if count <= 0:
            return 0
        bs = self.block_size
        new = max(0, -(-(seq.length + count) // bs) - len(seq.blocks))  # blocks reserved ahead count as held
        return new + int(seq.length % bs != 0 and self.ref_counts[seq.blocks[seq.length // bs]] > 1)

    def prompt_blocks(self, token_ids: list[int]) -> int:
        """Blocks admitting a new sequence of `token_ids` (match_prefix, then append_slots for the rest) takes
        from num_free_blocks, as things stand: kept blocks it would revive from the cached list, new blocks for
        the rest, and the copy of a shared last block."""
        hits, length = self._prefix(token_ids)
        revived = sum(1 for block in hits if self.ref_counts[block] == 0)
        # The prompt is all kept blocks: its last block is written, a copy where another table holds it.
        copy = int(length % self.block_size != 0 and self.ref_counts[hits[-1]] > 0)
        return revived + -(-len(token_ids) // self.block_size) - len(hits) + copy

    # --- tensors ---
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of layer `index`'s keys and values, [num_blocks, block_size, kv_heads, head_dim] each."""
        return self.kv[index, 0], self.kv[index, 1]

    def slots(self, seq: PagedSequence, start: int, count: int) -> list[int]:
        """The pool-wide slot indices (block * block_size + offset) of the sequence's slots start..start+count-1."""
        if start < 0 or start + count > seq.length:
            raise ValueError(f"slots: [{start}, {start + count}) of a sequence of {seq.length} slots")
        bs = self.block_size
        return [seq.blocks[s // bs] * bs + s % bs for s in range(start, start + count)]

    def block_tables(self, seqs: list[PagedSequence | None], batch: int, width: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """[batch, width] int64 block tables of `seqs` (None: a padding sequence), padded with the null block."""
        if len(seqs) > batch or any(seq is not None and len(seq.blocks) > width for seq in seqs):
            raise ValueError(f"block_tables: {len(seqs)} sequences of up to "
                             f"{max((len(s.blocks) for s in seqs if s is not None), default=0)} blocks do not fit "
                             f"[{batch}, {width}]")
        rows = [(seq.blocks if seq is not None else []) for seq in seqs] + [[]] * (batch - len(seqs))
        table = torch.tensor([row + [NULL_BLOCK] * (width - len(row)) for row in rows], dtype=torch.long)
        return table.to(self.kv.device if device is None else device)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy pool slots `src` to pool slots `dst`, every layer's keys and values in one indexed copy."""
        if not src:
            return
        flat = self.kv.view(self.num_layers, 2, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        index = torch.tensor(src + dst, device=self.kv.device)
        s, d = index[:len(src)], index[len(src):]
        flat.index_copy_(2, d, flat.index_select(2, s))  # gathered first: overlapping src and dst are safe

    # --- sequences ---
    def new_sequence(self) -> PagedSequence:
        return PagedSequence()

    def match_prefix(self, seq: PagedSequence, token_ids: list[int]) -> int:
        """Point the empty `seq`'s table at the kept blocks of the longest kept prefix of token_ids (shared, no
        copy) and return the slots it then holds: the caller computes token_ids[result:]. At least the last
        token is left to compute; when every full block is kept and the prompt ends on a block boundary, the last
        block is shared too and its last slot is recomputed (copied on write)."""
        if seq.length or seq.blocks:
            raise ValueError("match_prefix: the sequence already holds slots; match before anything is written")
        self.queried_tokens += len(token_ids)
        hits, length = self._prefix(token_ids)
        if not length:
            return 0
        for block in hits:
            self._take(block)
        seq.blocks = hits
        seq.length = length
        seq.token_ids = list(token_ids[:length])
        seq.block_hashes = [self._hash_of[block] for block in hits[:length // self.block_size]]
        self.hit_tokens += length
        return length

    def reserve(self, seq: PagedSequence, length: int) -> None:
        """Hold, ahead of writing them, the blocks slots [length of seq, `length`) need (a scheduler reserves a
        step's room before the step, so that the step's writes cannot fail): the table grows past the slots in
        use and a shared partial last block is copied now. The reserved blocks are the sequence's until a
        rollback or free returns them. KVPoolFull, with nothing changed, when the pool cannot supply them."""
        if length <= seq.length:
            return
        need = self.blocks_needed(seq, length - seq.length)
        if need > self.num_free_blocks:
            raise KVPoolFull(f"the paged KV pool cannot supply {need} blocks ({self.num_free_blocks} of "
                             f"{self.total_blocks} free)")
        if seq.length % self.block_size:
            self._make_writable(seq, seq.length // self.block_size)
        while len(seq.blocks) * self.block_size < length:
            seq.blocks.append(self._allocate())

    def append_slots(self, seq: PagedSequence, count: int) -> list[int]:
        """Take slots [length, length + count) for a step's new rows (growing the table unless reserved, copying a
        shared last block on write) and return their pool slot indices (the slot mapping of those rows).
        KVPoolFull, with nothing changed, when the pool cannot supply blocks_needed(seq, count) blocks."""
        if count < 0:
            raise ValueError(f"append_slots: {count} slots")
        if count == 0:
            return []
        start = seq.length
        self.reserve(seq, start + count)
        seq.length = start + count
        return self.slots(seq, start, count)

    def commit(self, seq: PagedSequence, token_ids: list[int]) -> None:
        """The next len(token_ids) slots after the committed ones hold these accepted tokens: they become
        committed, and every block they fill is kept by its prefix key for later sequences (unless a block of
        the same key is already kept)."""
        first = len(seq.token_ids)
        if first + len(token_ids) > seq.length:
            raise ValueError(f"commit: {first} committed + {len(token_ids)} tokens exceed the {seq.length} slots "
                             "in use; append their slots first")
        seq.token_ids.extend(token_ids)
        bs = self.block_size
        for index in range(len(seq.block_hashes), len(seq.token_ids) // bs):
            key = block_hash(seq.block_hashes[-1] if index else b"", seq.token_ids[index * bs:(index + 1) * bs])
            seq.block_hashes.append(key)
            block = seq.blocks[index]
            if block in self._hash_of:  # a shared prompt block, kept under this very key
                if self._hash_of[block] != key:
                    raise RuntimeError(f"commit: block {block} is kept for another prefix")
                continue
            if key not in self._block_of:
                self._hash_of[block] = key
                self._block_of[key] = block

    def rollback(self, seq: PagedSequence, length: int) -> None:
        """Keep slots [0, length) and return the blocks past them: rejected drafts cost no copy. Committed
        tokens past `length` are uncommitted too (the sequence's history changed)."""
        if not 0 <= length <= seq.length:
            raise ValueError(f"rollback: to {length} slots from {seq.length}")
        seq.length = length
        del seq.token_ids[length:]
        del seq.block_hashes[length // self.block_size:]
        keep = -(-length // self.block_size)
        for block in reversed(seq.blocks[keep:]):
            self._release(block)
        del seq.blocks[keep:]

    def compact(self, seq: PagedSequence, first: int, kept: list[int]) -> None:
        """After a token tree's verification: keep slots [0, first), copy slots `kept` (ascending, >= first: the
        accepted path) to first, first + 1, .. inside the sequence's own blocks, and return the blocks past the
        new end. Those slots' keys were computed at the positions they now hold (models.base.TreeAttention)."""
        if not 0 <= first <= seq.length or any(not first <= s < seq.length for s in kept) or \
                any(a >= b for a, b in zip(kept, kept[1:])):
            raise ValueError(f"compact: keep [0, {first}) and ascending slots in [{first}, {seq.length}), got {kept}")
        moves = [(src, first + j) for j, src in enumerate(kept) if src != first + j]
        if moves:
            bs = self.block_size
            targets = sorted({dst // bs for _, dst in moves})
            copies = sum(self.ref_counts[seq.blocks[i]] > 1 for i in targets)
            if copies > self.num_free_blocks:
                raise KVPoolFull(f"compact: {copies} shared blocks to copy, {self.num_free_blocks} free")
            del seq.token_ids[first:]  # slots from `first` on change: no longer committed
            del seq.block_hashes[first // bs:]
            src_slots = [seq.blocks[s // bs] * bs + s % bs for s, _ in moves]  # before any copy on write
            for index in targets:
                self._make_writable(seq, index)
            self.copy_slots(src_slots, [seq.blocks[d // bs] * bs + d % bs for _, d in moves])
        self.rollback(seq, first + len(kept))

    def fork(self, seq: PagedSequence) -> PagedSequence:
        """A new sequence holding the same slots, every block shared (a block is copied when either writes to
        it): parallel samples of one prompt."""
        child = PagedSequence()
        used = seq.blocks[:-(-seq.length // self.block_size)]  # not the blocks reserved ahead
        for block in used:
            self._take(block)
        child.blocks = list(used)
        child.length = seq.length
        child.token_ids = list(seq.token_ids)
        child.block_hashes = list(seq.block_hashes)
        return child

    def free(self, seq: PagedSequence) -> None:
        """Return every block of `seq` (finished, aborted or preempted); blocks kept by their prefix stay cached,
        tail first in eviction order. The sequence is left empty and may be refilled."""
        self.rollback(seq, 0)

    # --- checks ---
    def audit(self, sequences: list[PagedSequence]) -> None:
        """Raise AssertionError unless the accounting holds for exactly these live sequences: every block's count
        is the number of tables holding it, every block is referenced, cached or free (one of them), the hash
        index and the tables agree, and every table covers its sequence's slots."""
        counts = [0] * self.num_blocks
        for seq in sequences:
            if len(seq.blocks) < -(-seq.length // self.block_size) or len(seq.token_ids) > seq.length or \
                    len(seq.block_hashes) != len(seq.token_ids) // self.block_size or NULL_BLOCK in seq.blocks or \
                    len(set(seq.blocks)) != len(seq.blocks):
                raise AssertionError(f"audit: inconsistent {seq!r} ({len(seq.block_hashes)} hashes)")
            for block in seq.blocks:
                counts[block] += 1
        if counts != self.ref_counts:
            wrong = [b for b in range(self.num_blocks) if counts[b] != self.ref_counts[b]]
            raise AssertionError(f"audit: ref counts of blocks {wrong} are {[self.ref_counts[b] for b in wrong]}, "
                                 f"tables hold them {[counts[b] for b in wrong]} times")
        free, cached = set(self._free), set(self._cached)
        referenced = {b for b in range(1, self.num_blocks) if counts[b]}
        if len(free) != len(self._free) or free & cached or (free | cached) & referenced or \
                free | cached | referenced != set(range(1, self.num_blocks)):
            raise AssertionError("audit: a block is not exactly one of referenced, cached and free")
        if any(block not in self._hash_of for block in cached) or any(block in free for block in self._hash_of) or \
                {self._block_of[key]: key for key in self._block_of} != self._hash_of:
            raise AssertionError("audit: the hash index disagrees with the blocks")

    # --- internals ---
    def _prefix(self, token_ids: list[int]) -> tuple[list[int], int]:
        """The kept blocks of the longest kept prefix of token_ids' full blocks that a new sequence would share,
        and the slots it would hold: all but at least the last token."""
        bs, parent, hits = self.block_size, b"", []
        for index in range(len(token_ids) // bs):
            parent = block_hash(parent, token_ids[index * bs:(index + 1) * bs])
            block = self._block_of.get(parent)
            if block is None:
                break
            hits.append(block)
        length = min(len(hits) * bs, max(len(token_ids) - 1, 0))
        return hits[:-(-length // bs)], length

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._cached[block]  # revived: no longer evictable
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None  # the most recently used end
            else:
                self._free.append(block)

    def _allocate(self) -> int:
        """A block for one table (count 1): a free one, else the least recently used cached one, evicted."""
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.evictions += 1
        else:
            raise KVPoolFull(f"the paged KV pool has no free block ({self.total_blocks} in use)")
        self.ref_counts[block] = 1
        return block

    def _make_writable(self, seq: PagedSequence, index: int) -> None:
        """Make table entry `index` a block only `seq` holds and no hash keeps: a shared block is copied (copy on
        write), a kept one held by this table alone leaves the hash index."""
        block = seq.blocks[index]
        if self.ref_counts[block] > 1:
            fresh = self._allocate()
            self.kv[:, :, fresh] = self.kv[:, :, block]
            self.ref_counts[block] -= 1
            seq.blocks[index] = fresh
            self.copies_on_write += 1
        elif block in self._hash_of:
            del self._block_of[self._hash_of.pop(block)]

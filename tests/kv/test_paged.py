"""The paged KV pool (quickdraft/kv/paged.py): blocks, tables, reference counts, prefix blocks shared by
reference, copy-on-write, rollback and tree compaction without copies, LRU eviction, and the counts a scheduler
budgets with; accounting checked after every event, and a seeded random run of events against a reference model
of the accounting written independently (token tuples for hashes, ticks for LRU, counts for free blocks)."""

from __future__ import annotations

import random

import pytest
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.kv import KVPoolFull
from quickdraft.kv.paged import NULL_BLOCK, PagedKVPool, PagedSequence

BS = 4  # small blocks: many block boundaries in short sequences


def _pool(num_blocks=16, block_size=BS, layers=2):
    return PagedKVPool(layers, 1, 2, num_blocks, block_size, dtype=torch.float64)


def _write(pool: PagedKVPool, seq: PagedSequence, start: int, tokens: list[int], positions: list[int] | None = None):
    """Write a fingerprint of (token, position, layer) into the slots start.. of seq, every layer."""
    positions = list(range(start, start + len(tokens))) if positions is None else positions
    slots = torch.tensor(pool.slots(seq, start, len(tokens)))
    for layer in range(pool.num_layers):
        keys, values = pool.layer(layer)
        rows = torch.tensor([[t, p + 100 * layer] for t, p in zip(tokens, positions)], dtype=torch.float64)
        keys.view(-1, 1, 2).index_copy_(0, slots, rows[:, None])
        values.view(-1, 1, 2).index_copy_(0, slots, rows[:, None] + 0.5)


def _read(pool: PagedKVPool, seq: PagedSequence) -> list[tuple[int, int]]:
    """(token, position) of every slot in use, checked alike in every layer's keys and values."""
    slots = torch.tensor(pool.slots(seq, 0, seq.length), dtype=torch.long)
    found = None
    for layer in range(pool.num_layers):
        keys, values = pool.layer(layer)
        k = keys.reshape(-1, 2)[slots]
        v = values.reshape(-1, 2)[slots]
        assert torch.equal(v, k + 0.5)
        rows = [(int(t), int(p) - 100 * layer) for t, p in k.tolist()]
        assert found is None or rows == found
        found = rows
    return found


def _prefill(pool, seq, tokens):
    """Admit `tokens`: share the kept prefix, compute (write) the rest, commit it all."""
    hit = pool.match_prefix(seq, tokens)
    pool.append_slots(seq, len(tokens) - hit)
    _write(pool, seq, hit, tokens[hit:])
    pool.commit(seq, tokens[len(seq.token_ids):])
    return hit


def test_append_grows_by_blocks_and_counts_hold():
    pool = _pool(num_blocks=8)
    assert (pool.total_blocks, pool.num_free_blocks, pool.num_used_blocks) == (7, 7, 0)
    seq = pool.new_sequence()
    assert pool.blocks_needed(seq, 5) == 2
    slots = pool.append_slots(seq, 5)
    assert len(seq.blocks) == 2 and NULL_BLOCK not in seq.blocks
    assert slots == [seq.blocks[0] * BS + i for i in range(4)] + [seq.blocks[1] * BS]
    assert pool.blocks_needed(seq, 3) == 0 and pool.blocks_needed(seq, 4) == 1
    assert (pool.num_used_blocks, pool.num_free_blocks) == (2, 5)
    pool.audit([seq])
    usage = pool.usage()
    assert usage["used_blocks"] == 2 and usage["used_bytes"] == 2 * pool.bytes_per_block
    assert pool.bytes_per_block == 2 * 2 * BS * 1 * 2 * 8  # layers x (k, v) x slots x heads x dim x float64


def test_a_refused_append_changes_nothing():
    pool = _pool(num_blocks=4)  # 3 usable
    seq = pool.new_sequence()
    pool.append_slots(seq, 6)
    before = (list(seq.blocks), seq.length, pool.num_free_blocks)
    with pytest.raises(KVPoolFull):
        pool.append_slots(seq, 7)  # needs 2 blocks, 1 free
    assert (list(seq.blocks), seq.length, pool.num_free_blocks) == before
    pool.append_slots(seq, 6)  # exactly what is left
    assert pool.num_free_blocks == 0
    pool.audit([seq])


def test_rollback_returns_trailing_blocks_without_copying():
    pool = _pool()
    seq = pool.new_sequence()
    tokens = list(range(10, 19))
    _prefill(pool, seq, tokens)  # 9 committed: blocks 0, 1 full, 2 partial
    pool.append_slots(seq, 5)  # K + 1 = 5 draft rows: slots 9..13, a 4th block
    _write(pool, seq, 9, [1, 2, 3, 4, 5])
    assert len(seq.blocks) == 4
    data = pool.kv.data_ptr()
    pool.rollback(seq, 10)  # one accepted
    pool.commit(seq, [1])
    assert seq.length == 10 and len(seq.blocks) == 3 and pool.num_used_blocks == 3
    assert pool.kv.data_ptr() == data and pool.copies_on_write == 0
    assert _read(pool, seq) == [(t, p) for p, t in enumerate(tokens + [1])]
    pool.audit([seq])


def test_a_shared_prefix_is_held_once_by_reference():
    pool = _pool(num_blocks=16)
    prompt = list(range(1, 11))  # 2 full blocks + 2
    first, second = pool.new_sequence(), pool.new_sequence()
    assert _prefill(pool, first, prompt) == 0
    used = pool.num_used_blocks
    other = prompt[:8] + [50, 51, 52]
    assert pool.prompt_blocks(other) == 1  # the two full blocks are shared, one new block for 3 tokens
    assert _prefill(pool, second, other) == 8
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert pool.ref_counts[first.blocks[0]] == pool.ref_counts[first.blocks[1]] == 2
    assert pool.num_used_blocks == used + 1  # shared blocks counted once
    assert _read(pool, second) == [(t, p) for p, t in enumerate(other)]
    assert (pool.queried_tokens, pool.hit_tokens) == (len(prompt) + len(other), 8)
    pool.audit([first, second])
    pool.free(first)  # its own last block returns; the shared ones stay with second
    assert pool.num_used_blocks == 3 and pool.num_cached_blocks == 0
    pool.free(second)  # the full blocks of committed tokens stay cached, the partial ones are free
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 2 and pool.num_free_blocks == pool.total_blocks
    pool.audit([])


def test_a_prompt_of_kept_blocks_shares_its_last_block_and_copies_it_on_write():
    pool = _pool()
    prompt = list(range(20, 28))  # exactly 2 blocks
    first, second = pool.new_sequence(), pool.new_sequence()
    _prefill(pool, first, prompt)
    assert pool.prompt_blocks(prompt) == 1  # the copy of the shared last block
    assert pool.match_prefix(second, prompt) == 7  # the last token is computed: its logits are needed
    assert second.blocks == first.blocks and pool.blocks_needed(second, 1) == 1
    pool.append_slots(second, 1)  # writes slot 7 of a block first holds: copy on write
    assert pool.copies_on_write == 1 and second.blocks[0] == first.blocks[0] and second.blocks[1] != first.blocks[1]
    _write(pool, second, 7, [99])  # a different value than first's slot 7: first must not see it
    pool.commit(second, [27])
    assert _read(pool, first) == [(t, p) for p, t in enumerate(prompt)]
    assert _read(pool, second) == [(t, p) for p, t in enumerate(prompt[:7])] + [(99, 7)]
    pool.audit([first, second])


def test_a_kept_block_held_alone_leaves_the_index_when_written_no_copy():
    pool = _pool()
    prompt = list(range(30, 38))
    first, second = pool.new_sequence(), pool.new_sequence()
    _prefill(pool, first, prompt)
    pool.free(first)  # both blocks cached
    assert pool.prompt_blocks(prompt) == 2  # both revived from the cached list, no copy: second holds them alone
    assert pool.match_prefix(second, prompt) == 7 and pool.num_cached_blocks == 0
    pool.append_slots(second, 1)
    assert pool.copies_on_write == 0
    _write(pool, second, 7, [37])
    pool.commit(second, [37])  # full again: kept under its key again
    third = pool.new_sequence()
    assert pool.match_prefix(third, prompt + [1]) == 8
    pool.audit([second, third])


def test_fork_shares_every_block_and_copies_the_partial_one_on_write():
    pool = _pool()
    parent = pool.new_sequence()
    _prefill(pool, parent, [1, 2, 3, 4, 5, 6])
    child = pool.fork(parent)
    assert child.blocks == parent.blocks and pool.num_used_blocks == 2
    assert pool.blocks_needed(child, 1) == 1 and pool.blocks_needed(child, 3) == 2
    pool.append_slots(child, 1)
    _write(pool, child, 6, [7])
    pool.append_slots(parent, 1)  # parent's last block is its alone now: no second copy
    _write(pool, parent, 6, [8])
    assert pool.copies_on_write == 1 and child.blocks[0] == parent.blocks[0]
    assert _read(pool, parent)[-1] == (8, 6) and _read(pool, child)[-1] == (7, 6)
    pool.audit([parent, child])


def test_compaction_copies_the_accepted_path_next_to_the_prefix_and_frees_the_rest():
    pool = _pool()
    seq = pool.new_sequence()
    _prefill(pool, seq, [5, 6, 7, 8, 9, 10])  # base 6
    # tree: nodes at slots 6..12 with parents (root = slot 5); accepted path 6 -> 8 -> 11 -> 12
    parents = [5, 5, 6, 6, 7, 8, 11]
    tokens = [20, 21, 22, 23, 24, 25, 26]
    depth = {5: 0}
    for slot, parent in enumerate(parents, 6):
        depth[slot] = depth[parent] + 1
    pool.append_slots(seq, 7)
    _write(pool, seq, 6, tokens, [5 + depth[s] for s in range(6, 13)])
    assert len(seq.blocks) == 4
    pool.compact(seq, 6, [6, 8, 11, 12])
    pool.commit(seq, [20, 22, 25, 26])
    assert seq.length == 10 and len(seq.blocks) == 3 and pool.num_used_blocks == 3
    assert _read(pool, seq) == [(t, p) for p, t in enumerate([5, 6, 7, 8, 9, 10, 20, 22, 25, 26])]
    pool.audit([seq])
    with pytest.raises(ValueError):
        pool.compact(seq, 6, [8, 7])


def test_compaction_into_a_shared_block_copies_it_first():
    pool = _pool()
    seq = pool.new_sequence()
    _prefill(pool, seq, [1, 2, 3])
    pool.append_slots(seq, 4)  # tree slots 3..6
    _write(pool, seq, 3, [10, 11, 12, 13], [3, 3, 4, 5])
    twin = pool.fork(seq)  # shares both blocks, whose slots 3 and 4 the compaction overwrites
    pool.compact(seq, 3, [4, 5])
    assert pool.copies_on_write == 2 and not set(twin.blocks) & set(seq.blocks)
    assert _read(pool, twin) == [(1, 0), (2, 1), (3, 2), (10, 3), (11, 3), (12, 4), (13, 5)]
    assert _read(pool, seq) == [(1, 0), (2, 1), (3, 2), (11, 3), (12, 4)]
    pool.audit([seq, twin])


def test_cached_blocks_are_evicted_least_recently_used_first_and_tail_first():
    pool = _pool(num_blocks=7)  # 6 usable
    old, new = list(range(100, 108)), list(range(200, 208))
    for prompt in (old, new):
        seq = pool.new_sequence()
        _prefill(pool, seq, prompt)
        pool.free(seq)
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 6
    seq = pool.new_sequence()
    pool.append_slots(seq, 4 * 3)  # 2 free blocks, then old's tail block, then old's head block
    assert pool.evictions == 1
    probe = pool.new_sequence()
    assert pool.match_prefix(probe, old + [1]) == 4 and pool.match_prefix(pool.new_sequence(), new + [1]) == 8
    pool.free(probe)
    pool.append_slots(seq, 4)  # evicts old's head
    assert pool.match_prefix(pool.new_sequence(), old + [1]) == 0


def test_abort_and_preemption_return_every_block():
    pool = _pool()
    seqs = [pool.new_sequence() for _ in range(3)]
    _prefill(pool, seqs[0], list(range(9)))
    _prefill(pool, seqs[1], list(range(9)))  # shares 2 blocks
    seqs[2] = pool.fork(seqs[1])
    pool.append_slots(seqs[2], 5)
    pool.audit(seqs)
    for seq in seqs:
        pool.free(seq)
        assert seq.length == 0 and seq.blocks == [] and seq.token_ids == []
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.total_blocks
    pool.audit([])


def test_audit_catches_a_broken_count_and_bad_arguments_are_refused():
    pool = _pool()
    seq = pool.new_sequence()
    pool.append_slots(seq, 3)
    pool.ref_counts[seq.blocks[0]] += 1
    with pytest.raises(AssertionError, match="ref counts"):
        pool.audit([seq])
    pool.ref_counts[seq.blocks[0]] -= 1
    with pytest.raises(ValueError):
        pool.rollback(seq, 4)
    with pytest.raises(ValueError):
        pool.commit(seq, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        pool.match_prefix(seq, [1, 2, 3])
    with pytest.raises(QuickdraftError):
        PagedKVPool(1, 1, 2, 1)


def test_budget_sizing_and_block_tables():
    blocks = PagedKVPool.blocks_for_budget(10_000, 2, 1, 2, torch.float64, BS)
    assert blocks == 10_000 // (2 * 2 * BS * 2 * 8)
    pool = _pool()
    seq = pool.new_sequence()
    pool.append_slots(seq, 6)
    table = pool.block_tables([seq, None], 4, 3)
    assert table.tolist() == [seq.blocks + [NULL_BLOCK], [NULL_BLOCK] * 3, [NULL_BLOCK] * 3, [NULL_BLOCK] * 3]
    with pytest.raises(ValueError):
        pool.block_tables([seq], 1, 1)


# --- a seeded random run against a reference model of the accounting ---

class _Block:
    """The model's block: who holds it, the prefix it is kept for (a tuple of tokens), when it was released."""

    def __init__(self):
        self.refs = 1
        self.key: tuple | None = None
        self.released = 0


class _Model:
    """The accounting by its definition, written apart from the pool: kept prefixes keyed by their token tuples,
    LRU by release ticks, free blocks by count."""

    def __init__(self, total: int, bs: int):
        self.total, self.bs = total, bs
        self.blocks: set[_Block] = set()  # referenced or cached
        self.index: dict[tuple, _Block] = {}
        self.tick = 0
        self.tables: dict[int, list[_Block]] = {}
        self.lengths: dict[int, int] = {}
        self.committed: dict[int, list[int]] = {}
        self.contents: dict[int, list[tuple[int, int]]] = {}  # (token, position) of every slot in use

    def cached(self) -> list[_Block]:
        return [b for b in self.blocks if b.refs == 0]

    def free(self) -> int:
        return self.total - len(self.blocks) + len(self.cached())

    def _allocate(self) -> _Block:
        if len(self.blocks) == self.total:
            victim = min(self.cached(), key=lambda b: b.released)
            self.blocks.remove(victim)
            del self.index[victim.key]
        block = _Block()
        self.blocks.add(block)
        return block

    def _release(self, block: _Block) -> None:
        block.refs -= 1
        if block.refs == 0:
            self.tick += 1
            block.released = self.tick
            if block.key is None:
                self.blocks.remove(block)

    def _writable(self, sid: int, index: int) -> None:
        block = self.tables[sid][index]
        if block.refs > 1:
            block.refs -= 1
            self.tables[sid][index] = self._allocate()
        elif block.key is not None:
            del self.index[block.key]
            block.key = None

    def hits(self, tokens: list[int]) -> tuple[list[_Block], int]:
        found = []
        for end in range(self.bs, len(tokens) + 1, self.bs):
            block = self.index.get(tuple(tokens[:end]))
            if block is None:
                break
            found.append(block)
        length = min(len(found) * self.bs, max(len(tokens) - 1, 0))
        return found[:-(-length // self.bs)], length

    def prompt_blocks(self, tokens: list[int]) -> int:
        found, length = self.hits(tokens)
        copy = length % self.bs != 0 and found[-1].refs > 0
        return sum(b.refs == 0 for b in found) + -(-len(tokens) // self.bs) - len(found) + copy

    def admit(self, sid: int, tokens: list[int]) -> int:
        found, length = self.hits(tokens)
        for block in found:
            block.refs += 1
        self.tables[sid] = list(found)
        self.lengths[sid] = length
        self.committed[sid] = list(tokens[:length])
        self.contents[sid] = [(t, p) for p, t in enumerate(tokens[:length])]
        return length

    def needed(self, sid: int, count: int) -> int:
        length, table = self.lengths[sid], self.tables[sid]
        return -(-(length + count) // self.bs) - len(table) + (length % self.bs != 0 and table[-1].refs > 1)

    def append(self, sid: int, count: int) -> None:
        if self.lengths[sid] % self.bs:
            self._writable(sid, len(self.tables[sid]) - 1)
        while len(self.tables[sid]) * self.bs < self.lengths[sid] + count:
            self.tables[sid].append(self._allocate())
        self.lengths[sid] += count

    def commit(self, sid: int, tokens: list[int]) -> None:
        before = len(self.committed[sid])
        self.committed[sid] += tokens
        ids = self.committed[sid]
        for end in range((before // self.bs + 1) * self.bs, len(ids) + 1, self.bs):
            block, key = self.tables[sid][end // self.bs - 1], tuple(ids[:end])
            if block.key is None and key not in self.index:
                block.key = key
                self.index[key] = block

    def rollback(self, sid: int, length: int) -> None:
        self.lengths[sid] = length
        del self.committed[sid][length:]
        del self.contents[sid][length:]
        keep = -(-length // self.bs)
        for block in reversed(self.tables[sid][keep:]):
            self._release(block)
        del self.tables[sid][keep:]

    def compact(self, sid: int, first: int, kept: list[int]) -> None:
        contents = self.contents[sid]
        targets = sorted({(first + j) // self.bs for j, s in enumerate(kept) if s != first + j})
        for index in targets:
            self._writable(sid, index)
        moved = [contents[s] for s in kept]
        contents[first:first + len(kept)] = moved
        self.rollback(sid, first + len(kept))

    def fork(self, sid: int, child: int) -> None:
        for block in self.tables[sid]:
            block.refs += 1
        self.tables[child] = list(self.tables[sid])
        self.lengths[child] = self.lengths[sid]
        self.committed[child] = list(self.committed[sid])
        self.contents[child] = list(self.contents[sid])

    def remove(self, sid: int) -> None:
        self.rollback(sid, 0)
        for table in (self.tables, self.lengths, self.committed, self.contents):
            del table[sid]


def _check(pool: PagedKVPool, model: _Model, seqs: dict[int, PagedSequence], identity: dict[_Block, int]) -> None:
    """The pool agrees with the model: counts, lengths, committed tokens, the contents of every slot, and the
    sharing structure (the model's blocks and the pool's in a one-to-one correspondence, kept across events)."""
    pool.audit(list(seqs.values()))
    assert pool.num_free_blocks == model.free()
    assert pool.num_cached_blocks == len(model.cached())
    assert pool.num_used_blocks == model.total - model.free()
    live = set(model.blocks)
    for block in [b for b in identity if b not in live]:
        del identity[block]
    for sid, seq in seqs.items():
        assert seq.length == model.lengths[sid] and seq.token_ids == model.committed[sid]
        for block, pool_block in zip(model.tables[sid], seq.blocks):
            assert identity.setdefault(block, pool_block) == pool_block
        assert _read(pool, seq) == model.contents[sid]
    assert len(set(identity.values())) == len(identity)


def _random_run(seed: int, events: int = 300) -> tuple[PagedKVPool, dict[str, int]]:
    """Seeded random events on a pool and the model, checked against each other after every one."""
    rng = random.Random(seed)
    pool = _pool(num_blocks=rng.choice([12, 20, 40]), layers=1)
    model = _Model(pool.total_blocks, BS)
    bases = [[rng.randrange(6) for _ in range(24)] for _ in range(2)]
    seqs: dict[int, PagedSequence] = {}
    identity: dict[_Block, int] = {}
    next_id = 0
    counts = dict.fromkeys(["admit", "refused", "step", "tree", "fork", "sync", "free", "hit"], 0)

    def write(sid, start, tokens, positions):
        _write(pool, seqs[sid], start, tokens, positions)
        model.contents[sid] += list(zip(tokens, positions))

    def append(sid, count) -> bool:
        """Slots for `count` rows, or (refused exactly when the model says they do not fit) preemption."""
        assert pool.blocks_needed(seqs[sid], count) == model.needed(sid, count)
        if model.needed(sid, count) > model.free():
            with pytest.raises(KVPoolFull):
                pool.append_slots(seqs[sid], count)
            counts["refused"] += 1
            pool.free(seqs.pop(sid))
            model.remove(sid)
            return False
        pool.append_slots(seqs[sid], count)
        model.append(sid, count)
        return True

    def commit(sid, tokens):
        pool.commit(seqs[sid], tokens)
        model.commit(sid, tokens)

    for _ in range(events):
        event = rng.choice(["admit", "admit", "step", "step", "step", "tree", "tree", "fork", "sync", "free"])
        if event != "admit" and not seqs:
            continue
        sid = rng.choice(sorted(seqs)) if seqs else None
        if event == "admit":
            base = rng.choice(bases)
            tokens = base[:rng.randrange(1, len(base))] + [rng.randrange(6) for _ in range(rng.randrange(0, 6))]
            assert pool.prompt_blocks(tokens) == model.prompt_blocks(tokens)
            sid, next_id = next_id, next_id + 1
            seqs[sid] = pool.new_sequence()
            hit = pool.match_prefix(seqs[sid], tokens)
            assert hit == model.admit(sid, tokens)
            counts["hit"] += hit > 0
            if append(sid, len(tokens) - hit):
                write(sid, hit, tokens[hit:], list(range(hit, len(tokens))))
                commit(sid, tokens[hit:])
        elif event in ("step", "tree"):
            length, size = model.lengths[sid], rng.randrange(1, 6)
            if length < 1 or not append(sid, size):
                continue
            tokens = [rng.randrange(6) for _ in range(size)]
            if event == "step":  # a chain of K + 1 rows; a prefix of it accepted, the rest rolled back
                write(sid, length, tokens, list(range(length, length + size)))
                accepted = rng.randrange(1, size + 1)
                pool.rollback(seqs[sid], length + accepted)
                model.rollback(sid, length + accepted)
                commit(sid, tokens[:accepted])
            else:  # a token tree; one root-to-node path accepted, compacted next to the prefix
                parents = [rng.randrange(length - 1, length + i) for i in range(size)]
                depth = {length - 1: 0}
                for slot, parent in enumerate(parents, length):
                    depth[slot] = depth[parent] + 1
                write(sid, length, tokens, [length - 1 + depth[s] for s in range(length, length + size)])
                path, node = [], rng.randrange(length, length + size)
                while node >= length:
                    path.append(node)
                    node = parents[node - length]
                path.reverse()
                pool.compact(seqs[sid], length, path)
                model.compact(sid, length, path)
                commit(sid, [tokens[s - length] for s in path])
        elif event == "fork":
            child, next_id = next_id, next_id + 1
            seqs[child] = pool.fork(seqs[sid])
            model.fork(sid, child)
        elif event == "sync":  # the history changed below the committed tokens
            length = rng.randrange(0, model.lengths[sid] + 1)
            pool.rollback(seqs[sid], length)
            model.rollback(sid, length)
        else:  # finished, aborted or preempted
            pool.free(seqs.pop(sid))
            model.remove(sid)
        counts[event] += 1
        _check(pool, model, seqs, identity)
    for sid in list(seqs):
        pool.free(seqs.pop(sid))
        model.remove(sid)
    _check(pool, model, seqs, identity)
    return pool, counts


@pytest.mark.parametrize("seed", range(8))
def test_random_events_keep_the_accounting_of_a_reference_model(seed):
    pool, counts = _random_run(seed)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.total_blocks  # nothing leaked
    assert all(counts[event] for event in ("admit", "step", "tree", "fork", "sync", "free", "hit")), counts


def test_the_random_runs_copy_on_write_evict_and_refuse():
    """The seeded runs reach the rare events too: copies on write, evictions and refused steps."""
    copies = evictions = refused = 0
    for seed in range(8):
        pool, counts = _random_run(seed, events=120)
        copies, evictions, refused = copies + pool.copies_on_write, evictions + pool.evictions, \
            refused + counts["refused"]
    assert copies and evictions and refused, (copies, evictions, refused)


def test_reserve_holds_a_steps_blocks_ahead_and_rollback_returns_them():
    pool = _pool(num_blocks=6)  # 5 blocks of 4
    seq = pool.new_sequence()
    _prefill(pool, seq, [1, 2, 3, 4, 5, 6])  # 2 blocks
    pool.reserve(seq, 6 + 5)  # 11 slots: a third block, ahead of writing
    assert len(seq.blocks) == 3 and seq.length == 6 and pool.num_free_blocks == 2
    pool.audit([seq])
    free = pool.num_free_blocks
    pool.append_slots(seq, 5)  # within the reservation: nothing taken
    _write(pool, seq, 6, [7, 8, 9, 10, 11])
    assert pool.num_free_blocks == free and len(seq.blocks) == 3
    pool.rollback(seq, 7)  # rejected drafts: the reserved block past them goes back
    assert len(seq.blocks) == 2 and pool.num_free_blocks == 3
    other = pool.new_sequence()
    with pytest.raises(KVPoolFull):
        pool.reserve(other, 4 * 4)  # 4 blocks of 3 free
    assert other.blocks == [] and pool.num_free_blocks == 3
    child = pool.fork(seq)  # the partial last block is shared now: reserving copies it at once
    pool.reserve(child, 8)
    assert child.blocks[1] != seq.blocks[1] and child.blocks[0] == seq.blocks[0] and pool.copies_on_write == 1
    assert _read(pool, child) == _read(pool, seq)
    pool.audit([seq, child])
    pool.free(child)
    pool.free(seq)
    pool.audit([])

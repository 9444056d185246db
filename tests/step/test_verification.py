"""step/verification.py: the batch's rules as tensors equal each sequence's rule alone, bit for bit.

Each test builds a step's rows by hand (random logits, drafts of several lengths, greedy, seeded and sampled
sequences, token trees) and checks the batched result against the per-sequence rules of verify.py and
verify_tree.py, which the exactness tests enumerate."""

from __future__ import annotations

import pytest
import torch

from quickdraft import sampling, verify, verify_tree
from quickdraft.params import SamplingParams
from quickdraft.sequence import Sequence
from quickdraft.step.verification import StepVerdict, process_rows, reads_argmax_only, verify_batch
from quickdraft.step_batch import StepBatch
from quickdraft.token_tree import ChildSelection, TokenTree

V = 11
CPU = torch.device("cpu")


def _seq(params: SamplingParams, prompt=(1, 2, 3), generator=None, noise_key=None, table=None) -> Sequence:
    seq = Sequence(list(prompt), params, generator, CPU, V, noise_key)
    if params.uses_penalties:
        seq.penalties = sampling.PenaltyHistory(seq.token_ids, V, CPU, table)
    return seq


def _batch(drafts, probs=None, trees=None) -> StepBatch:
    return StepBatch.build([torch.tensor(d, dtype=torch.long) for d in drafts], probs or [None] * len(drafts), trees)


def test_greedy_chains_of_several_lengths_take_each_sequences_own_rows():
    gen = torch.Generator().manual_seed(0)
    drafts = [[], [3, 1, 4], [5, 9], [2]]
    batch = _batch(drafts)
    logits = torch.randn(batch.num_rows, V, generator=gen)
    # Make sequence 1 accept two drafts, sequence 2 all of its drafts.
    lo1, lo2 = batch.rows(1)[0], batch.rows(2)[0]
    logits[lo1, 3] = logits[lo1 + 1, 1] = 50.0
    logits[lo2, 5] = logits[lo2 + 1, 9] = 50.0
    seqs = [_seq(SamplingParams(temperature=0)) for _ in drafts]
    verdicts = verify_batch(seqs, process_rows(seqs, logits, batch), batch).to_host()
    target = logits.argmax(-1)
    for i, verdict in enumerate(verdicts):
        lo, hi = batch.rows(i)
        n, token = verify.greedy_accept(target[lo:hi], torch.tensor(drafts[i], dtype=torch.long), [len(drafts[i])])
        assert verdict.num_accepted == int(n) and verdict.tokens == drafts[i][:int(n)] + [int(token)]
        assert verdict.nodes == list(range(int(n)))
    assert [v.num_accepted for v in verdicts] == [0, 2, 2, 0]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_chains_verified_on_the_host_equal_the_tensor_path(seed):
    """On the CPU a step of greedy chains is verified on the host (_greedy_chains_on_host): the same verdicts as
    the tensor path, from the logits or the runner's argmax, on batches where drafts often match their rows."""
    gen = torch.Generator().manual_seed(seed)
    size = 1 + seed * 3
    lengths = torch.randint(0, 6, (size,), generator=gen).tolist()
    drafts = [torch.randint(0, 3, (k,), generator=gen).tolist() for k in lengths]  # 3 tokens: many matches
    batch = _batch(drafts)
    logits = torch.randn(batch.num_rows, V, generator=gen)
    logits[:, :3] += 2.0  # the argmax mostly among the drafts' tokens
    for i, draft in enumerate(drafts):
        if draft and i % 2 == 0:  # every other chain accepts its first draft at least
            logits[batch.rows(i)[0], draft[0]] = 50.0
    seqs = [_seq(SamplingParams(temperature=0)) for _ in drafts]
    processed = process_rows(seqs, logits, batch)
    on_host = verify_batch(seqs, processed, batch)
    assert on_host.verdicts is not None  # the host path was taken
    expected = verify_batch(seqs, processed, batch, on_host=False).to_host()
    assert on_host.to_host() == expected
    assert verify_batch(seqs, None, batch, target=logits.argmax(-1)).to_host() == expected
    assert all(v.num_accepted >= 1 for i, v in enumerate(expected) if drafts[i] and i % 2 == 0)


def test_rejection_sampled_chains_equal_each_sequence_verified_alone_with_its_own_generator():
    """A batch mixing sampled chains with a draft's q, deterministic drafts and none: each sequence's result is
    what verify.rejection_sample gives it alone with a generator in the same state (its draws are its own)."""
    gen = torch.Generator().manual_seed(1)
    drafts = [[3, 1, 4], [], [5, 9], [2, 2, 7, 1]]
    qs = [torch.softmax(torch.randn(3, V, generator=gen), -1), None, None,
          torch.softmax(torch.randn(4, V, generator=gen), -1)]
    batch = _batch(drafts, qs)
    logits = torch.randn(batch.num_rows, V, generator=gen) * 2
    params = SamplingParams(temperature=0.9, top_k=6)
    for seed in range(20):
        seqs = [_seq(params, generator=torch.Generator().manual_seed(seed * 10 + i)) for i in range(len(drafts))]
        processed = process_rows(seqs, logits, batch)
        verdicts = verify_batch(seqs, processed, batch).to_host()
        for i, verdict in enumerate(verdicts):
            lo, hi = batch.rows(i)
            q = None if qs[i] is None else qs[i][None]
            n, token = verify.rejection_sample(processed[lo:hi][None], q, torch.tensor([drafts[i]], dtype=torch.long),
                                               torch.Generator().manual_seed(seed * 10 + i))
            assert verdict.num_accepted == int(n) and verdict.tokens == drafts[i][:int(n)] + [int(token)]


def test_seeded_chains_match_the_targets_noise_keyed_draws():
    gen = torch.Generator().manual_seed(2)
    drafts = [[3, 1], [4, 4, 4]]
    batch = _batch(drafts)
    logits = torch.randn(batch.num_rows, V, generator=gen)
    seqs = [_seq(SamplingParams(temperature=0.7), noise_key=key) for key in (5, 6)]
    processed = process_rows(seqs, logits, batch)
    verdicts = verify_batch(seqs, processed, batch).to_host()
    for i, (seq, verdict) in enumerate(zip(seqs, verdicts)):
        lo, hi = batch.rows(i)
        draws = sampling.scores_with_log_noise(processed[lo:hi], seq.log_noise(0, hi - lo, V)).argmax(-1)
        n, token = verify.greedy_accept(draws, torch.tensor(drafts[i]), [len(drafts[i])])
        assert verdict.num_accepted == int(n) and verdict.tokens[-1] == int(token)


def _tree(tokens, parents, mode=ChildSelection.DETERMINISTIC):
    return TokenTree.from_parents(torch.tensor(tokens), parents, mode)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_trees_over_flattened_nodes_equal_each_tree_alone(seed):
    gen = torch.Generator().manual_seed(seed)
    trees = [_tree([3, 4, 1, 5, 9], [-1, -1, 0, 0, 2]), None, _tree([2, 6, 6], [-1, 0, 1]), _tree([7], [-1])]
    drafts = [t.tokens.tolist() if t is not None else [8, 8] for t in trees]
    batch = _batch(drafts, trees=trees)
    logits = torch.randn(batch.num_rows, V, generator=gen)
    # Lead a few rows to the drafts so that paths of several depths are accepted.
    for i, tree in enumerate(trees):
        if tree is not None and seed % 2 == 0:
            lo = batch.rows(i)[0]
            for node in tree.first_child_path():
                logits[lo + tree.parent_list[node] + 1, int(tree.tokens[node])] = 60.0
    seqs = [_seq(SamplingParams(temperature=0)) for _ in trees]
    verdicts = verify_batch(seqs, process_rows(seqs, logits, batch), batch).to_host()
    for i, (tree, verdict) in enumerate(zip(trees, verdicts)):
        if tree is None:
            continue
        lo, hi = batch.rows(i)
        alone = verify_tree.tree_greedy_accept(tree, logits[lo:hi])
        path = alone.accepted.nonzero().flatten().tolist()
        assert verdict.nodes == path and verdict.num_accepted == len(path)
        assert verdict.tokens == [int(tree.tokens[j]) for j in path] + [int(alone.next_token)]


@pytest.mark.parametrize("seed", range(4))
def test_the_targets_argmax_alone_verifies_greedy_chains_and_trees_as_their_logits_do(seed):
    """verify_batch(target=argmax) (the runner gave each row's argmax instead of the logits) gives the verdicts the
    logits give, for plain rows, chains and trees together; and it refuses sampled sequences or logits beside."""
    gen = torch.Generator().manual_seed(seed)
    trees = [None, _tree([3, 4, 1, 5, 9], [-1, -1, 0, 0, 2]), None, None]
    drafts = [[], trees[1].tokens.tolist(), [5, 9, 2], [1]]
    batch = _batch(drafts, trees=trees)
    logits = torch.randn(batch.num_rows, V, generator=gen)
    for i in (1, 2):  # lead a few rows to their drafts
        lo = batch.rows(i)[0]
        logits[lo, drafts[i][0]] = logits[lo + 1, drafts[i][1]] = 40.0
    seqs = [_seq(SamplingParams(temperature=0)) for _ in drafts]
    expected = verify_batch(seqs, process_rows(seqs, logits, batch), batch).to_host()
    assert verify_batch(seqs, None, batch, target=logits.argmax(-1)).to_host() == expected
    plain = _batch([[]] * 3)
    rows = torch.randn(3, V, generator=gen)
    assert verify_batch(seqs[:3], None, plain, target=rows.argmax(-1)).to_host() == \
        verify_batch(seqs[:3], rows, plain).to_host()
    with pytest.raises(ValueError, match="greedy"):
        verify_batch([_seq(SamplingParams(temperature=0.8))] + seqs[1:], None, batch, target=logits.argmax(-1))


def test_reads_argmax_only_where_process_rows_leaves_the_rows_as_they_are():
    """The engine asks the runner for the argmax alone where reads_argmax_only holds for every sequence: exactly
    where process_rows leaves a sequence's rows untouched (grammar masks aside: they need a tokenizer here)."""
    gen = torch.Generator().manual_seed(9)
    table = sampling.PenaltyTable(V, CPU)
    batch = _batch([[3, 1]])
    logits = torch.randn(batch.num_rows, V, generator=gen)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={2: 3.0}),
                   SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(temperature=0.8)):
        seq = _seq(params, table=table)
        assert reads_argmax_only(seq) == torch.equal(process_rows([seq], logits, batch), logits)
    assert reads_argmax_only(_seq(SamplingParams(temperature=0)))


def test_match_trees_is_each_trees_match():
    gen = torch.Generator().manual_seed(7)
    trees = [_tree([1, 2, 3, 4], [-1, 0, 0, 2]), _tree([5, 5, 6], [-1, 0, -1])]
    starts = [0, 5]
    for _ in range(30):
        target = torch.randint(0, 7, (9,), generator=gen)
        flat = verify_tree.match_trees(trees, starts, target)
        offset = 0
        for t, (tree, start) in enumerate(zip(trees, starts)):
            alone = verify_tree._match(tree, target[start: start + tree.num_rows])
            assert flat.accepted[offset: offset + tree.num_nodes].tolist() == alone.accepted.tolist()
            assert int(flat.next_token[t]) == int(alone.next_token) and int(flat.last_row[t]) == int(alone.last_row)
            offset += tree.num_nodes


def test_penalties_logit_bias_and_temperature_are_each_sequences_own_processing():
    """process_rows over a batch with penalties (from the shared table), logit bias and sampling settings equals
    sampling.process on each sequence's rows with its own history (the path the exactness tests use)."""
    gen = torch.Generator().manual_seed(3)
    table = sampling.PenaltyTable(V, CPU)
    settings = [SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={2: 3.0}),
                SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.4, top_p=0.9),
                SamplingParams(temperature=1.2, min_p=0.1),
                SamplingParams(temperature=0, logit_bias={4: -5.0, 0: 1.5})]
    seqs = [_seq(p, prompt=(1, 5, 5), table=table) for p in settings]
    for seq, committed in zip(seqs, ([3, 3], [1], [], [7])):
        if seq.penalties is not None:
            seq.penalties.append(committed)
    drafts = [[2, 3, 3], [6], [], [1, 0]]
    batch = _batch(drafts)
    logits = torch.randn(batch.num_rows, V, generator=gen) * 3
    processed = process_rows(seqs, logits, batch)
    for i, seq in enumerate(seqs):
        lo, hi = batch.rows(i)
        seen = counts = None
        if seq.penalties is not None:
            seen, counts = seq.penalties.rows(torch.tensor(drafts[i], dtype=torch.long), hi - lo)
        expected = sampling.process(logits[lo:hi], seq.params, seen, counts)
        assert torch.equal(processed[lo:hi], expected), i


def test_a_step_verdict_comes_to_the_host_in_one_read(monkeypatch):
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or original(self))
    verdict = StepVerdict(torch.tensor([1, 0]), torch.tensor([[4, 2], [7, -1]]), None)
    assert [(v.num_accepted, v.tokens, v.nodes) for v in verdict.to_host()] == [(1, [4, 2], [0]), (0, [7], [])]
    assert len(reads) == 1

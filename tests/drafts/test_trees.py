"""Token-tree proposals (issue 25): drafts/trees.py's trie and EAGLE-2 bookkeeping, ngram's and suffix's trees
of earlier continuations, and the draft model's level-by-level tree on a stub runner that records the
TreeAttention each level passes and returns logits the test controls (its parents, levels, budget, rollback
and catch-up; end-to-end verification is the engine's tests)."""

from __future__ import annotations

import math

import pytest
import torch

from quickdraft.cache import SequenceCache
from quickdraft.drafts.base import TreeBudget
from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.drafts.ngram import NgramProposer
from quickdraft.drafts.suffix import SuffixProposer
from quickdraft.drafts.suffix_tree import SuffixIndex
from quickdraft.drafts.trees import (DynamicTree, deterministic_tree_proposal, frequency_trie, rank_children,
                                     tree_proposal)
from quickdraft.models.base import TreeAttention
from quickdraft.params import SamplingParams
from quickdraft.sequence import Sequence
from quickdraft.token_tree import ChildSelection

CPU = torch.device("cpu")
V = 8


def _sequence(prompt, params=None, noise_key=None, vocab=V) -> Sequence:
    return Sequence(list(prompt), params or SamplingParams(temperature=0), None, CPU, vocab, noise_key)


# --- drafts/trees.py ----------------------------------------------------------------------------------------
def test_chain_or_tree_proposal():
    assert deterministic_tree_proposal([], [], [], CPU).tokens.numel() == 0
    chain = deterministic_tree_proposal([4, 5, 6], [-1, 0, 1], [0.9, 0.8, 0.7], CPU, catch_up=2)
    assert chain.tree is None and chain.tokens.tolist() == [4, 5, 6] and chain.catch_up == 2
    tree = deterministic_tree_proposal([4, 5, 6], [-1, -1, 0], [0.5, 0.25, 0.5], CPU)
    assert tree.tree is not None and tree.probs is None and not tree.tree.needs_draft_probs
    assert tree.scores.tolist() == [0.5, 0.25, 0.5]
    assert tree.tree.parents.tolist() == [-1, -1, 0] and tree.tokens.tolist() == [4, 5, 6]
    assert set(tree.tree.selection.tolist()) == {int(ChildSelection.DETERMINISTIC)}


def test_frequency_trie_keeps_the_most_frequent_nodes_siblings_by_frequency():
    continuations = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 7]]  # most recent first
    assert frequency_trie(continuations, 16, 6) == ([1, 5, 2, 7, 6, 3, 4], [-1, -1, 0, 0, 1, 2, 2],
                                                    [0.75, 0.25, 0.5, 0.25, 0.25, 0.25, 0.25])
    # Three nodes: 1 (3 continuations), 1 2 (2), then the shallower of the ones seen once, most recent first.
    assert frequency_trie(continuations, 3, 6)[:2] == ([1, 5, 2], [-1, -1, 0])
    assert frequency_trie(continuations, 16, 1)[:2] == ([1, 5], [-1, -1])
    # A tie between siblings goes to the most recent continuation.
    assert frequency_trie([[3, 9], [4, 5]], 4, 2)[:2] == ([3, 4, 9, 5], [-1, -1, 0, 1])
    assert frequency_trie([[1, 2, 3], [1, 2, 3]], 8, 2) == ([1, 2], [-1, 0], [1.0, 1.0])  # one continuation


def test_dynamic_tree_expands_the_best_of_each_level_and_keeps_the_best_nodes():
    tree = DynamicTree(base=3, max_nodes=4, max_depth=3, capacity=10)
    assert tree.width == 2  # 4 - 3 + 1
    tree.add_children(-1, torch.tensor([0.0, 0.5, 0.3, 0.2]))
    assert tree.tokens == [1, 2, 3] and tree.depth == [1, 1, 1]
    assert tree.next_frontier(1) == [0, 1]  # the two most probable of depth 1
    assert tree.attention() == TreeAttention(3, (2, 2))
    tree.add_children(0, torch.tensor([0.9, 0.1, 0.0, 0.0]))  # 1 -> 0 (0.45), 1 -> 1 (0.05)
    tree.add_children(1, torch.tensor([0.0, 0.0, 0.0, 1.0]))  # 2 -> 3 (0.3)
    # Best 4: 1 (.5), 1 0 (.45), 2 (.3), 2 3 (.3: after its parent on a tie); 3 (.2) is out.
    assert tree.next_frontier(2) == [3, 5]
    assert tree.attention() == TreeAttention(3, (2, 2, 3, 4))
    tokens, parents, chances = tree.proposal_nodes()
    assert (tokens, parents) == ([1, 2, 0, 3], [-1, -1, 0, 1])
    assert chances == pytest.approx([0.5, 0.3, 0.45, 0.3])
    assert tree.next_frontier(3) == []  # the depth budget
    assert tree.path(5) == [2, 3]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0),
                                    SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05)])
def test_rank_children_on_part_of_the_vocabulary_is_the_full_rows_ranking(params):
    """A draft that scores V' of the V tokens (eagle's head) ranks children on its own rows: the same children,
    tokens and path probabilities as on full-vocabulary rows with -inf elsewhere."""
    vocab_ids = torch.tensor([1, 3, 4, 6, 7])
    part = torch.tensor([[2.0, -1.0, 0.5, 1.5, 0.0], [0.1, 3.0, -2.0, 0.4, 1.0]])
    full = torch.full((2, V), float("-inf"))
    full[:, vocab_ids] = part
    trees = []
    for logits, ids in ((part, vocab_ids), (full, None)):
        tree = DynamicTree(base=3, max_nodes=6, max_depth=2, capacity=10)
        torch.manual_seed(0)  # an unseeded sampled request's first children are draws: the same ones both ways
        rank_children(_sequence([1, 2, 3], params), tree, [-1], logits[:1], ids, V)
        frontier = tree.next_frontier(1)
        rank_children(_sequence([1, 2, 3], params), tree, frontier, logits[1:].expand(len(frontier), -1), ids, V)
        trees.append(tree)
    assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents
    assert trees[0].logp == pytest.approx(trees[1].logp, rel=1e-6)
    assert set(trees[0].tokens) <= set(vocab_ids.tolist())
    assert trees[0].drawn_from.keys() == trees[1].drawn_from.keys() and bool(trees[0].drawn_from) == \
        (not params.greedy)
    for node, q in trees[0].drawn_from.items():  # the q the draws came from, over the whole vocabulary
        assert q.shape == (V,) and torch.allclose(q, trees[1].drawn_from[node]) and q[[0, 2, 5]].sum() == 0
    with pytest.raises(ValueError, match="target_vocab"):
        rank_children(_sequence([1, 2, 3], params), DynamicTree(base=3, max_nodes=6, max_depth=2, capacity=10),
                      [-1], part[:1], vocab_ids)
    with pytest.raises(ValueError, match="full-vocabulary"):  # penalties read token ids: not on a part
        rank_children(_sequence([1, 2, 3], SamplingParams(temperature=0, repetition_penalty=1.2)),
                      DynamicTree(base=3, max_nodes=6, max_depth=2, capacity=10), [-1], part[:1], vocab_ids)


def test_sampled_trees_draw_each_rows_first_child_and_rank_the_others():
    """An unseeded sampled request: each expanded row's first child is a draw from the draft's q (the token its
    chain would draw), the others q's most probable remaining tokens; the proposal is a DRAWN_FIRST tree carrying,
    per node, the q of its parent's row; a tree of one child a row is a chain of draws with their q."""
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[3.0, 2.5, 2.0, -9.0, -9.0, -9.0, -9.0, -9.0]])
    q = torch.softmax(logits[0], -1)
    firsts = set()
    for seed in range(40):
        tree = DynamicTree(base=3, max_nodes=3, max_depth=1, capacity=10, top_k=3)
        torch.manual_seed(seed)
        rank_children(_sequence([1, 2, 3], params), tree, [-1], logits)
        assert tree.top == [True, False, False] and sorted(tree.tokens) == [0, 1, 2]
        others = [t for t in (0, 1, 2) if t != tree.tokens[0]]
        assert tree.tokens[1:] == others  # ranked by q: the lower ids are the more probable here
        assert tree.logp[0] == pytest.approx(math.log(q[0].item()))  # the draw scores as the top token
        proposal = tree_proposal(tree, CPU, catch_up=1)
        assert proposal.tree.selection.tolist() == [int(ChildSelection.DRAWN_FIRST)] * 3
        assert torch.equal(proposal.probs, q.expand(3, -1)) and proposal.catch_up == 1
        firsts.add(tree.tokens[0])
    assert firsts == {0, 1, 2}  # drawn, not always the top token
    line = DynamicTree(base=3, max_nodes=2, max_depth=2, capacity=10, top_k=1)
    rank_children(_sequence([1, 2, 3], params), line, [-1], logits)
    rank_children(_sequence([1, 2, 3], params), line, line.next_frontier(1), logits)
    chain = tree_proposal(line, CPU)
    assert chain.tree is None and chain.tokens.tolist() == line.tokens and torch.equal(chain.probs, q.expand(2, -1))
    greedy = DynamicTree(base=3, max_nodes=3, max_depth=1, capacity=10, top_k=3)
    rank_children(_sequence([1, 2, 3]), greedy, [-1], logits)
    ranked = tree_proposal(greedy, CPU)
    assert greedy.tokens == [0, 1, 2] and ranked.probs is None and not ranked.tree.needs_draft_probs


def test_dynamic_tree_respects_the_cache_capacity():
    tree = DynamicTree(base=5, max_nodes=8, max_depth=4, capacity=1)
    tree.add_children(-1, torch.tensor([0.6, 0.4]))
    assert len(tree.next_frontier(1)) == 1  # width 4, but one slot left
    tree.add_children(0, torch.tensor([0.5, 0.5]))
    assert tree.next_frontier(2) == []


# --- ngram -------------------------------------------------------------------------------------------------
def test_ngram_tree_merges_the_continuations_of_earlier_occurrences():
    # "1 2" occurred at 0, 3 and 7, followed by 3 1 2, 4 5 1 and 3 9 1.
    seq = _sequence([1, 2, 3, 1, 2, 4, 5, 1, 2, 3, 9, 1, 2])
    proposer = NgramProposer()
    assert proposer.proposes_trees
    (proposal,) = proposer.propose_tree_batch([seq], [TreeBudget(8, 3)])
    assert proposal.probs is None
    assert proposal.tokens.tolist() == [3, 4, 9, 1, 5, 1, 2, 1]
    assert proposal.tree.parents.tolist() == [-1, -1, 0, 0, 1, 2, 3, 4]
    assert proposal.scores.tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    (small,) = proposer.propose_tree_batch([seq], [TreeBudget(2, 2)])
    assert small.tokens.tolist() == [3, 4] and small.tree.parents.tolist() == [-1, -1]
    # One earlier occurrence: the chain propose gives.
    once = _sequence([7, 8, 9, 5, 7, 8])
    (chain,) = proposer.propose_tree_batch([once], [TreeBudget(8, 3)])
    assert chain.tree is None and chain.tokens.tolist() == proposer.propose(once, 3).tokens.tolist() == [9, 5, 7]
    none, empty = proposer.propose_tree_batch([_sequence([1, 2, 3]), seq], [TreeBudget(8, 3), TreeBudget(0, 0)])
    assert none.tokens.numel() == 0 and empty.tokens.numel() == 0


# --- suffix ------------------------------------------------------------------------------------------------
def test_suffix_index_tree_follows_every_continuation_most_probable_first():
    index = SuffixIndex(max_depth=8, max_tokens=1000)
    doc = index.new_doc([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2])
    # One continuation of the longest match (1 2 3 1 2 -> 4 ...): the tree is speculate's chain.
    assert index.speculate_tree(doc, 16, 8)[:2] == (index.speculate(doc, 8), [-1, 0, 1, 2, 3])
    index.extend(doc, [3])  # 1 2 3 (m = 3) -> 1 2, then 3 (most recent) or 4
    tokens, parents, probs = index.speculate_tree(doc, 16, 8)
    assert (tokens, parents) == ([1, 2, 3, 4], [-1, 0, 1, 1])
    first = 2 / (2 + 10 / 4)  # then 1 x (1 / (2 + 10 / 16)) for each of 3 and 4
    assert probs == pytest.approx([first, first, first / 2.625, first / 2.625])
    assert tokens[:3] == index.speculate(doc, 8)  # the first path is the chain's draft
    assert index.speculate_tree(doc, 3, 8)[:2] == ([1, 2, 3], [-1, 0, 1])  # the budget cuts the less probable 4
    assert index.speculate_tree(doc, 16, 2)[:2] == ([1, 2], [-1, 0])  # and the depth budget
    assert index.speculate_tree(doc, 16, 8, min_prob=0.5) == ([], [], [])  # 2 / (2 + 10/4) < 0.5
    index.check()


def test_suffix_tree_reanchors_past_the_tree_depth():
    index = SuffixIndex(max_depth=4, max_tokens=1000)
    doc = index.new_doc([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3])
    chain = index.speculate(doc, 6, factor=2.0)
    tokens, parents, _ = index.speculate_tree(doc, 6, 6, factor=2.0)
    assert len(chain) == 6 and tokens == chain and parents == [-1, 0, 1, 2, 3, 4]


def test_suffix_proposer_tree():
    proposer = SuffixProposer()
    assert proposer.proposes_trees
    seq = _sequence([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 3], SamplingParams(temperature=0))
    seq.draft_state = proposer.new_state(seq)
    (proposal,) = proposer.propose_tree_batch([seq], [TreeBudget(16, 8)])
    assert proposal.tokens.tolist() == [1, 2, 3, 4] and proposal.tree.parents.tolist() == [-1, 0, 1, 1]
    assert proposal.probs is None
    (chain,) = proposer.propose_tree_batch([seq], [TreeBudget(3, 3)])
    assert chain.tree is None and chain.tokens.tolist() == [1, 2, 3]
    (nothing,) = proposer.propose_tree_batch([seq], [TreeBudget(0, 0)])
    assert nothing.tokens.numel() == 0


# --- draft model on a stub runner --------------------------------------------------------------------------
# The stub draft's law: after token t, t + 1 (0.6), t + 2 (0.3) or t + 3 (0.1) mod V, nothing else.
LAW = {1: 0.6, 2: 0.3, 3: 0.1}


def _law_logits(token: int) -> torch.Tensor:
    row = torch.full((V,), float("-inf"))
    for step, p in LAW.items():
        row[(token + step) % V] = math.log(p)
    return row


class _StubCache(SequenceCache):
    def _drop_kv(self, count: int) -> None:  # no keys or values: only token ids
        pass


class _TokenRunner:
    """A draft runner whose caches keep token ids only: each logits row asked for is row_logits(the tokens that
    row attends to, in position order: TreeAttention.visible for a tree slot). Records each forward_batch (cache
    lengths, tokens, num_logits, trees)."""

    vocab_size = V
    max_len = 64
    device = CPU

    def __init__(self) -> None:
        self.calls = []

    def new_cache(self) -> SequenceCache:
        return _StubCache()

    def row_logits(self, visible_tokens: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def forward_batch(self, caches, tokens, num_logits, return_hidden=False, trees=None, argmax_only=False):
        self.calls.append(([len(c) for c in caches], [t.tolist() for t in tokens], list(num_logits), trees))
        rows = []
        for index, (cache, feed, count) in enumerate(zip(caches, tokens, num_logits)):
            first = len(cache)
            cache.record(feed)
            ids = cache.token_ids
            tree = trees[index] if trees is not None else None
            if tree is not None:
                assert tree.end == len(ids), "a tree's parents cover every slot up to the end of the call"
            for slot in range(first + len(feed) - count, first + len(feed)):
                visible = tree.visible(slot) if tree is not None else list(range(slot + 1))
                assert visible[-1] == slot
                rows.append(self.row_logits([ids[s] for s in visible]))
        return torch.stack(rows).argmax(-1) if argmax_only else torch.stack(rows)


class _StubRunner(_TokenRunner):
    """Logits that follow LAW after the last token a row attends to (for a tree slot: its own token)."""

    def row_logits(self, visible_tokens: list[int]) -> torch.Tensor:
        return _law_logits(visible_tokens[-1])


def _draft_proposer():
    runner = _StubRunner()
    return DraftModelProposer(runner, V), runner


def test_draft_model_tree_levels_attention_budget_and_rollback():
    proposer, runner = _draft_proposer()
    assert proposer.proposes_trees
    seq = _sequence([1, 2, 3])
    seq.draft_state = proposer.new_state(seq)
    (proposal,) = proposer.propose_tree_batch([seq], [TreeBudget(6, 3)])
    # Level 0 reads the history (plain rows); level 1 writes 4 5 6 under the root (slot 2); level 2 the depth-2
    # nodes still among the 6 best: 3 -> 4 -> 5 (.36), 4 -> 6 (.18) and 5 -> 6 (.18).
    assert runner.calls == [
        ([0], [[1, 2, 3]], [1], None),
        ([3], [[4, 5, 6]], [3], [TreeAttention(3, (2, 2, 2))]),
        ([6], [[5, 6, 6]], [3], [TreeAttention(3, (2, 2, 2, 3, 3, 4))]),
    ]
    assert proposer.forwards == 3
    # The 6 most probable paths: 4 (.6), 4 5 (.36), 5 (.3), 4 5 6 (.216), 4 6 (.18), 5 6 (.18); 6 (.1) is out.
    assert proposal.tokens.tolist() == [4, 5, 5, 6, 6, 6]
    assert proposal.tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert proposal.scores.tolist() == pytest.approx([0.6, 0.3, 0.36, 0.18, 0.18, 0.216])
    assert proposal.probs is None and not proposal.tree.needs_draft_probs
    assert proposal.catch_up == 1  # the prompt, as a chain counts it: what a step adds is 2 tokens
    # The cache keeps the committed history and the tree's most probable expanded path, 4 (slot 3) -> 5 (slot
    # 6, moved to 4); the other tree slots are dropped.
    assert seq.draft_state.kv_cache.token_ids == [1, 2, 3, 4, 5]
    # The step accepts 4 5 and adds 6: the next proposal reads only the 6.
    seq.commit([4, 5], 6, 6, set(), 64)
    runner.calls.clear()
    (second,) = proposer.propose_tree_batch([seq], [TreeBudget(6, 3)])
    assert runner.calls[0][:3] == ([5], [[6]], [1])
    assert second.catch_up == 0 and second.tokens.tolist()[:2] == [7, 0]
    # A chain after that tree reads what the tree's step committed without a catch-up either.
    seq.commit([7], 6, 0, set(), 64)
    (chain,) = proposer.propose_batch([seq], [2])
    assert chain.catch_up == 0 and chain.tokens.tolist() == [1, 2]


def test_draft_model_tree_batches_every_sequence_per_level():
    proposer, runner = _draft_proposer()
    seqs = [_sequence([1, 2, 3]), _sequence([5]), _sequence([2, 2])]
    for seq in seqs:
        seq.draft_state = proposer.new_state(seq)
    budgets = [TreeBudget(6, 3), TreeBudget(3, 1), TreeBudget(0, 0)]
    first, shallow, none = proposer.propose_tree_batch(seqs, budgets)
    assert [call[0] for call in runner.calls] == [[0, 0], [3], [6]]  # the depth-1 budget drafts in level 0 only
    assert runner.calls[0][1] == [[1, 2, 3], [5]]
    assert first.tokens.tolist() == [4, 5, 5, 6, 6, 6]
    assert shallow.tokens.tolist() == [6, 7, 0] and shallow.tree.parents.tolist() == [-1, -1, -1]
    assert none.tokens.numel() == 0
    # the first keeps its history and its top expanded path (4 5); the depth-1 tree expanded nothing
    assert [len(seq.draft_state.kv_cache) for seq in seqs] == [5, 1, 0]


def test_draft_model_tree_of_a_chain_budget_reranks_siblings():
    proposer, runner = _draft_proposer()
    seq = _sequence([3])
    seq.draft_state = proposer.new_state(seq)
    (proposal,) = proposer.propose_tree_batch([seq], [TreeBudget(3, 3)])
    # One node expanded a level; the best 3 are 4 (.6), 4 5 (.36), 5 (.3): 4 5 6 (.216) loses to the sibling.
    assert [call[3] for call in runner.calls] == [None, [TreeAttention(1, (0,))], [TreeAttention(1, (0, 1))]]
    assert proposal.tokens.tolist() == [4, 5, 5] and proposal.tree.parents.tolist() == [-1, -1, 0]


def test_draft_model_tree_seeded_ranks_by_the_coupled_draw_and_sampled_draws_its_first_children():
    proposer, runner = _draft_proposer()
    for noise_key in range(4):
        params = SamplingParams(temperature=1.0, seed=noise_key)
        chain_seq, tree_seq = _sequence([1, 2, 3], params, noise_key), _sequence([1, 2, 3], params, noise_key)
        for seq in (chain_seq, tree_seq):
            seq.draft_state = proposer.new_state(seq)
        chain = proposer.propose_batch([chain_seq], [1])[0]
        (tree,) = proposer.propose_tree_batch([tree_seq], [TreeBudget(4, 2)])
        assert tree.tokens[0] == chain.tokens[0]  # the first root child is the seeded draw's draft
        assert tree.probs is None
    # Unseeded sampling: the root's first child is the token the chain draws with the same random state, each
    # node carries its parent row's q, and the tree is DRAWN_FIRST.
    firsts = set()
    for seed in range(12):
        chain_seq, tree_seq = (_sequence([1, 2, 3], SamplingParams(temperature=1.0)) for _ in range(2))
        for seq in (chain_seq, tree_seq):
            seq.draft_state = proposer.new_state(seq)
        torch.manual_seed(seed)
        chain = proposer.propose_batch([chain_seq], [1])[0]
        torch.manual_seed(seed)
        (proposal,) = proposer.propose_tree_batch([tree_seq], [TreeBudget(4, 2)])
        assert proposal.tokens[0] == chain.tokens[0] and torch.equal(proposal.probs[0], chain.probs[0])
        assert proposal.probs.shape == (proposal.tokens.numel(), V)
        if proposal.tree is not None:
            assert set(proposal.tree.selection.tolist()) == {int(ChildSelection.DRAWN_FIRST)}
        firsts.add(int(proposal.tokens[0]))
    assert len(firsts) > 1  # drawn, not ranked


class _AllowAll:
    """A grammar that allows every token (the draft must still draft a chain for it)."""

    def blocked(self, tokens):
        return None


def test_draft_model_tree_grammar_drafts_a_chain_and_context_limits():
    proposer, runner = _draft_proposer()
    seq = _sequence([1, 2, 3])
    seq.grammar = _AllowAll()
    seq.draft_state = proposer.new_state(seq)
    (proposal,) = proposer.propose_tree_batch([seq], [TreeBudget(6, 3)])
    assert proposal.tree is None and proposal.tokens.tolist() == [4, 5, 6]
    assert all(call[3] is None for call in runner.calls)
    # Near the draft's context end the tree keeps to the slots left (max_len 64: one slot after 63 tokens).
    long = _sequence([1] * 63)
    long.draft_state = proposer.new_state(long)
    runner.calls.clear()
    (near_end,) = proposer.propose_tree_batch([long], [TreeBudget(6, 3)])
    assert [len(call[1][0]) for call in runner.calls] == [63, 1]  # one tree slot fed
    # the cache: the history and the top path's one expanded node
    assert near_end.tree.max_depth == 2 and long.draft_state.kv_cache.token_ids == [1] * 63 + [near_end.tokens[0]]


@pytest.mark.parametrize("budget", [TreeBudget(1, 1), TreeBudget(5, 2), TreeBudget(16, 6)])
def test_draft_model_tree_stays_within_its_budget(budget):
    proposer, _ = _draft_proposer()
    seq = _sequence([1, 2, 3, 4])
    seq.draft_state = proposer.new_state(seq)
    (proposal,) = proposer.propose_tree_batch([seq], [budget])
    nodes = proposal.tokens.numel()
    tree_depth = proposal.tree.max_depth if proposal.tree is not None else nodes
    assert 1 <= nodes <= budget.max_nodes and tree_depth <= budget.max_depth


# --- draft model on the native runner's kernels ------------------------------------------------------------
class _LineRunner(_TokenRunner):
    """A reference draft runner: every row is computed by `runner` from scratch on the tokens it attends to, fed
    in a line."""

    def __init__(self, runner) -> None:
        super().__init__()
        self.runner, self.vocab_size, self.max_len = runner, runner.vocab_size, runner.max_len

    def row_logits(self, visible_tokens: list[int]) -> torch.Tensor:
        return self.runner.forward(self.runner.new_cache(), torch.tensor(visible_tokens), 1)[0]


@pytest.mark.parametrize("view", ["whole", "layer_skip", "int8"])
def test_draft_model_tree_on_the_kernels_is_the_tree_of_its_paths_in_a_line(view):
    """The native runner's tree attention gives each node the logits of its path fed in a line (bitwise on the
    kernels), so the tree drafted through it is the one a line-by-line reference drafts; layer_skip's truncated
    view and an int8 draft (quantized) too."""
    from conftest import tiny_llama16
    from quickdraft.kernels import cpu_linear
    from quickdraft.models.factory import native_runner

    if cpu_linear() is None:
        pytest.skip("the CPU kernels need AVX512-BF16")
    model = tiny_llama16().to(torch.bfloat16)
    runner = {"whole": lambda r: r, "layer_skip": lambda r: r.truncated(1),
              "int8": lambda r: r.quantized("int8")}[view](native_runner(model))
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    proposals, seconds, kept = [], [], []
    for draft_runner in (runner, _LineRunner(runner)):
        proposer = DraftModelProposer(draft_runner, vocab)
        seq = _sequence(prompt, vocab=vocab)
        seq.draft_state = proposer.new_state(seq)
        (proposal,) = proposer.propose_tree_batch([seq], [TreeBudget(12, 4)])
        cached = seq.draft_state.kv_cache.token_ids
        assert cached[:len(prompt)] == prompt and len(cached) > len(prompt)  # the history, then the top path
        kept.append(list(cached))
        proposals.append(proposal)
        # The step accepts the kept path's first two tokens and adds another: the next tree reads the third only
        # (on the kernels from the compacted path's keys, on the reference from the tokens in a line).
        seq.commit(cached[len(prompt):len(prompt) + 2], 2, 5, set(), draft_runner.max_len)
        (second,) = proposer.propose_tree_batch([seq], [TreeBudget(12, 4)])
        seconds.append(second)
    tree, line = proposals
    assert tree.tree is not None and tree.tokens.numel() == 12 and tree.tree.max_depth > 1
    assert tree.tokens.tolist() == line.tokens.tolist() and kept[0] == kept[1]
    assert tree.tree.parents.tolist() == line.tree.parents.tolist()
    assert seconds[0].tokens.tolist() == seconds[1].tokens.tolist()
    assert seconds[0].tree.parents.tolist() == seconds[1].tree.parents.tolist()


def test_dynamic_tree_min_chance_keeps_the_most_probable_path_and_siblings_worth_a_row():
    """min_chance ("auto"'s price of a row): a node that is not its parent's most probable child is kept only if
    its path probability reaches it; the most probable path stays whatever its probability."""
    tree = DynamicTree(10, max_nodes=8, max_depth=3, capacity=32, top_k=3, min_chance=0.15)
    tree.add_children(-1, torch.tensor([0.0, 0.7, 0.2, 0.1]))  # nodes 0: token 1 (0.7), 1: token 2, 2: token 3
    assert sorted(tree.best()) == [0, 1]  # 0.1 < 0.15
    tree.add_children(0, torch.tensor([0.1, 0.15, 0.05, 0.7]))  # under 0.7: 0.49 (top), 0.105, 0.07
    tree.add_children(1, torch.tensor([0.45, 0.55, 0.0, 0.0]))  # under 0.2: 0.11 (top), 0.09
    best = tree.best()
    assert [tree.path(n) for n in sorted(best, key=tree._key)] == [[1], [1, 3], [2], [2, 1]]
    everything = DynamicTree(10, max_nodes=8, max_depth=3, capacity=32, top_k=3)
    everything.add_children(-1, torch.tensor([0.0, 0.7, 0.2, 0.1]))
    assert len(everything.best()) == 3

"""TokenTree: the flat layout, the tree attention mask, positions by depth, paths and the KV compaction plan,
on hand-made trees; a chain must give exactly today's layout."""

import pytest
import torch

from quickdraft.sampling import PenaltyHistory
from quickdraft.token_tree import ChildSelection, TokenTree

DET, IID, WOR = ChildSelection.DETERMINISTIC, ChildSelection.IID, ChildSelection.WITHOUT_REPLACEMENT


def _example() -> TokenTree:
    # root -> 5 -> 6 -> 7        nodes: 0:5  1:6  2:7  3:8  4:9
    #           -> 8             rows:  0 root, node i at row i + 1
    #      -> 9
    return TokenTree.from_paths([[5, 6, 7], [5, 8], [9]])


def test_from_paths_merges_shared_prefixes_in_order_of_appearance():
    tree = _example()
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 0, -1]
    assert tree.depth.tolist() == [1, 2, 3, 2, 1]
    assert tree.parent_rows.tolist() == [0, 1, 2, 1, 0]
    assert tree.sibling_rank.tolist() == [0, 0, 0, 1, 1]
    assert tree.children(0) == [0, 4] and tree.children(1) == [1, 3] and tree.children(3) == []
    assert (tree.num_nodes, tree.num_rows, tree.max_depth, tree.max_children) == (5, 6, 3, 2)
    assert not tree.is_chain


def test_tree_attention_mask_sees_ancestors_and_itself():
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],  # node 3 (token 8) sees 5 and itself, not its sibling's branch
        [0, 0, 0, 0, 1],  # node 4 (token 9) sees only itself (and the root and prefix)
    ], dtype=torch.bool)
    tree = _example()
    assert torch.equal(tree.attention_mask(), expected)
    step = tree.step_attention_mask()
    assert step.shape == (6, 6)
    assert step[:, 0].all() and step[0, 1:].sum() == 0  # every row sees the root; the root sees only itself
    assert torch.equal(step[1:, 1:], expected)
    assert tree.positions(10).tolist() == [10, 11, 12, 13, 12, 11]
    assert tree.row_depths.tolist() == [0, 1, 2, 3, 2, 1]
    assert tree.earlier_siblings.nonzero().tolist() == [[3, 1], [4, 0]]


def test_a_chain_gives_todays_layout():
    k = 4
    tree = TokenTree.chain(torch.tensor([3, 1, 4, 1]))
    assert tree.is_chain and tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.parent_rows.tolist() == list(range(k))  # row i scores draft i
    assert torch.equal(tree.step_attention_mask(), torch.ones(k + 1, k + 1, dtype=torch.bool).tril())
    assert tree.positions(7).tolist() == list(range(7, 7 + k + 1))
    for accepted in range(k + 1):
        plan = tree.compaction_plan(list(range(accepted)))
        assert plan.kept_rows.tolist() == list(range(accepted + 1)) and plan.is_length_change
        assert plan.length == accepted + 1
    # A chain repeating a token is still a chain (one child each): nothing to merge.
    assert TokenTree.from_paths([[2, 2, 2]], IID).is_chain


def test_compaction_keeps_the_root_and_the_accepted_path_in_order():
    tree = _example()
    plan = tree.compaction_plan([0, 3])  # 5 -> 8: rows 0, 1, 4
    assert plan.kept_rows.tolist() == [0, 1, 4]
    assert plan.src.tolist() == [4] and plan.dst.tolist() == [2] and not plan.is_length_change
    mask = torch.tensor([False, False, False, False, True])  # the verdict's mask form: 9 alone
    assert tree.compaction_plan(mask).kept_rows.tolist() == [0, 5]
    assert tree.compaction_plan([0, 1, 2]).is_length_change  # the first branch is laid out as a chain
    assert tree.compaction_plan([]).kept_rows.tolist() == [0]
    with pytest.raises(ValueError, match="not a path"):
        tree.compaction_plan([1, 2])  # misses node 0
    with pytest.raises(ValueError, match="not a path"):
        tree.compaction_plan([0, 4])  # siblings' branches


def test_paths_from_the_root():
    tree = _example()
    assert tree.path_to(2) == [0, 1, 2] and tree.path_to(3) == [0, 3] and tree.path_to(-1) == []
    assert tree.path_tokens(3).tolist() == [5, 8]
    with pytest.raises(ValueError, match="nodes 0..4"):
        tree.path_to(5)


def test_row_path_counts_match_the_chains_penalty_history():
    vocab = 6
    chain = torch.tensor([2, 4, 2])
    hist = PenaltyHistory([0, 1], vocab, torch.device("cpu"))
    _, counts = hist.rows(chain, 4)
    assert torch.equal(TokenTree.chain(chain).row_path_counts(vocab), counts - hist.output_counts)
    counts = _example().row_path_counts(10)
    assert counts[0].sum() == 0
    assert counts[4].nonzero().flatten().tolist() == [5, 8]  # node 3's row: its path 5, 8
    assert counts[5].nonzero().flatten().tolist() == [9]


def test_batched_tokens_share_one_shape():
    tokens = torch.tensor([[1, 2, 3], [3, 1, 0]])  # two trees: root -> (a -> c, b)
    tree = TokenTree.from_parents(tokens, [-1, 0, -1], WOR)
    assert tree.tokens.shape == (2, 3) and tree.path_tokens(1).tolist() == [[1, 2], [3, 1]]
    assert tree.row_path_counts(4).shape == (2, 4, 4)
    assert tree.to("cpu").tokens.shape == (2, 3)


def test_bad_trees_get_clear_errors():
    with pytest.raises(ValueError, match="parent must come before"):
        TokenTree.from_parents([1, 2], [1, -1])
    with pytest.raises(ValueError, match="share one selection mode"):
        TokenTree.from_parents([1, 2], [-1, -1], [DET, IID])
    with pytest.raises(ValueError, match="repeat a token"):
        TokenTree.from_parents([1, 1], [-1, -1], DET)
    with pytest.raises(ValueError, match="repeat a token"):
        TokenTree.from_parents([[1, 2], [3, 3]], [-1, -1], WOR)  # the second tree of the batch
    TokenTree.from_parents([1, 1], [-1, -1], IID)  # i.i.d. draws may repeat: each is its own trial
    with pytest.raises(ValueError, match="from_parents"):
        TokenTree.from_paths([[1, 2], [1, 3]], IID)
    with pytest.raises(ValueError, match="agree on the number of nodes"):
        TokenTree.from_parents([1, 2, 3], [-1, 0])
    with pytest.raises(ValueError, match="integer ids"):
        TokenTree(torch.tensor([1.0]), [-1], [DET])


def test_subtree_renumbers_parents_and_refuses_an_orphan():
    tree = TokenTree.from_parents(torch.tensor([10, 11, 12, 13, 14]), [-1, -1, 0, 2, 1])
    sub = tree.subtree([0, 2, 3])
    assert sub.tokens.tolist() == [10, 12, 13] and sub.parents.tolist() == [-1, 0, 1]
    assert tree.subtree([1, 4]).parents.tolist() == [-1, 0]
    with pytest.raises(ValueError, match="parent"):
        tree.subtree([0, 3])


def test_subtree_without_a_drawn_first_child_makes_its_kept_siblings_ranked():
    """DRAWN_FIRST's rule reads a row's first child as the draw from q: a cut that drops it leaves ranked tokens
    only, verified as DETERMINISTIC; rows whose drawn child is kept keep their mode."""
    drawn = ChildSelection.DRAWN_FIRST
    tree = TokenTree.from_parents(torch.tensor([10, 11, 12, 13, 14]), [-1, -1, 0, 0, 2], drawn)
    assert tree.needs_draft_probs
    sub = tree.subtree([1, 0, 3])  # the root's draw and ranked child kept; under 10 only its ranked child 13
    assert sub.tokens.tolist() == [10, 11, 13] and sub.parents.tolist() == [-1, -1, 0]
    assert sub.selection.tolist() == [drawn, drawn, DET]
    cut = tree.subtree([1])  # the root's draw cut: its ranked sibling alone
    assert cut.selection.tolist() == [DET] and not cut.needs_draft_probs
    with pytest.raises(ValueError, match="repeat a token"):  # ranked siblings are other tokens than the draw
        TokenTree.from_parents([4, 4], [-1, -1], drawn)


def test_first_child_path_is_the_chain_inside_the_tree():
    # root -> 0 (children 2, 3), 1; 2 -> 4; 3 -> 5: first children 0, 2, 4
    tree = TokenTree.from_parents(torch.tensor([5, 6, 7, 8, 9, 10]), [-1, -1, 0, 0, 2, 3], ChildSelection.DETERMINISTIC)
    assert tree.first_child_path() == [0, 2, 4]
    assert TokenTree.chain(torch.tensor([1, 2, 3])).first_child_path() == [0, 1, 2]
    assert TokenTree.from_parents(torch.tensor([1, 2]), [-1, -1], ChildSelection.DETERMINISTIC).first_child_path() == [0]
    assert TokenTree.from_parents(torch.empty(0, dtype=torch.long), [], ChildSelection.DETERMINISTIC).first_child_path() == []

"""Exactness of token-tree verification (quickdraft.verify_tree).

- A chain is today's verify.rejection_sample / greedy_accept, bit for bit.
- Greedy and seeded trees emit plain decoding's tokens on random logits, whatever the tree.
- The exact law of the first two emitted tokens, for each child-selection mode (IID, WITHOUT_REPLACEMENT,
  DETERMINISTIC, DRAWN_FIRST), on vocabularies of 3..5 tokens and trees of depth 2 with 2-3 children at the root: by
  enumeration of every tree the proposer can draw (the children's draws are finite; the verifier's uniforms
  are integrated exactly through tree_acceptance's probabilities), against plain sampling p(y1) p(y2 | y1).
  Planted defects (the SpecInfer rule with the draft's q for deterministic children, the i.i.d. rule for
  children drawn without replacement or for a drawn child's ranked siblings, the residual not renormalised)
  must move the law.
- Monte Carlo of the whole sampler (tree_rejection_sample: uniforms, first passing sibling, bonus row) with
  a fixed seed and a chi-square test at p = 1e-4, which at the same N rejects the wrong rules and a walk that
  takes the last passing sibling.
- Trees of one shape batched over leading dimensions give each tree's own verdict.
"""

import itertools
import math

import pytest
import torch
from scipy import stats

from quickdraft import SamplingParams, verify_tree
from quickdraft.sampling import position_noise, probs_rows, scores_with_log_noise
from quickdraft.token_tree import ChildSelection, TokenTree
from quickdraft.verify import greedy_accept, rejection_sample
from quickdraft.verify_tree import tree_acceptance, tree_greedy_accept, tree_rejection_sample, tree_seeded_accept

DET, IID, WOR = ChildSelection.DETERMINISTIC, ChildSelection.IID, ChildSelection.WITHOUT_REPLACEMENT
DRW = ChildSelection.DRAWN_FIRST
MODES = [IID, WOR, DET, DRW]
DTYPE = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


# -- chains are today's rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_chain_is_todays_rejection_sample_bit_for_bit(deterministic):
    gen = torch.Generator().manual_seed(1)
    batch, k, vocab = 64, 3, 5
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen, dtype=DTYPE) * 1.5, -1)
    q = None if deterministic else torch.softmax(torch.randn(batch, k, vocab, generator=gen, dtype=DTYPE) * 1.5, -1)
    drafts = torch.randint(vocab, (batch, k), generator=gen)
    chain = TokenTree.chain(drafts, DET if deterministic else IID)
    for seed in range(5):
        n, token = rejection_sample(p, q, drafts, torch.Generator().manual_seed(seed))
        verdict = tree_rejection_sample(chain, p, q, torch.Generator().manual_seed(seed))
        assert torch.equal(verdict.num_accepted, n) and torch.equal(verdict.next_token, token)
        assert torch.equal(verdict.last_row, n)  # the chain's row after n accepted drafts is row n
        assert torch.equal(verdict.accepted, torch.arange(k)[None] < n[:, None])


def test_an_empty_tree_samples_the_target_like_an_empty_chain():
    p = torch.softmax(torch.randn(8, 1, 4, dtype=DTYPE), -1)
    empty = TokenTree.from_parents(torch.empty(8, 0, dtype=torch.long), [])
    verdict = tree_rejection_sample(empty, p, None, torch.Generator().manual_seed(3))
    _, token = rejection_sample(p, None, torch.empty(8, 0, dtype=torch.long), torch.Generator().manual_seed(3))
    assert torch.equal(verdict.next_token, token) and verdict.num_accepted.tolist() == [0] * 8
    assert tree_greedy_accept(empty, p).next_token.tolist() == p[:, 0].argmax(-1).tolist()


def test_a_chain_is_todays_greedy_accept():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(200, 4, 3, generator=gen)
    drafts = torch.randint(3, (200, 3), generator=gen)
    n, token = greedy_accept(logits.argmax(-1).reshape(-1), drafts.reshape(-1), [3] * 200)  # ragged: 200 chains
    verdict = tree_greedy_accept(TokenTree.chain(drafts, DET), logits)
    assert torch.equal(verdict.num_accepted, n) and torch.equal(verdict.next_token, token)
    assert n.unique().numel() == 4  # every outcome 0..3 occurs


# -- greedy and seeded: plain decoding's text -------------------------------------------------------------------


VOCAB = 6


def _model_logits(prefix: tuple) -> torch.Tensor:
    """A random 'model': logits after a prefix, a fixed function of it."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(hash(prefix) % 2**31), dtype=DTYPE) * 2


def _random_tree(gen: torch.Generator, plain: list[int], mode: ChildSelection) -> TokenTree:
    """Paths of random tokens around one branch that follows plain decoding for a random number of tokens,
    so every accepted length occurs."""
    follow = int(torch.randint(len(plain) + 1, (1,), generator=gen))
    paths = [plain[:follow] + torch.randint(VOCAB, (2,), generator=gen).tolist()]
    for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
        depth = int(torch.randint(follow + 1, (1,), generator=gen))  # branching off the followed branch
        paths.append(plain[:depth] + torch.randint(VOCAB, (1 + int(torch.randint(3, (1,), generator=gen)),),
                                                   generator=gen).tolist())
    if mode == IID:  # i.i.d. draws may repeat: keep duplicates as separate children
        tokens, parents = [], []
        for path in paths:
            parent = -1
            for token in path:
                tokens.append(token)
                parents.append(parent)
                parent = len(tokens) - 1
        return TokenTree.from_parents(tokens, parents, IID)
    return TokenTree.from_paths(paths, mode)


def _target_rows(tree: TokenTree) -> torch.Tensor:
    return torch.stack([_model_logits(())] + [_model_logits(tuple(tree.path_tokens(i).tolist()))
                                              for i in range(tree.num_nodes)])


def _emitted(tree: TokenTree, verdict) -> list[int]:
    return tree.tokens[verdict.accepted].tolist() + [int(verdict.next_token)]


@pytest.mark.parametrize("mode", [DET, IID])
def test_greedy_tree_emits_plain_greedy_tokens(mode):
    gen = torch.Generator().manual_seed(4)
    plain = []  # longer than any tree's path plus its bonus
    for _ in range(10):
        plain.append(int(_model_logits(tuple(plain)).argmax()))
    lengths = set()
    for _ in range(60):
        tree = _random_tree(gen, plain[:4], mode)
        verdict = tree_greedy_accept(tree, _target_rows(tree))
        emitted = _emitted(tree, verdict)
        assert emitted == plain[:len(emitted)]
        assert tree.compaction_plan(verdict.accepted).length == len(emitted)
        lengths.add(len(emitted))
    assert lengths >= {1, 2, 3, 4}


def test_seeded_tree_emits_plain_seeded_tokens_tree_on_or_off():
    key, committed = 12345, 7  # the request's noise key and the output length before this step
    noise = position_noise(key, committed, 10, VOCAB, torch.device("cpu"))
    plain = []  # longer than any tree's path plus its bonus
    for i in range(10):  # plain seeded decoding: each position's own noise
        probs = torch.softmax(_model_logits(tuple(plain)) / 0.9, -1)
        plain.append(int(scores_with_log_noise(probs, noise[i].log()).argmax()))
    gen = torch.Generator().manual_seed(5)
    lengths = set()
    for mode in (DET, IID, WOR):
        for _ in range(40):
            tree = _random_tree(gen, plain[:4], mode)
            rows = torch.softmax(_target_rows(tree) / 0.9, -1)
            verdict = tree_seeded_accept(tree, rows, noise[: tree.max_depth + 1].log())
            emitted = _emitted(tree, verdict)
            assert emitted == plain[:len(emitted)]
            lengths.add(len(emitted))
    assert lengths >= {1, 2, 3, 4}
    with pytest.raises(ValueError, match="positions"):
        tree_seeded_accept(tree, rows, noise[:1].log())


# -- the exact law of the first two tokens ------------------------------------------------------------------------


class _World:
    """Target p(. | prefix) for prefixes of length 0..2 and draft q(. | prefix) for length 0..1, processed by
    sampling.probs_rows (temperature, top-k: zeros in p where q is positive and the other way round)."""

    def __init__(self, vocab: int, seed: int, target: SamplingParams, draft: SamplingParams):
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        prefixes = [()] + [(a,) for a in range(vocab)] + [(a, b) for a in range(vocab) for b in range(vocab)]
        self.p = {pre: probs_rows(torch.randn(1, vocab, generator=gen, dtype=DTYPE) * 1.5, [target])[0]
                  for pre in prefixes}
        self.q = {pre: probs_rows(torch.randn(1, vocab, generator=gen, dtype=DTYPE) * 1.5, [draft])[0]
                  for pre in prefixes if len(pre) <= 1}

    def p_table(self, depth: int) -> torch.Tensor:
        """p after every prefix of this length as a tensor: [V], [V, V] (row a: after a) or [V, V, V]."""
        return self._table(self.p, depth)

    def q_table(self, depth: int) -> torch.Tensor:
        return self._table(self.q, depth)

    def _table(self, law: dict, depth: int) -> torch.Tensor:
        prefixes = list(itertools.product(range(self.vocab), repeat=depth))
        return torch.stack([law[pre] for pre in prefixes]).reshape(*[self.vocab] * (depth + 1))

    def plain_law(self) -> torch.Tensor:
        """[V, V]: p(y1) p(y2 | y1)."""
        return torch.stack([self.p[()][a] * self.p[(a,)] for a in range(self.vocab)])

    def child_draws(self, q: torch.Tensor, k: int, mode: ChildSelection):
        """Every ordered tuple of k children the proposer can draw from q, with its probability."""
        if mode == DET:  # the top k by draft probability
            yield tuple(torch.topk(q, k).indices.tolist()), 1.0
            return
        if mode == DRW:  # one draw, then the top k - 1 of the other tokens
            for x in range(self.vocab):
                if q[x] > 0:
                    others = torch.topk(q.scatter(0, torch.tensor([x]), -1.0), k - 1).indices.tolist()
                    yield (x, *others), q[x].item()
            return
        choices = itertools.product(range(self.vocab), repeat=k) if mode == IID else \
            itertools.permutations(range(self.vocab), k)
        for xs in choices:
            prob, left = 1.0, 1.0
            for x in xs:
                prob *= q[x].item() / (left if mode == WOR else 1.0)
                left -= q[x].item()
            if prob > 0:
                yield xs, prob


def _all_trees(world: _World, grandchildren: tuple, mode: ChildSelection):
    """Every depth-2 tree (root children 0..k-1, then each one's children) with its probability, batched:
    (tree with tokens [B, N], probability [B], target rows [B, N + 1, V], draft rows [B, N, V])."""
    k = len(grandchildren)
    parents = [-1] * k + [j for j in range(k) for _ in range(grandchildren[j])]
    tokens, probs = [], []
    for top, top_prob in world.child_draws(world.q[()], k, mode):
        below = [list(world.child_draws(world.q[(c,)], m, mode)) for c, m in zip(top, grandchildren)]
        for combo in itertools.product(*below):
            tokens.append(list(top) + [x for xs, _ in combo for x in xs])
            probs.append(top_prob * math.prod(w for _, w in combo))
    tokens = torch.tensor(tokens)  # [B, N]
    tree = TokenTree.from_parents(tokens, parents, mode)
    above = tokens[:, torch.tensor(parents[k:])]  # [B, N - k]: each grandchild's parent token
    p_rows = torch.cat([world.p_table(0).expand(len(tokens), 1, -1), world.p_table(1)[tokens[:, :k]],
                        world.p_table(2)[above, tokens[:, k:]]], dim=1)
    q_rows = torch.cat([world.q_table(0).expand(len(tokens), k, -1), world.q_table(1)[above]], dim=1)
    return tree, torch.tensor(probs, dtype=DTYPE), p_rows, q_rows


def _law_given_trees(tree: TokenTree, acceptance, world: _World) -> torch.Tensor:
    """[B, V, V]: the exact law of (y1, y2) for each tree, integrating the verifier's uniforms: node i is taken
    when its parent was reached, every earlier sibling rejected and it accepted; the walk stops at a row when
    all its children are rejected and draws from that row's residual (normalised, as sampling.draw does)."""
    a = acceptance.accept_probs  # [B, N]
    residuals = acceptance.residuals / acceptance.residuals.sum(-1, keepdim=True)
    batch, vocab = a.shape[0], world.vocab
    reach = torch.ones(batch, tree.num_rows, dtype=DTYPE)  # per row: P(the walk reaches it)
    for i in range(tree.num_nodes):
        before = [s for s in tree.children(int(tree.parent_rows[i])) if s < i]
        reach[:, i + 1] = reach[:, int(tree.parent_rows[i])] * (1 - a[:, before]).prod(-1) * a[:, i]
    stop = torch.stack([reach[:, r] * (1 - a[:, tree.children(r)]).prod(-1) for r in range(tree.num_rows)], -1)
    law = torch.zeros(batch, vocab, vocab, dtype=DTYPE)
    law += stop[:, 0, None, None] * residuals[:, 0, :, None] * torch.stack([world.p[(y,)] for y in range(vocab)])
    rows = torch.arange(batch)
    for i in range(tree.num_nodes):
        c = tree.path_tokens(i)  # [B, depth]
        if tree.depth[i] == 1:  # the walk stops below c: y2 from c's row
            law[rows, c[:, 0]] += stop[:, i + 1, None] * residuals[:, i + 1]
        else:  # two accepted tokens: (c, g), whatever follows
            law[rows, c[:, 0], c[:, 1]] += reach[:, i + 1]
    return law


def _tree_law(world: _World, grandchildren: tuple, mode: ChildSelection, verify_as: ChildSelection | None = None):
    """The exact law of (y1, y2) [V, V] over every tree the proposer draws in `mode`, verified by
    tree_acceptance as `verify_as` (default: the mode they were drawn in; another mode plants a defect)."""
    tree, probs, p_rows, q_rows = _all_trees(world, grandchildren, mode)
    assert abs(probs.sum().item() - 1) < 1e-9
    verified = tree if verify_as is None else TokenTree.from_parents(tree.tokens, tree.parents.tolist(), verify_as)
    acceptance = tree_acceptance(verified, p_rows, q_rows)
    return (probs[:, None, None] * _law_given_trees(tree, acceptance, world)).sum(0)


WORLDS = {
    # vocab, seed, target processing, draft processing, children of each root child (2-3 at the root)
    "v3-t0.8topk2-3x(2,1,1)": (3, 0, dict(temperature=0.8, top_k=2), dict(temperature=1.2), (2, 1, 1)),
    "v4-t1.3-2x(2,2)": (4, 1, dict(temperature=1.3), dict(temperature=0.6), (2, 2)),
    "v4-t0.7-draft-topk3-3x(1,2,1)": (4, 2, dict(temperature=0.7), dict(temperature=1.0, top_k=3), (1, 2, 1)),
    "v5-t1.0topk4-3x(1,1,1)": (5, 3, dict(temperature=1.0, top_k=4), dict(temperature=1.5), (1, 1, 1)),
    "v5-t0.9topp0.85minp0.05-2x(2,1)": (5, 4, dict(temperature=0.9, top_p=0.85, min_p=0.05),
                                        dict(temperature=0.9, top_k=4), (2, 1)),
}


def _world(name):
    vocab, seed, target, draft, grandchildren = WORLDS[name]
    return _World(vocab, seed, SamplingParams(**target), SamplingParams(**draft)), grandchildren


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", list(WORLDS))
def test_tree_law_of_the_first_two_tokens_is_plain_sampling(name, mode):
    world, grandchildren = _world(name)
    law = _tree_law(world, grandchildren, mode)
    assert (law - world.plain_law()).abs().max().item() < 1e-9


@pytest.mark.parametrize("name", list(WORLDS))
def test_planted_defects_move_the_law(name):
    world, grandchildren = _world(name)
    plain = world.plain_law()
    # The laws are computed exactly in float64 (the right rules agree with plain to < 1e-9): a deviation of
    # 1e-4 is a defect, not rounding.
    # SpecInfer's rule with the draft's q for deterministic (top-k) children.
    assert (_tree_law(world, grandchildren, DET, verify_as=IID) - plain).abs().max().item() > 1e-4
    # The i.i.d. rule (q not renormalised over the remaining tokens) for children drawn without replacement.
    assert (_tree_law(world, grandchildren, WOR, verify_as=IID) - plain).abs().max().item() > 1e-4
    if max(grandchildren) > 1 or len(grandchildren) > 1:  # a drawn child with ranked siblings somewhere
        # The draft's q for the siblings of a drawn child (they are ranked, not drawn).
        assert (_tree_law(world, grandchildren, DRW, verify_as=IID) - plain).abs().max().item() > 1e-4


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_planted_unnormalised_residual_moves_the_law(mode, monkeypatch):
    world, grandchildren = _world("v4-t1.3-2x(2,2)")
    monkeypatch.setattr(verify_tree, "_next_residual", lambda r, q: (r - q).clamp_min(0.0))
    assert (_tree_law(world, grandchildren, mode) - world.plain_law()).abs().max().item() > 1e-4


def test_specinfer_rule_for_a_deterministic_child_is_not_exact():
    """The counterexample: p == q and one child, the draft's top token. Proposed with probability 1, the
    SpecInfer rule accepts it with min(1, p/q) = 1: the emitted token is always the top one, not a draw from p.
    As a point mass (DETERMINISTIC) it is accepted with p(x) and the output is p."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]], dtype=DTYPE)  # the root's row, then the child's
    q = p[:1].clone()
    for mode, accept in ((IID, 1.0), (DET, 0.5)):
        acceptance = tree_acceptance(TokenTree.from_parents([0], [-1], mode), p, q)
        assert acceptance.accept_probs.tolist() == [accept]
        first = torch.zeros(3, dtype=DTYPE)
        first[0] = accept
        first += (1 - accept) * acceptance.residuals[0] / acceptance.residuals[0].sum()
        assert torch.allclose(first, p[0]) == (mode == DET), (mode, first)


def test_a_drawn_first_child_is_verified_as_the_chains_draft_and_its_siblings_only_add():
    """DRAWN_FIRST: the drawn child's acceptance is the chain's min(1, p/q) (same uniform, same decision), and a
    ranked sibling is then tried against the chain's residual: P(a child is taken) = P(chain accepts) +
    P(chain rejects) * r_1(siblings) >= P(chain accepts), for every draw. Verified as DETERMINISTIC instead, the
    law stays exact (any children chosen apart from the verifier's draws are) but the drawn child is accepted
    only with p(x): no better than a ranked child."""
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(4, 6, generator=gen, dtype=DTYPE), -1)  # root row, then the 3 children's rows
    q = torch.softmax(torch.randn(1, 6, generator=gen, dtype=DTYPE), -1).expand(3, 6)
    for drawn in range(6):
        others = torch.topk(q[0].scatter(0, torch.tensor([drawn]), -1.0), 2).indices.tolist()
        tree = TokenTree.from_parents([drawn, *others], [-1, -1, -1], DRW)
        a = tree_acceptance(tree, p, q).accept_probs
        chain = min(1.0, (p[0, drawn] / q[0, drawn]).item())
        assert a[0].item() == pytest.approx(chain, abs=1e-12)
        taken = 1 - (1 - a).prod().item()
        residual = (p[0] - q[0]).clamp_min(0)
        residual = residual / residual.sum()
        assert taken == pytest.approx(chain + (1 - chain) * residual[others].sum().item(), abs=1e-12)
        assert taken >= chain
        as_ranked = tree_acceptance(TokenTree.from_parents(tree.tokens, [-1, -1, -1], DET), p, q).accept_probs
        assert as_ranked[0].item() == pytest.approx(p[0, drawn].item(), abs=1e-12)


# -- Monte Carlo of the whole sampler ---------------------------------------------------------------------------


def _draw_children(q: torch.Tensor, k: int, mode: ChildSelection, gen: torch.Generator) -> torch.Tensor:
    """[B, k] children from each row of q [B, V]: i.i.d., without replacement in draw order (Gumbel top-k:
    its descending order is the order of sequential draws, Kool et al. 2019), or the top k."""
    if mode == IID:
        return torch.multinomial(q, k, replacement=True, generator=gen)
    if mode == WOR:
        u = torch.rand(q.shape, generator=gen, dtype=DTYPE).clamp_min(1e-300)
        return torch.topk(q.log() - (-u.log()).log(), k, dim=-1).indices
    if mode == DRW:
        drawn = torch.multinomial(q, 1, generator=gen)
        return torch.cat([drawn, torch.topk(q.scatter(1, drawn, -1.0), k - 1, dim=-1).indices], 1)
    return torch.topk(q, k, dim=-1).indices


def _sampled_first_two(world: _World, grandchildren: tuple, mode: ChildSelection, n: int, seed: int,
                       verify_as: ChildSelection | None = None) -> torch.Tensor:
    """Counts [V, V] of (y1, y2) over n steps of the proposer and tree_rejection_sample, batched."""
    gen = torch.Generator().manual_seed(seed)
    vocab, k = world.vocab, len(grandchildren)
    p1, p2, q1 = world.p_table(1), world.p_table(2), world.q_table(1)
    top = _draw_children(world.q[()].expand(n, vocab), k, mode, gen)  # [n, k]
    below = [_draw_children(q1[top[:, j]], m, mode, gen) for j, m in enumerate(grandchildren)]
    tokens = torch.cat([top] + below, dim=1)  # [n, N]
    parents = [-1] * k + [j for j in range(k) for _ in range(grandchildren[j])]
    tree = TokenTree.from_parents(tokens, parents, verify_as or mode)
    grand_parent = torch.tensor(parents[k:])
    p_rows = torch.cat([world.p[()].expand(n, 1, vocab), p1[top], p2[top[:, grand_parent], tokens[:, k:]]], 1)
    q_rows = torch.cat([world.q[()].expand(n, k, vocab), q1[top[:, grand_parent]]], 1)
    verdict = tree_rejection_sample(tree, p_rows, q_rows, gen)
    # The accepted nodes in path order (ancestors have smaller indices): a stable sort brings them first.
    path = tokens.gather(1, torch.sort((~verdict.accepted).int(), dim=1, stable=True).indices)
    m = verdict.num_accepted
    y1 = torch.where(m >= 1, path[:, 0], verdict.next_token)
    y2 = torch.where(m >= 2, path[:, 1], torch.where(m == 1, verdict.next_token, -1))
    plain_next = torch.multinomial(p1[y1], 1, generator=gen).squeeze(1)  # after a stop at the root
    y2 = torch.where(y2 < 0, plain_next, y2)
    return torch.bincount(y1 * vocab + y2, minlength=vocab * vocab).reshape(vocab, vocab).double()


def _chi_square_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    n = counts.sum()
    keep = law.flatten() > 0
    assert counts.flatten()[~keep].sum() == 0, "a pair of probability zero was emitted"
    return float(stats.chisquare(counts.flatten()[keep].numpy(), (law.flatten()[keep] * n).numpy()).pvalue)


MC_SAMPLES = 40_000


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", ["v3-t0.8topk2-3x(2,1,1)", "v4-t0.7-draft-topk3-3x(1,2,1)"])
def test_sampler_follows_plain_sampling_in_monte_carlo(name, mode):
    """Fixed seeds; an exact sampler fails with probability 1e-4 (chi-square over <= 25 cells, each expected
    count in the hundreds at this N)."""
    world, grandchildren = _world(name)
    counts = _sampled_first_two(world, grandchildren, mode, MC_SAMPLES, seed=21)
    assert _chi_square_pvalue(counts, world.plain_law()) > 1e-4


@pytest.mark.parametrize("name,mode,verify_as", [
    ("v3-t0.8topk2-3x(2,1,1)", DET, IID),  # SpecInfer's rule with the draft's q for top-k children
    ("v4-t0.7-draft-topk3-3x(1,2,1)", WOR, IID),  # the i.i.d. rule for children drawn without replacement
    ("v4-t1.3-2x(2,2)", DRW, IID),  # the draft's q for a drawn child's ranked siblings
])
def test_monte_carlo_rejects_the_wrong_rule(name, mode, verify_as):
    world, grandchildren = _world(name)
    counts = _sampled_first_two(world, grandchildren, mode, MC_SAMPLES, seed=21, verify_as=verify_as)
    assert _chi_square_pvalue(counts, world.plain_law()) < 1e-4


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_monte_carlo_rejects_taking_the_last_passing_sibling(mode, monkeypatch):
    """A planted walk defect: of the siblings that pass, the last is taken (as if they were tried in reverse)."""
    monkeypatch.setattr(verify_tree, "_first_passing", lambda tree, passes: passes & ~(
        tree.earlier_siblings.transpose(0, 1) & passes[..., None, :]).any(-1))
    world, grandchildren = _world("v3-t0.8topk2-3x(2,1,1)")
    counts = _sampled_first_two(world, grandchildren, mode, MC_SAMPLES, seed=21)
    assert _chi_square_pvalue(counts, world.plain_law()) < 1e-4


def test_trees_of_one_shape_batched_give_each_trees_verdict():
    """Leading dimensions: B trees of one shape verified together give what each gives alone."""
    gen = torch.Generator().manual_seed(8)
    batch, vocab = 16, 5
    parents = [-1, -1, 0, 0, 1, 2]
    tokens = torch.stack([torch.cat([torch.randperm(vocab, generator=gen)[:2], torch.randperm(vocab, generator=gen)[:2],
                                     torch.randint(vocab, (2,), generator=gen)]) for _ in range(batch)])
    tree = TokenTree.from_parents(tokens, parents, WOR)
    logits = torch.randn(batch, 7, vocab, generator=gen, dtype=DTYPE)
    probs, q = torch.softmax(logits, -1), torch.softmax(torch.randn(batch, 6, vocab, generator=gen, dtype=DTYPE), -1)
    log_noise = position_noise(99, 0, tree.max_depth + 1, vocab, torch.device("cpu")).log()
    greedy, seeded = tree_greedy_accept(tree, logits), tree_seeded_accept(tree, probs, log_noise)
    acceptance = tree_acceptance(tree, probs, q)
    for b in range(batch):
        alone = TokenTree.from_parents(tokens[b], parents, WOR)
        for together, single in ((greedy, tree_greedy_accept(alone, logits[b])),
                                 (seeded, tree_seeded_accept(alone, probs[b], log_noise))):
            assert all(torch.equal(x[b], y) for x, y in zip(together, single))
        single = tree_acceptance(alone, probs[b], q[b])
        assert torch.allclose(acceptance.accept_probs[b], single.accept_probs, rtol=0, atol=1e-12)
        assert torch.allclose(acceptance.residuals[b], single.residuals, rtol=0, atol=1e-12)


def test_missing_draft_probs_and_wrong_rows_get_clear_errors():
    tree = TokenTree.from_parents([1, 2], [-1, -1], IID)
    p = torch.softmax(torch.randn(3, 4, dtype=DTYPE), -1)
    with pytest.raises(ValueError, match="need draft_probs"):
        tree_rejection_sample(tree, p, None)
    with pytest.raises(ValueError, match="needs 3"):
        tree_greedy_accept(tree, p[:2])
    with pytest.raises(ValueError, match="one per node"):
        tree_acceptance(tree, p, p)
    det = TokenTree.from_parents([1, 2], [-1, -1], DET)
    assert tree_rejection_sample(det, p, None).next_token.shape == ()

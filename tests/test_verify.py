"""Losslessness of verification, computed exactly by enumeration, plus Monte Carlo checks of the sampler.

The enumerations use the implementation's own pieces (processing, acceptance probabilities, residuals) and
compare the distribution of emitted tokens with plain autoregressive sampling from the processed target."""

import itertools

import pytest
import torch
from scipy import stats

from quickdraft import SamplingParams, verify
from quickdraft.sampling import PenaltyHistory, process
from quickdraft.verify import acceptance_probs, greedy_accept, rejection_sample, residual_probs

V = 5
DTYPE = torch.float64
PROCESSING = [
    dict(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r, presence_penalty=pp, frequency_penalty=f)
    for t, k, p, m, r, pp, f in itertools.product(
        [0.6, 1.0, 1.8], [0, 3], [1.0, 0.7], [0.0, 0.15], [1.0, 1.4], [0.0, 0.5], [0.0, 0.3])
]


def _history(prefix):
    hist = PenaltyHistory([0, 1], V, torch.device("cpu"))  # prompt tokens 0 and 1
    hist.append(list(prefix))
    return hist


def _processed(logits, params, prefix, pending=()):
    """Processed distributions of consecutive rows after prefix + pending[:i] (the implementation's path)."""
    hist = _history(prefix)
    pending = torch.tensor(list(pending), dtype=torch.long)
    seen, counts = hist.rows(pending, logits.shape[0])
    return process(logits, SamplingParams(**params), seen, counts)


def _emitted_first_token(p, q, x):
    """Exact distribution of the emitted token when draft token x was proposed from q (q None: one-hot)."""
    a = acceptance_probs(p[None, None], None if q is None else q[None, None], torch.tensor([[x]]))[0, 0]
    r = residual_probs(p[None, None], None if q is None else q[None, None], torch.tensor([[x]]))[0, 0]
    accept = torch.zeros(V, dtype=DTYPE)
    accept[x] = a
    return accept + (1 - a) * r


@pytest.mark.parametrize("params", PROCESSING, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_one_position_is_exact_for_every_processing(params):
    gen = torch.Generator().manual_seed(hash(tuple(params.values())) % 2**31)
    for _ in range(4):
        target = _processed(torch.randn(1, V, generator=gen, dtype=DTYPE) * 2, params, [2, 3, 3])[0]
        draft = _processed(torch.randn(1, V, generator=gen, dtype=DTYPE) * 2, params, [2, 3, 3])[0]
        emitted = sum(draft[x] * _emitted_first_token(target, draft, x) for x in range(V))
        assert (emitted - target).abs().max() < 1e-6
        # A deterministic draft is exact whatever single token it proposes.
        for x in range(V):
            assert (_emitted_first_token(target, None, x) - target).abs().max() < 1e-6


def _plain_joint(tables, params, length):
    """Plain autoregressive P(y_1..y_length) from a 'model' given as a table of logits per prefix."""
    joint = {}
    for ys in itertools.product(range(V), repeat=length):
        prob = 1.0
        for i in range(length):
            prob *= _processed(tables[ys[:i]][None], params, ys[:i])[0][ys[i]].item()
        joint[ys] = prob
    return joint


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=3, repetition_penalty=1.5),
    dict(temperature=1.3, top_p=0.8, presence_penalty=0.7, frequency_penalty=0.4),
    dict(temperature=0.9, min_p=0.1, repetition_penalty=0.8, frequency_penalty=-0.5),
], ids=["plain", "topk-rep", "topp-presence-freq", "minp-rewarding"])
@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_two_draft_tokens_with_history_dependent_penalties_are_exact(params, deterministic_draft):
    """K=2: the first three emitted tokens (two drafts and the bonus, or a correction and plain steps after
    it) are distributed exactly as three steps of plain sampling, with penalties that see the draft tokens."""
    gen = torch.Generator().manual_seed(7)
    prefixes = [()] + [(a,) for a in range(V)] + [(a, b) for a in range(V) for b in range(V)]
    target_table = {pre: torch.randn(V, generator=gen, dtype=DTYPE) * 2 for pre in prefixes}
    draft_table = {pre: torch.randn(V, generator=gen, dtype=DTYPE) * 2 for pre in prefixes}
    plain = _plain_joint(target_table, params, 3)

    def plain_next(prefix, y):  # P(y | prefix) under plain sampling
        return _processed(target_table[prefix][None], params, prefix)[0][y].item()

    emitted = dict.fromkeys(plain, 0.0)
    for x1, x2 in itertools.product(range(V), repeat=2):
        q1 = _processed(draft_table[()][None], params, ())[0]
        q2 = _processed(draft_table[(x1,)][None], params, (), pending=(x1,))[-1:][0]
        if deterministic_draft:  # a fixed proposal (x1, x2): weight the enumeration uniformly
            proposal_prob, q = 1.0 / V**2, None
        else:
            proposal_prob, q = (q1[x1] * q2[x2]).item(), torch.stack([q1, q2])
        rows = torch.stack([target_table[()], target_table[(x1,)], target_table[(x1, x2)]])
        p = _processed(rows, params, (), pending=(x1, x2))  # the verifier's three rows
        drafts = torch.tensor([[x1, x2]])
        a = acceptance_probs(p[None, :2], None if q is None else q[None], drafts)[0]
        r = residual_probs(p[None, :2], None if q is None else q[None], drafts)[0]
        for ys in plain:
            y1, y2, y3 = ys
            prob = (1 - a[0]).item() * r[0, y1].item() * plain_next((y1,), y2) * plain_next((y1, y2), y3)
            if y1 == x1:
                prob += a[0].item() * (1 - a[1]).item() * r[1, y2].item() * plain_next((y1, y2), y3)
                if y2 == x2:
                    prob += a[0].item() * a[1].item() * p[2, y3].item()
            emitted[ys] += proposal_prob * prob
    worst = max(abs(emitted[ys] - plain[ys]) for ys in plain)
    assert worst < 1e-6
    assert abs(sum(plain.values()) - 1) < 1e-9


def test_rejection_sample_draws_from_the_right_rows():
    """Monte Carlo over a batch of identical rows: the sampler's indexing (which row scores which draft
    token, residual vs bonus) must give the exact joint law of (num_accepted, next_token)."""
    gen = torch.Generator().manual_seed(3)
    k, batch = 2, 200_000
    p = torch.softmax(torch.randn(k + 1, V, generator=gen, dtype=DTYPE) * 1.5, -1)
    q = torch.softmax(torch.randn(k, V, generator=gen, dtype=DTYPE) * 1.5, -1)
    drafts = torch.tensor([1, 3])
    n, nxt = rejection_sample(p.expand(batch, -1, -1), q.expand(batch, -1, -1), drafts.expand(batch, -1),
                              torch.Generator().manual_seed(11))
    a = acceptance_probs(p[None, :k], q[None], drafts[None])[0]
    r = residual_probs(p[None, :k], q[None], drafts[None])[0]
    expected = torch.zeros(k + 1, V, dtype=DTYPE)
    expected[0] = (1 - a[0]) * r[0]
    expected[1] = a[0] * (1 - a[1]) * r[1]
    expected[2] = a[0] * a[1] * p[2]
    observed = torch.zeros(k + 1, V, dtype=DTYPE)
    observed.index_put_((n, nxt), torch.ones(batch, dtype=DTYPE), accumulate=True)
    mask = expected.flatten() > 0
    assert observed.flatten()[~mask].sum() == 0
    chi2, pvalue = stats.chisquare(observed.flatten()[mask].numpy(), expected.flatten()[mask].numpy() * batch)
    # Fixed seed; threshold at p = 1e-4 for this many cells.
    assert pvalue > 1e-4, (chi2, pvalue)


def test_rejection_sample_with_no_drafts_samples_the_target():
    p = torch.tensor([[[0.0, 1.0, 0.0]]])
    n, nxt = rejection_sample(p, None, torch.empty(1, 0, dtype=torch.long))
    assert n.tolist() == [0] and nxt.tolist() == [1]


def test_identical_draft_is_always_accepted_and_gets_a_bonus():
    p = torch.softmax(torch.randn(3, V, dtype=DTYPE), -1)[None]
    drafts = torch.tensor([[2, 4]])
    n, _ = rejection_sample(p, p[:, :2].clone(), drafts)
    assert n.tolist() == [2]


def test_greedy_accept_counts_matching_prefix_and_uses_the_right_position():
    # Row i is the target's prediction after input i: it scores draft token i.
    logits = torch.full((1, 4, V), -1.0)
    for i, tok in enumerate([3, 1, 4, 0]):
        logits[0, i, tok] = 1.0
    target = logits[0].argmax(-1)  # [num_rows]: the target's tokens, as the engine hands them over

    def accept(drafts):
        return greedy_accept(target, torch.tensor(drafts), [len(drafts)])

    assert [t.tolist() for t in accept([3, 1, 4])] == [[3], [0]]  # bonus
    assert [t.tolist() for t in accept([3, 2, 4])] == [[1], [1]]  # correction
    assert [t.tolist() for t in accept([0, 1, 4])] == [[0], [3]]


def _no_drafts():
    return torch.empty(0, dtype=torch.long)


def test_greedy_accept_is_ragged_over_the_batch():
    """Sequences of k = 0, 3, 2 and 0 drafts, their rows one after another (k + 1 each): each sequence's
    accepted prefix and next token come from its own rows only."""
    # rows:          seq 0 | seq 1        | seq 2   | seq 3
    target = torch.tensor([7, 1, 2, 9, 4, 6, 8, 3, 5])
    drafts = torch.tensor([1, 2, 3, 6, 8])  # seq 1: 1 2 (3 rejected, 9 corrects it); seq 2: 6 8 (bonus 3)
    accepted, token = greedy_accept(target, drafts, [0, 3, 2, 0])
    assert accepted.tolist() == [0, 2, 2, 0] and token.tolist() == [7, 9, 3, 5]
    # LOSSY relaxed passes: a passing draft is kept whatever it matches; the first failure still stops.
    passes = torch.tensor([False, False, True, False, False])
    accepted, token = greedy_accept(target, drafts, [0, 3, 2, 0], passes)
    assert accepted.tolist() == [0, 3, 2, 0] and token.tolist() == [7, 4, 3, 5]
    accepted, token = greedy_accept(target, torch.tensor([5, 2, 3, 6, 8]), [0, 3, 2, 0],
                                    torch.tensor([False, True, True, False, False]))
    assert accepted.tolist() == [0, 0, 2, 0] and token.tolist() == [7, 1, 3, 5]
    assert [t.tolist() for t in greedy_accept(torch.tensor([4, 2]), _no_drafts(), [0, 0])] == [[0, 0], [4, 2]]


def test_relaxed_greedy_test_passes_where_p_reaches_threshold_times_the_top_probability():
    from quickdraft.verify import relaxed_greedy_accepts

    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]], dtype=DTYPE))  # [B=1, K=2, V=3]
    draft = torch.tensor([[1, 0]])
    # 0.3 >= 0.5 * 0.5 passes, 0.1 >= 0.5 * 0.8 does not; at 0.1 both pass; the argmax always passes.
    assert relaxed_greedy_accepts(logits, draft, 0.5).tolist() == [[True, False]]
    assert relaxed_greedy_accepts(logits, draft, 0.1).tolist() == [[True, True]]
    assert relaxed_greedy_accepts(logits, torch.tensor([[0, 2]]), 1.0).tolist() == [[True, True]]


def test_relaxed_test_passes_where_p_reaches_threshold_times_q():
    from quickdraft.verify import relaxed_accepts

    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]], dtype=DTYPE)  # [B=1, K=2, V=3]
    q = torch.tensor([[[0.2, 0.6, 0.2], [0.6, 0.2, 0.2]]], dtype=DTYPE)
    draft = torch.tensor([[1, 0]])
    # 0.3 >= 0.5 * 0.6 passes; 0.1 >= 0.5 * 0.6 does not; one-hot q: p(x) >= threshold.
    assert relaxed_accepts(p, q, draft, 0.5).tolist() == [[True, False]]
    assert relaxed_accepts(p, None, draft, 0.3).tolist() == [[True, False]]
    assert relaxed_accepts(p, None, draft, 0.05).tolist() == [[True, True]]


def test_relaxed_rejection_sampling_is_lossy_and_only_when_asked():
    """Exact by default: the emitted law of one draft position is p. With a threshold, a draft token that
    passes p(x) >= threshold * q(x) is always accepted: the law moves towards q (computed exactly here)."""
    p = torch.tensor([0.6, 0.3, 0.1], dtype=DTYPE)
    q = torch.tensor([0.1, 0.3, 0.6], dtype=DTYPE)
    n = 40_000
    generator = torch.Generator().manual_seed(3)
    draft = torch.multinomial(q, n, replacement=True, generator=generator)[:, None]  # [n, 1]
    big_p = p.expand(n, 2, 3)
    big_q = q.expand(n, 1, 3)
    exact_law = p
    for threshold, expected in ((None, exact_law), (0.1, None)):
        accepted, token = rejection_sample(big_p, big_q, draft, generator, relaxed_threshold=threshold)
        first = torch.where(accepted > 0, draft[:, 0], token)
        counts = torch.bincount(first, minlength=3).double()
        if expected is None:
            # threshold 0.1: token 2 (p = 0.1 >= 0.1 * 0.6) is now always accepted: P(2) = q(2) = 0.6, far from 0.1.
            assert counts[2] / n > 0.55
        else:
            assert stats.chisquare(counts.numpy(), (expected * n).numpy()).pvalue > 1e-4


def test_greedy_accept_on_host_equals_greedy_accept_on_ragged_batches():
    """The host lists' rule (verify.greedy_accept_on_host) gives greedy_accept's counts and tokens, on 200 random
    ragged batches whose drafts match their rows often (3 tokens)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        ks = torch.randint(0, 6, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        drafts = torch.randint(0, 3, (sum(ks),), generator=gen)
        targets = torch.randint(0, 3, (sum(ks) + len(ks),), generator=gen)
        n, token = verify.greedy_accept(targets, drafts, ks)
        cu_drafts = [0]
        for k in ks:
            cu_drafts.append(cu_drafts[-1] + k)
        cu_rows = [c + i for i, c in enumerate(cu_drafts)]
        assert verify.greedy_accept_on_host(targets.tolist(), drafts.tolist(), cu_rows, cu_drafts) == \
            list(zip(n.tolist(), token.tolist()))

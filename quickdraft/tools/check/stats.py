"""The sampled check's statistics: chi-square goodness of fit against the exact law (or two-sample against plain
decoding's samples), cells pooled to the usual validity rule, prompts as strata, and the TV distance."""

from __future__ import annotations

import math

from quickdraft.tools.check.law import _PrefixTree
from quickdraft.tools.check.report import StatResult

MIN_EXPECTED = 5.0  # a chi-square cell's least expected count (the usual validity rule)


def _views(m: int) -> dict[str, tuple[int, int]]:
    """The statistics: the law of every prefix y1..yd (d = 1..m) and of every window of two tokens that is not a
    prefix (y2y3, ..., y{m-1}y{m}): a deviation confined to two neighbours, spread over many pooled cells of the
    joint law, shows clearly in their window. Slices (start, end) of the output."""
    views = {("y1" if d == 1 else f"y1..y{d}"): (0, d) for d in range(1, m + 1)}
    views.update({f"y{j + 1}y{j + 2}": (j, j + 2) for j in range(1, m - 1)})
    return views


def _chi2_pvalue(statistic: float, df: int) -> float:
    """P(chi2_df >= statistic): the regularised upper incomplete gamma Q(df/2, statistic/2)."""
    import torch

    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _pool(expected: list[float], n: int) -> tuple[list[int], int]:
    """Cells by expected count: those >= MIN_EXPECTED keep their own (indices in order), the rest share one pool;
    a pool of less than MIN_EXPECTED (but some mass) takes the smallest cells until it reaches it. Returns
    (group of each input cell, number of groups); the pool, if any, is the last group."""
    order = sorted(range(len(expected)), key=lambda i: expected[i])
    own = [i for i in order if expected[i] * n >= MIN_EXPECTED]
    pooled = [i for i in order if expected[i] * n < MIN_EXPECTED]
    pool_mass = sum(expected[i] for i in pooled)
    while pooled and pool_mass * n < MIN_EXPECTED and own:
        moved = own.pop(0)
        pooled.append(moved)
        pool_mass += expected[moved]
    groups = {i: g for g, i in enumerate(sorted(own))}
    count = len(own)
    if pooled:
        for i in pooled:
            groups[i] = count
        count += 1
    return [groups[i] for i in range(len(expected))], count


def _exact_view(tree: _PrefixTree, drawn: list[tuple[int, ...]], view: tuple[int, int]):
    """(statistic, degrees of freedom, observed [groups], expected probabilities [groups]) of one prompt."""
    cells = tree.known(view)
    keys = list(cells)
    remainder = max(0.0, 1.0 - sum(cells.values()))
    expected = [cells[k] for k in keys] + [remainder]  # the remainder: the prefixes the tree did not reach
    n = len(drawn)
    group_of, count = _pool(expected, n)
    index = {k: i for i, k in enumerate(keys)}
    observed = [0] * count
    expected_groups = [0.0] * count
    for i, p in enumerate(expected):
        expected_groups[group_of[i]] += p
    for tokens in drawn:
        key = tree.key(tokens, view)
        observed[group_of[index[key] if key in index else len(keys)]] += 1
    statistic = sum((o - n * e) ** 2 / (n * e) for o, e in zip(observed, expected_groups) if e > 0)
    # A group of no mass that holds samples (only rounding can leave one): as strong as evidence gets.
    if any(o > 0 and e <= 0 for o, e in zip(observed, expected_groups)):
        statistic = math.inf
    return statistic, count - 1, observed, expected_groups


def _two_sample_view(drawn: list[tuple[int, ...]], reference: list[tuple[int, ...]], view: tuple[int, int]):
    """A two-sample chi-square (a 2 x C contingency table) of one prompt: cells are the keys seen, those with a
    pooled count >= 2 x MIN_EXPECTED on their own. Returns (statistic, df, observed, reference observed)."""
    start, end = view
    keys_a = [t[:end][start:] for t in drawn]
    keys_b = [t[:end][start:] for t in reference]
    counts: dict[tuple[int, ...], list[int]] = {}
    for key in keys_a:
        counts.setdefault(key, [0, 0])[0] += 1
    for key in keys_b:
        counts.setdefault(key, [0, 0])[1] += 1
    keys = list(counts)
    total = len(drawn) + len(reference)
    group_of, count = _pool([(counts[k][0] + counts[k][1]) / total for k in keys], total // 2)
    a, b = [0] * count, [0] * count
    for i, key in enumerate(keys):
        a[group_of[i]] += counts[key][0]
        b[group_of[i]] += counts[key][1]
    statistic = 0.0
    for oa, ob in zip(a, b):
        column = oa + ob
        for observed, row in ((oa, len(drawn)), (ob, len(reference))):
            e = row * column / total
            statistic += (observed - e) ** 2 / e
    return statistic, count - 1, a, b


def _tv(observed: list[int], probs: list[float]) -> tuple[float, float]:
    """(0.5 sum |observed/n - p|, its expected value when the samples follow p: 0.5 sum sqrt(2 p (1-p) / (pi n)),
    the normal approximation of E|binomial/n - p|)."""
    n = sum(observed)
    tv = 0.5 * sum(abs(o / n - p) for o, p in zip(observed, probs))
    noise = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in probs if 0 < p < 1)
    return tv, noise


def _test(path: str, drawn: list[list[tuple[int, ...]]], metrics: list, laws: list[_PrefixTree | None],
          plain_samples: list[list[tuple[int, ...]]] | None, per_prompt: list[int], views: dict[str, tuple[int, int]],
          level: float, sample_tokens: int, forwards: int) -> StatResult:
    pvalues, dfs = {}, {}
    joint = (0, sample_tokens)
    tv = noise = 0.0
    for name, view in views.items():
        statistic, df = 0.0, 0
        for index, (tree, prompt_samples) in enumerate(zip(laws, drawn)):
            if tree is not None:
                s, d, observed, expected = _exact_view(tree, prompt_samples, view)
                if view == joint:
                    t, e = _tv(observed, expected)
            else:
                s, d, observed, reference = _two_sample_view(prompt_samples, plain_samples[index], view)
                if view == joint:
                    na, nb = sum(observed), sum(reference)
                    t = 0.5 * sum(abs(x / na - y / nb) for x, y in zip(observed, reference))
                    pooled = [(x + y) / (na + nb) for x, y in zip(observed, reference)]
                    # Two noisy laws of equal sizes: the difference spreads sqrt(2) x as much as one sample.
                    e = math.sqrt(2) * 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * na)) for p in pooled if p < 1)
            if view == joint:
                weight = len(prompt_samples) / sum(per_prompt)
                tv += weight * t
                noise += weight * e
            statistic += s
            df += d
        pvalues[name] = _chi2_pvalue(statistic, df) if math.isfinite(statistic) else 0.0
        dfs[name] = df
    impossible = [(index, tokens) for index, (tree, prompt_samples) in enumerate(zip(laws, drawn)) if tree is not None
                  for tokens in sorted(set(prompt_samples)) if tree.impossible(tokens)]
    from quickdraft.sequence import RequestMetrics

    drafts = RequestMetrics.combine(metrics)  # per-position counts summed over the sampled sequences
    return StatResult(path=path, samples=sum(per_prompt), sample_tokens=sample_tokens, pvalues=pvalues,
                      degrees_of_freedom=dfs, level=level,
                      exact_prompts=[i for i, t in enumerate(laws) if t is not None],
                      fallback_prompts=[i for i, t in enumerate(laws) if t is None], tree_forwards=forwards,
                      tv_distance=tv, tv_noise=noise, impossible=impossible,
                      proposed_per_position=list(drafts.proposed_per_position),
                      accepted_per_position=list(drafts.accepted_per_position))

"""Speculative verification: rejection sampling (Leviathan et al. 2023, Chen et al. 2023) and greedy matching.

Seeded sampled requests are verified by greedy matching too, of the target's own noise-keyed draws
(sampling.sample_with_noise with sampling.position_noise): the target's token at each position is exactly a
draw from its distribution, the same draw plain decoding makes, and a draft is accepted where it equals it.
The output is then plain sampling's output token for token, whatever K and whatever the draft.

Every acceptance rule of the engine lives here: greedy matching (greedy_accept) and rejection sampling
(rejection_sample_rows), both over the whole step's ragged batch as quickdraft.step_batch.StepBatch lays it
out, and the LOSSY relaxed tests (relaxed_accepts, relaxed_greedy_accepts). The ragged chains are read as a
padded [B, K] grid (ChainLayout: vLLM's rejection sampler pads the same way), so a step's sequences are
verified by a few tensor operations whatever their number. Pure tensor functions with no host
synchronisation: the caller reads the results once per step. rejection_sample is the same rule on a dense
[B, K + 1] batch (the form the exactness tests enumerate).

Position convention (the classic off-by-one): the target is run on [last committed token, d_1, ..., d_K];
its output row i is the distribution of the token *after* input i, so row i scores draft token d_{i+1}
(0-based: `p[:, i]` scores `draft[:, i]`) and row K is the bonus position used when all K are accepted.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quickdraft.sampling import draw


class ChainLayout(NamedTuple):
    """B sequences' chains of k_i drafts as a padded [B, K] grid (K = max k_i), on the device: sequence i's
    draft j is draft_token_ids[draft_index[i, j]] and is scored by row row_starts[i] + j; row_starts[i] + k_i
    is its bonus row. Entries with j >= k_i are not drafts (valid False; their indices are clamped in range)."""

    num_draft_tokens: torch.Tensor  # [B] long, k_i
    row_starts: torch.Tensor  # [B] long, the first of sequence i's rows
    draft_index: torch.Tensor  # [B, K] long
    valid: torch.Tensor  # [B, K] bool, j < k_i
    max_k: int  # K


def chain_layout(num_draft_tokens: list[int], device: torch.device | str, row_starts: list[int] | None = None,
                 draft_starts: list[int] | None = None, num_flat: int | None = None) -> ChainLayout:
    """The padded grid of ragged chains: k_i drafts each, their rows and drafts one sequence after another
    (k_i + 1 rows each) unless row_starts / draft_starts place them in num_flat drafts (a step whose token trees
    are verified apart gives those sequences k = 0 here and keeps their rows). One host-to-device copy."""
    if row_starts is None or draft_starts is None:
        row_starts, draft_starts, row, first = [], [], 0, 0
        for k in num_draft_tokens:
            row_starts.append(row)
            draft_starts.append(first)
            row, first = row + k + 1, first + k
    max_k = max(num_draft_tokens, default=0)
    host = torch.tensor([num_draft_tokens, row_starts, draft_starts], dtype=torch.long).to(device)
    ks, starts, firsts = host[0], host[1], host[2]
    j = torch.arange(max_k, device=device)
    last = max(sum(num_draft_tokens) if num_flat is None else num_flat, 1) - 1
    return ChainLayout(ks, starts, (firsts[:, None] + j).clamp(max=last), j < ks[:, None], max_k)


def accepted_lengths(passes: torch.Tensor) -> torch.Tensor:
    """[B, K] bool (False past each sequence's drafts) -> [B] long: the drafts before each row's first failure."""
    return passes.long().cumprod(-1).sum(-1)


def greedy_accept(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_draft_tokens: list[int],
                  passes: torch.Tensor | None = None, layout: ChainLayout | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept each sequence's longest prefix of draft tokens equal to the target's own tokens, ragged over a
    batch (the layout of quickdraft.step_batch.StepBatch).

    target_tokens: [num_rows] the target's token at each row (the argmax of its processed logits, or a seeded
    request's noise-keyed draw); sequence i's k_i + 1 rows follow sequence i - 1's. draft_tokens:
    [num_draft_tokens] the drafts, flat; num_draft_tokens: [batch] the k_i (host integers: shapes). passes:
    [num_draft_tokens] bool or None: drafts that pass whatever they match (LOSSY relaxed acceptance only).
    layout: the batch's chain_layout where the caller has it (it places the rows and drafts otherwise).
    Returns (num_accepted [batch], next_token [batch]): next_token is the target's own token after the accepted
    prefix (a correction, or the bonus when all k_i are accepted). No host synchronisation."""
    device = target_tokens.device
    layout = layout if layout is not None else chain_layout(num_draft_tokens, device)
    if layout.max_k == 0:
        return torch.zeros_like(layout.row_starts), target_tokens[layout.row_starts]
    rows = (layout.row_starts[:, None] + torch.arange(layout.max_k, device=device)).clamp(max=target_tokens.numel() - 1)
    drafts = draft_tokens.to(device)[layout.draft_index]  # [B, K]
    ok = target_tokens[rows] == drafts
    if passes is not None:
        ok |= passes.to(device)[layout.draft_index]
    num_accepted = accepted_lengths(ok & layout.valid)
    return num_accepted, target_tokens[layout.row_starts + num_accepted]


def greedy_accept_on_host(target_tokens: list[int], draft_tokens: list[int], cu_num_rows: list[int],
                          cu_num_draft_tokens: list[int]) -> list[tuple[int, int]]:
    """greedy_accept over host lists (the step's rows already read back): for each sequence i, whose k_i drafts
    are draft_tokens[cu_num_draft_tokens[i]:cu_num_draft_tokens[i + 1]] and whose k_i + 1 rows start at
    cu_num_rows[i], (num_accepted, next_token): its longest prefix of drafts equal to its rows' tokens, and the
    token of the row after that prefix (a correction, or the bonus)."""
    out = []
    for i in range(len(cu_num_rows) - 1):
        row, first, k = cu_num_rows[i], cu_num_draft_tokens[i], cu_num_draft_tokens[i + 1] - cu_num_draft_tokens[i]
        n = 0
        while n < k and draft_tokens[first + n] == target_tokens[row + n]:
            n += 1
        out.append((n, target_tokens[row + n]))
    return out


def relaxed_greedy_accepts(logits: torch.Tensor, draft_tokens: torch.Tensor, threshold: float) -> torch.Tensor:
    """LOSSY: whether each draft token x of a greedy request passes the relaxed test p(x) >= threshold * max p,
    p the softmax of the target's processed logits (greedy decoding's counterpart of relaxed_accepts: the
    target's top probability stands for q(x)). logits: [B, K, V], draft_tokens: [B, K]. Returns bool [B, K]."""
    probs = torch.softmax(logits.float(), -1)
    px = probs.gather(-1, draft_tokens[..., None].to(probs.device)).squeeze(-1)
    return px >= threshold * probs.max(-1).values


def _as_draft_probs(q: torch.Tensor | None, draft_tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # A deterministic draft (n-gram lookup) proposes with probability one: q is one-hot at its token.
    if q is not None:
        return q.to(like.dtype)
    return torch.zeros_like(like).scatter_(-1, draft_tokens[..., None], 1.0)


def acceptance_rates(px: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) from the draft tokens' target and draft probabilities (any shape, alike)."""
    # A token drawn from q has q(x) > 0; the clamp only keeps a 0/0 from becoming NaN (it gives 0).
    return (px / qx.clamp_min(torch.finfo(px.dtype).tiny)).clamp(max=1.0)


def acceptance_probs(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for each draft token x. p, q: [B, K, V]; q None means one-hot. Returns [B, K]."""
    q = _as_draft_probs(q, draft_tokens, p)
    px = p.gather(-1, draft_tokens[..., None]).squeeze(-1)
    qx = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    return acceptance_rates(px, qx)


def relaxed_accepts(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """LOSSY: whether each draft token x passes the relaxed test p(x) >= threshold * q(x) (accepted whatever the
    random draw). p, q: [B, K, V] (q None: one-hot, so the test is p(x) >= threshold). Returns bool [B, K].
    Only the relaxed acceptance mode asks for this; exact verification never does."""
    q = _as_draft_probs(q, draft_tokens, p)
    px = p.gather(-1, draft_tokens[..., None]).squeeze(-1)
    qx = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    return px >= threshold * qx


def residual_probs(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor) -> torch.Tensor:
    """The distribution to sample from after a rejection: max(0, p - q) renormalised. [B, K, V].

    When p == q the residual is empty; a rejection then has probability zero, and p is returned so the
    result stays a distribution."""
    q = _as_draft_probs(q, draft_tokens, p)
    residual = (p - q).clamp_min(0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


def residual_rows(row_starts: torch.Tensor, num_accepted: torch.Tensor, num_draft_tokens: torch.Tensor
                  ) -> torch.Tensor:
    """[B]: the row each sequence's next token is drawn from: the row after its accepted drafts, row_starts +
    num_accepted (the first rejected draft's row, whose residual max(0, p - q) it is drawn from, or the bonus
    row when all k_i were accepted)."""
    return row_starts + num_accepted


def rejection_sample_rows(probs: torch.Tensor, layout: ChainLayout, draft_tokens: torch.Tensor,
                          draft_probs: torch.Tensor | None, draft_prob_starts: torch.Tensor | None,
                          uniforms: torch.Tensor, draw_uniforms: torch.Tensor,
                          relaxed_threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling of B sequences' chains at once (unless relaxed_threshold is given: see
    rejection_sample).

    probs: [num_rows, V] processed target probabilities, the sequences' rows placed by `layout` (row j of a
    sequence scores its draft j, row k_i is its bonus row); draft_tokens: [num_draft_tokens] flat, placed by
    layout.draft_index; draft_probs: [M, V] the processed draft distributions q the drafts were drawn from,
    sequence i's k_i rows from draft_prob_starts[i] ([B] long; -1, or draft_probs None: a deterministic draft,
    q one-hot at each token). uniforms: [B, K] and draw_uniforms: [B] float64, each sequence's own draws (from
    its own generator: a sequence's randomness does not depend on its batch-mates).

    Token j is accepted with probability min(1, p_j(x)/q_j(x)); at the first rejection the next token is drawn
    from max(0, p - q) renormalised (computed on that row only), and when all k_i are accepted the bonus is drawn
    from p at row k_i; every sequence's next token in one draw. Returns (num_accepted [B], next_token [B])."""
    device, vocab = probs.device, probs.shape[-1]
    if layout.max_k == 0:
        return torch.zeros_like(layout.row_starts), draw(probs[layout.row_starts], uniform=draw_uniforms)
    j = torch.arange(layout.max_k, device=device)
    rows = (layout.row_starts[:, None] + j).clamp(max=probs.shape[0] - 1)  # [B, K]
    x = draft_tokens.to(device)[layout.draft_index]  # [B, K]
    px = probs[rows, x]
    has_q = None
    if draft_probs is None:
        qx = torch.ones_like(px)
    else:
        has_q = draft_prob_starts >= 0  # [B]
        first = draft_prob_starts.clamp(min=0)
        qx = torch.where(has_q[:, None], draft_probs[(first[:, None] + j).clamp(max=draft_probs.shape[0] - 1), x]
                         .to(px.dtype), 1.0)
    passes = uniforms.to(px.dtype) < acceptance_rates(px, qx)
    if relaxed_threshold is not None:
        passes |= px >= relaxed_threshold * qx
    num_accepted = accepted_lengths(passes & layout.valid)
    chosen = probs[residual_rows(layout.row_starts, num_accepted, layout.num_draft_tokens)]  # [B, V]
    rejected = num_accepted < layout.num_draft_tokens
    position = num_accepted.clamp(max=layout.max_k - 1)
    x_chosen = x.gather(1, position[:, None]).squeeze(1)  # [B]: the rejected draft where there is one
    q_chosen = None
    if draft_probs is not None:
        one_hot = torch.zeros_like(chosen).scatter_(-1, x_chosen[:, None], 1.0)
        q_rows = draft_probs[(first + position).clamp(max=draft_probs.shape[0] - 1)].to(chosen.dtype)
        q_chosen = torch.where(has_q[:, None], q_rows, one_hot)
    chosen = torch.where(rejected[:, None], residual_probs(chosen, q_chosen, x_chosen), chosen)
    return num_accepted, draw(chosen.reshape(-1, vocab), uniform=draw_uniforms)


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    relaxed_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (unless relaxed_threshold is given: see below) of a dense batch: the rule of
    rejection_sample_rows with every sequence drafting K tokens.

    p: [B, K+1, V] processed target probabilities, q: [B, K, V] processed draft probabilities or None for a
    deterministic draft, draft_tokens: [B, K]. Token i is accepted with probability min(1, p_i(x)/q_i(x));
    at the first rejection the next token is drawn from max(0, p_i - q_i) renormalised; when all K are
    accepted it is a bonus token drawn from p_K. The emitted tokens are distributed exactly as K+1 steps of
    plain sampling from p. Draws the [B, K] uniforms and then the B tokens' from `generator`. Returns
    (num_accepted [B], next_token [B]).

    relaxed_threshold (LOSSY, None by default): a draft token also passes whenever p(x) >= threshold * q(x)
    (relaxed_accepts); the output then no longer follows p."""
    batch, k = draft_tokens.shape
    vocab = p.shape[-1]
    uniform = torch.rand(batch, k, generator=generator, device=p.device, dtype=p.dtype) if k else \
        torch.ones(batch, 0, device=p.device, dtype=p.dtype)
    draw_uniform = torch.rand(batch, generator=generator, dtype=torch.float64, device=p.device)
    layout = chain_layout([k] * batch, p.device)
    q_flat = None if q is None else q.reshape(batch * k, vocab)
    starts = None if q is None else torch.arange(batch, device=p.device) * k
    return rejection_sample_rows(p.reshape(batch * (k + 1), vocab), layout, draft_tokens.reshape(-1), q_flat,
                                 starts, uniform, draw_uniform, relaxed_threshold)

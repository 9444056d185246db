"""Speculative verification: rejection sampling (Leviathan et al. 2023, Chen et al. 2023) and greedy matching.

Seeded sampled requests are verified by greedy matching too, of the target's own noise-keyed draws
(sampling.sample_with_noise with sampling.position_noise): the target's token at each position is exactly a
draw from its distribution, the same draw plain decoding makes, and a draft is accepted where it equals it.
The output is then plain sampling's output token for token, whatever K and whatever the draft.

Every acceptance rule of the engine lives here: greedy matching (greedy_accept, ragged over the step's
sequences), rejection sampling (rejection_sample) and the LOSSY relaxed tests (relaxed_accepts,
relaxed_greedy_accepts). Pure tensor functions, batched over a leading dimension B (greedy_accept: ragged, as
quickdraft.step_batch.StepBatch lays the step out), with no host synchronisation: the caller reads the results
once per step.

Position convention (the classic off-by-one): the target is run on [last committed token, d_1, ..., d_K];
its output row i is the distribution of the token *after* input i, so row i scores draft token d_{i+1}
(0-based: `p[:, i]` scores `draft[:, i]`) and row K is the bonus position used when all K are accepted.
"""

from __future__ import annotations

import torch

from quickdraft.sampling import draw


def greedy_accept(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_draft_tokens: list[int],
                  passes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept each sequence's longest prefix of draft tokens equal to the target's own tokens, ragged over a
    batch (the layout of quickdraft.step_batch.StepBatch).

    target_tokens: [num_rows] the target's token at each row (the argmax of its processed logits, or a seeded
    request's noise-keyed draw); sequence i's k_i + 1 rows follow sequence i - 1's. draft_tokens:
    [num_draft_tokens] the drafts, flat; num_draft_tokens: [batch] the k_i (host integers: shapes). passes:
    [num_draft_tokens] bool or None: drafts that pass whatever they match (LOSSY relaxed acceptance only).
    Returns (num_accepted [batch], next_token [batch]): next_token is the target's own token after the accepted
    prefix (a correction, or the bonus when all k_i are accepted). No host synchronisation."""
    device = target_tokens.device
    batch, total = len(num_draft_tokens), sum(num_draft_tokens)
    ks = torch.tensor(num_draft_tokens, device=device)  # [batch]
    first_draft = ks.cumsum(0) - ks  # [batch]
    seq = torch.repeat_interleave(torch.arange(batch, device=device), ks, output_size=total)  # [num_draft_tokens]
    flat = torch.arange(total, device=device)
    # Sequence i's draft j sits at flat index first_draft[i] + j and is scored by row first_draft[i] + i + j.
    stops = target_tokens[flat + seq] != draft_tokens.to(device)
    if passes is not None:
        stops &= ~passes.to(device)
    local = flat - first_draft[seq]
    num_accepted = ks.scatter_reduce(0, seq, torch.where(stops, local, ks[seq]), "amin")  # first stop, else k_i
    next_token = target_tokens[first_draft + torch.arange(batch, device=device) + num_accepted]
    return num_accepted, next_token


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


def acceptance_probs(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for each draft token x. p, q: [B, K, V]; q None means one-hot. Returns [B, K]."""
    q = _as_draft_probs(q, draft_tokens, p)
    px = p.gather(-1, draft_tokens[..., None]).squeeze(-1)
    qx = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    # A token drawn from q has q(x) > 0; the clamp only keeps a 0/0 from becoming NaN (it gives 0).
    return (px / qx.clamp_min(torch.finfo(p.dtype).tiny)).clamp(max=1.0)


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


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    relaxed_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (unless relaxed_threshold is given: see below).

    p: [B, K+1, V] processed target probabilities, q: [B, K, V] processed draft probabilities or None for a
    deterministic draft, draft_tokens: [B, K]. Token i is accepted with probability min(1, p_i(x)/q_i(x));
    at the first rejection the next token is drawn from max(0, p_i - q_i) renormalised; when all K are
    accepted it is a bonus token drawn from p_K. The emitted tokens are distributed exactly as K+1 steps of
    plain sampling from p. Returns (num_accepted [B], next_token [B]).

    relaxed_threshold (LOSSY, None by default): a draft token also passes whenever p(x) >= threshold * q(x)
    (relaxed_accepts); the output then no longer follows p."""
    batch, k = draft_tokens.shape
    vocab = p.shape[-1]
    if k == 0:
        return (
            torch.zeros(batch, dtype=torch.long, device=p.device),
            draw(p[:, 0], generator),
        )
    uniform = torch.rand(batch, k, generator=generator, device=p.device, dtype=p.dtype)
    passes = uniform < acceptance_probs(p[:, :k], q, draft_tokens)
    if relaxed_threshold is not None:
        passes = passes | relaxed_accepts(p[:, :k], q, draft_tokens, relaxed_threshold)
    accepted = passes.long()
    num_accepted = accepted.cumprod(-1).sum(-1)
    # One distribution per position: the residual where a rejection would happen, p_K for the bonus.
    candidates = torch.cat([residual_probs(p[:, :k], q, draft_tokens), p[:, k:]], dim=1)
    chosen = candidates.gather(1, num_accepted[:, None, None].expand(batch, 1, vocab)).squeeze(1)
    next_token = draw(chosen, generator)
    return num_accepted, next_token

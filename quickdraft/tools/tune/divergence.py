"""KL and total variation between the target's and a model draft's next-token distributions."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from quickdraft.errors import QuickdraftError


def distribution_divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, KL(p || q) and the total variation 1/2 sum |p - q| between p = softmax(target / T) and
    q = softmax(draft / T). target_logits, draft_logits: [n, V]; returns ([n], [n]). A token the draft cannot
    produce but the target can makes the KL infinite (as it is)."""
    if target_logits.shape != draft_logits.shape:
        raise QuickdraftError(f"target and draft logits differ in shape: {tuple(target_logits.shape)} vs "
                              f"{tuple(draft_logits.shape)}")
    log_p = torch.log_softmax(target_logits.double() / temperature, dim=-1)  # [n, V]
    log_q = torch.log_softmax(draft_logits.double() / temperature, dim=-1)  # [n, V]
    p, q = log_p.exp(), log_q.exp()
    kl = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)  # [n]
    tv = 0.5 * (p - q).abs().sum(-1)  # [n]
    return kl, tv


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [n, V_draft] on the target's vocabulary [n, vocab] (vocabularies that differ only by padding,
    as the draft_model proposer reconciles them: the draft's extra rows dropped, the target's extra ids given
    no draft probability)."""
    extra = vocab - logits.shape[-1]
    if extra < 0:
        return logits[..., :vocab]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits


@torch.inference_mode()
def measure_divergence(target, draft, sequences: Sequence[tuple[list[int], list[int]]],
                       temperature: float = 1.0) -> tuple[float, float, int]:
    """Mean KL(target || draft) and total variation over the positions of `sequences` (prompt ids, the
    target's continuation): each runner reads prompt + continuation in one forward, and row j compares their
    distributions of continuation token j. Returns (mean KL, mean TV, positions compared)."""
    kl_sum, tv_sum, positions = 0.0, 0.0, 0
    limit = min(target.max_len, draft.max_len)
    for prompt_ids, continuation in sequences:
        count = min(len(continuation), limit - len(prompt_ids) + 1)
        if count < 1:
            continue
        feed = torch.tensor(prompt_ids + continuation[:count - 1], dtype=torch.long)  # [prompt + count - 1]
        target_logits = target.forward(target.new_cache(), feed.to(target.device), num_logits=count)  # [count, V]
        draft_logits = draft.forward(draft.new_cache(), feed.to(draft.device), num_logits=count)  # [count, V_draft]
        draft_logits = _to_vocab(draft_logits.to(target_logits.device), target_logits.shape[-1])  # [count, V]
        kl, tv = distribution_divergence(target_logits, draft_logits, temperature)
        kl_sum += float(kl.sum())
        tv_sum += float(tv.sum())
        positions += count
    if not positions:
        return math.nan, math.nan, 0
    return kl_sum / positions, tv_sum / positions, positions

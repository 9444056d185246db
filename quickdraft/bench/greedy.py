"""Greedy check: under greedy decoding every method must produce the reference's tokens. A divergence is
reported with its first index and, to tell float noise from a bug, the target's top-2 logit gap there,
recomputed with one full forward over the shared prefix (a near-tie means the two orders of floating-point
summation may pick either token)."""

from __future__ import annotations

from typing import Sequence

import torch

NEAR_TIE_RELATIVE_GAP = 1e-3  # float32; in bf16/fp16 a few units of the last place (see near_tie_gap)


def near_tie_gap(dtype: torch.dtype) -> float:
    """The relative top-2 gap under which two forwards that round differently may disagree."""
    return NEAR_TIE_RELATIVE_GAP if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


def first_divergence(turns: Sequence[tuple[list[int], list[int]]], reference: Sequence[tuple[list[int], list[int]]]):
    """(turn, index) of the first token where two conversations differ, or None. Each turn is (prompt_ids,
    output_ids); a later turn is compared only while everything before it agreed."""
    for turn, ((prompt, out), (ref_prompt, ref_out)) in enumerate(zip(turns, reference)):
        if prompt != ref_prompt:
            return turn, -1  # cannot happen when the earlier turns agreed; reported rather than hidden
        if out != ref_out:
            index = next((i for i, (a, b) in enumerate(zip(out, ref_out)) if a != b), min(len(out), len(ref_out)))
            return turn, index
    return None


@torch.inference_mode()
def explain(target, prefix: list[int], token: int | None, ref_token: int | None) -> dict:
    """The target's logits after `prefix` in one full forward: the top-2 gap and both methods' tokens.
    target: the target's runner (its own weights: a quantized runner's, not a dequantized copy's), or a
    transformers model."""
    if isinstance(target, torch.nn.Module):
        from quickdraft.models.hf import HFRunner

        target = HFRunner(target)
    logits = target.forward(target.new_cache(), torch.tensor(prefix), 1)[0].float()
    top = torch.topk(logits, 2)
    (v1, v2), (t1, t2) = top.values.tolist(), top.indices.tolist()
    gap = v1 - v2
    relative = gap / max(abs(v1), 1e-12)

    def logit(t):
        return float(logits[t]) if t is not None and 0 <= t < logits.shape[0] else None

    return {
        "top2_tokens": [t1, t2], "top2_logits": [v1, v2], "top2_gap": gap, "top2_relative_gap": relative,
        "method_token": token, "method_token_logit": logit(token),
        "reference_token": ref_token, "reference_token_logit": logit(ref_token),
        "near_tie": relative < near_tie_gap(target.dtype) and {token, ref_token} <= {t1, t2},
    }


def check(target, turns, reference, note: str | None = None) -> dict | None:
    """None when the conversation equals the reference's; else where it diverged and why it might have."""
    found = first_divergence(turns, reference)
    if found is None:
        return None
    turn, index = found
    record = {"turn": turn, "index": index}
    if index >= 0:
        prompt, out = turns[turn]
        ref_out = reference[turn][1]
        token = out[index] if index < len(out) else None
        ref_token = ref_out[index] if index < len(ref_out) else None
        record.update(explain(target, list(prompt) + list(ref_out[:index]), token, ref_token))
    if note:
        record["note"] = note
    return record

"""What a step costs, measured in the run, and the speedup an analytic model (quickdraft/speedup_model.py) predicts.

The model (Leviathan et al. 2023, extended to drafts that sometimes propose nothing):
  alpha  per-token acceptance: the chance that a draft token is accepted given that the ones before it were
  f      the fraction of steps that proposed at least one token (1 for model drafts; a lookup may miss)
  k      the mean draft length of those steps (K for model drafts)
  E      expected tokens per step = (1 - f) + f * (1 - alpha^(k+1)) / (1 - alpha)
  cost   per step = (1 - f) * t_target(1) + f * t_target(k+1) + draft time per step
         (a model draft: K * t_draft_step; a lookup: its measured propose time)
  predicted speedup = E * t_target(1) / cost
For f = 1 and k = K this is Leviathan et al.'s E = (1 - alpha^(K+1)) / (1 - alpha) and cost
t_target(K+1) + K * t_draft_step. The measured speedup also pays for verification and bookkeeping, which the
model leaves out, so measured / predicted below 1 is that overhead.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from quickdraft.engine import RequestMetrics
# The model's formulas (the module doc): expected_tokens_per_step is the name the bench's reports and tests know.
from quickdraft.speedup_model import forward_seconds, pooled_step_seconds, speedup_over_plain
from quickdraft.speedup_model import pooled_expected_tokens_per_step as expected_tokens_per_step

MODEL_DESCRIPTION = (__doc__ or "").split("\n\n", 1)[1].strip()


def measure_target_forward(runner, context_ids: Sequence[int], sizes: Sequence[int],
                           repeats: int = 7) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens (for each n in sizes) after a cache of
    context_ids, n logits kept, as in a verification step. Sizes are interleaved within each repeat so that
    drift affects them alike; one extra round warms up."""
    context = len(context_ids)
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor(list(context_ids), dtype=torch.long), num_logits=1)
    extra = torch.tensor([context_ids[i % context] for i in range(max(sizes))], dtype=torch.long)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(repeats + 1):
        for n in sizes:
            start = time.perf_counter()
            logits = runner.forward(cache, extra[:n], num_logits=n)
            if logits.is_cuda:
                torch.cuda.synchronize(logits.device)
            elapsed = time.perf_counter() - start
            cache.rollback(context)
            if round_:
                times[n].append(elapsed)
    return {n: statistics.median(ts) for n, ts in times.items()}


def draft_statistics(metrics: Sequence[RequestMetrics]) -> dict[str, float | None]:
    """alpha, f and k (see the module doc) and the draft time per step, pooled over requests.

    alpha is the engine's own per-position count: accepted draft tokens over the draft positions that were
    judged (reached: every earlier draft of the step accepted), whatever K each step used."""
    pooled = RequestMetrics.combine(list(metrics))
    steps = pooled.target_forwards
    reached = sum(pooled.reached_per_position)
    accepted = sum(pooled.accepted_per_position)
    drafted_steps = pooled.num_drafts
    draft_time = pooled.draft_time_s
    draft_forwards = pooled.draft_forwards
    return {
        "alpha": accepted / reached if reached else None,
        "draft_fraction": drafted_steps / steps if steps else None,
        "mean_draft_length": pooled.proposed_tokens / drafted_steps if drafted_steps else None,
        "draft_s_per_step": draft_time / steps if steps else None,
        "draft_s_per_forward": draft_time / draft_forwards if draft_forwards else None,
        "draft_forwards_per_step": draft_forwards / steps if steps else None,
    }


def predict(stats: dict[str, float | None], forward_s: dict[int, float]) -> dict[str, float | None]:
    """The analytic prediction for one method from its draft statistics and the measured forward costs."""
    alpha, f, k, draft = (stats[key] for key in ("alpha", "draft_fraction", "mean_draft_length", "draft_s_per_step"))
    if alpha is None or f is None or k is None or draft is None:
        return {"predicted_tokens_per_step": None, "predicted_step_s": None, "predicted_speedup": None}
    tokens = expected_tokens_per_step(alpha, k, f)
    step = pooled_step_seconds(f, k, forward_s, draft)
    return {"predicted_tokens_per_step": tokens, "predicted_step_s": step,
            "predicted_speedup": speedup_over_plain(tokens, step, forward_seconds(forward_s, 1))}


def measure_read_bandwidth(device: torch.device, size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second this device reads: the median time to sum a float32 tensor of size_bytes (1 GiB by
    default, larger than any CPU's cache, so the figure is memory's, not the cache's)."""
    data = torch.ones(size_bytes // 4, device=device)  # written, so that every page is really mapped
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        data.sum().item()
        if i:
            times.append(time.perf_counter() - start)
    del data
    return size_bytes / statistics.median(times)


def runner_costs(runners: dict[str, object], context_ids: Sequence[int], k: int, bandwidth: float,
                 repeats: int) -> dict[str, dict[str, float]]:
    """For each runner: one-token and (k+1)-token forward times, and the one-token forward against the floor
    its weight bytes impose at the measured bandwidth (a forward cannot read its weights faster)."""
    out = {}
    for name, runner in runners.items():
        # Which tokens a forward reads does not change its time: a draft with another vocabulary reads the
        # context's ids folded into its own.
        ids = [t % runner.vocab_size for t in context_ids]
        forward = measure_target_forward(runner, ids, [1, k + 1], repeats)
        size = int(runner.weight_bytes)  # the bytes of weights one decoding step reads
        floor = size / bandwidth
        out[name] = {"weight_MB": size / 1e6, "floor_ms": 1e3 * floor, "forward_1_ms": 1e3 * forward[1],
                     f"forward_{k + 1}_ms": 1e3 * forward[k + 1], "forward_1_over_floor": forward[1] / floor,
                     f"forward_{k + 1}_over_1": forward[k + 1] / forward[1]}
    return out

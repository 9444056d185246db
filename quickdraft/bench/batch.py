"""The batch sweep (`quickdraft bench --batch-sizes 1,4,16,64`): throughput of many prompts at once.

For each batch size B, each method generates for all the prompts (the first turn of each record) through
continuous batching with at most B sequences running: `LLM.generate(all prompts)` with max_num_seqs = B, the
offline many-prompts case. Methods take turns at each B (A B C, then the next B) so that drift affects them
alike. Per method and B: total tokens/s (all tokens over the wall time), per-request tokens/s (a request's
tokens over its own time in the engine, waiting included), time to first token, time per output token after
the first, acceptance, and whether every output equals the method's own batch-1 output and `none`'s (greedy).
transformers' `generate` runs the same prompts padded into batches of B (left padding, greedy) as a reference.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch

from quickdraft.params import SamplingParams
from quickdraft.sequence import RequestMetrics


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _quickdraft_round(llm, prompts: list[list[int]], batch: int, max_new_tokens: int, temperature: float,
                      seed: int) -> dict[str, Any]:
    llm.max_num_seqs = batch
    llm.kv_memory.clear_prefix_caches()  # each round computes its prompts: no blocks kept from the last round
    params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed + i)
              for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    metrics = [o.metrics for o in outputs]
    tokens = sum(m.num_generated_tokens for m in metrics)
    pooled = RequestMetrics.combine(metrics)
    tpot = [(m.wall_time_s - m.first_token_time_s) / (m.num_generated_tokens - 1) for m in metrics
            if m.num_generated_tokens > 1 and m.first_token_time_s is not None]
    return {
        "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
        "per_request_tokens_per_s": _median([m.tokens_per_s for m in metrics if m.tokens_per_s]),
        "ttft_s": _median([m.first_token_time_s for m in metrics if m.first_token_time_s is not None]),
        "tpot_s": _median(tpot),
        "acceptance_rate": pooled.acceptance_rate, "mean_acceptance_length": pooled.mean_acceptance_length,
        "tokens_per_target_forward": pooled.tokens_per_target_forward,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def _hf_round(model, pad_id: int, eos: set[int], prompts: list[list[int]], batch: int, max_new_tokens: int,
              temperature: float, seed: int) -> dict[str, Any]:
    """transformers' generate on the prompts in padded batches of `batch` (left padding), greedy or sampled."""
    from transformers import GenerationConfig

    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
        else dict(do_sample=False)
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, num_beams=1, repetition_penalty=1.0,
                              eos_token_id=sorted(eos) or None, pad_token_id=pad_id, **sampling)
    device = next(model.parameters()).device
    tokens, token_ids = 0, []
    torch.manual_seed(seed)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        chunk = prompts[first: first + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        for row in out[:, width:].tolist():
            ended = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            token_ids.append(row[:ended])
            tokens += ended
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "per_request_tokens_per_s": None, "ttft_s": None, "tpot_s": None, "acceptance_rate": None,
            "mean_acceptance_length": None, "tokens_per_target_forward": None, "token_ids": token_ids}


def run_batch_sweep(llms: dict[str, Any], prompts: list[list[int]], batch_sizes: list[int], max_new_tokens: int,
                    temperature: float, seed: int, hf_model=None, pad_id: int = 0, eos: set[int] | None = None,
                    on_round=None) -> dict[str, Any]:
    """{label: {B: figures}} for each quickdraft LLM (a dict label -> LLM sharing one target; 'none' among
    them) and, when hf_model is given, transformers' padded generate ('hf'). Figures as the module doc says;
    speedup_vs_none per B, and greedy exactness against the method's own B=1 output and none's."""
    results: dict[str, dict[int, dict[str, Any]]] = {label: {} for label in llms}
    if hf_model is not None:
        results["hf"] = {}
    for batch in batch_sizes:
        for label, llm in llms.items():
            results[label][batch] = _quickdraft_round(llm, prompts, batch, max_new_tokens, temperature, seed)
            if on_round:
                on_round(label, batch)
        if hf_model is not None:
            results["hf"][batch] = _hf_round(hf_model, pad_id, eos or set(), prompts, batch, max_new_tokens,
                                             temperature, seed)
            if on_round:
                on_round("hf", batch)
    smallest = min(batch_sizes)
    for label, rows in results.items():
        for batch, row in rows.items():
            none = results.get("none", {}).get(batch)
            row["speedup_vs_none"] = row["tokens_per_s"] / none["tokens_per_s"] if none else None
            hf = results.get("hf", {}).get(batch)
            row["speedup_vs_hf"] = row["tokens_per_s"] / hf["tokens_per_s"] if hf else None
            if temperature == 0 and label != "hf":
                own = rows[smallest]["token_ids"]
                row["differs_from_smallest_batch"] = sum(a != b for a, b in zip(row["token_ids"], own))
                if none is not None:
                    row["differs_from_none"] = sum(a != b for a, b in zip(row["token_ids"], none["token_ids"]))
    for rows in results.values():
        for row in rows.values():
            row.pop("token_ids")
    return {"batch_sizes": batch_sizes, "n_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "note": "generate(all prompts) with max_num_seqs = B (continuous batching); hf: padded batches of B",
            "methods": {label: {str(b): row for b, row in rows.items()} for label, rows in results.items()}}


def render_batch_sweep(sweep: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(title=f"batch sweep: {sweep['n_prompts']} prompts, {sweep['max_new_tokens']} new tokens, "
                        f"temperature {sweep['temperature']}")
    for column in ["method", "B", "tok/s", "× none", "× hf", "per-request tok/s", "TTFT s", "TPOT ms", "accept",
                   "tok/fwd", "≠ B=1", "≠ none"]:
        table.add_column(column, justify="left" if column == "method" else "right")

    def fmt(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    for label, rows in sweep["methods"].items():
        for batch, r in rows.items():
            table.add_row(label, batch, fmt(r["tokens_per_s"], ".1f"), fmt(r["speedup_vs_none"]),
                          fmt(r["speedup_vs_hf"]), fmt(r["per_request_tokens_per_s"], ".1f"), fmt(r["ttft_s"]),
                          fmt(None if r["tpot_s"] is None else 1e3 * r["tpot_s"], ".1f"),
                          fmt(r["acceptance_rate"], ".1%"), fmt(r["tokens_per_target_forward"]),
                          fmt(r.get("differs_from_smallest_batch"), "d"), fmt(r.get("differs_from_none"), "d"))
    console.print(table)


def plot_batch_sweep(sweep: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for label, rows in sweep["methods"].items():
        if label == "none":
            continue
        sizes = [int(b) for b in rows]
        ax.plot(sizes, [rows[str(b)]["speedup_vs_none"] or float("nan") for b in sizes], marker="o", label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences running together)")
    ax.set_ylabel("total tokens/s vs none")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

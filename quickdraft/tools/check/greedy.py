"""The greedy check: speculative and plain decoding compared token by token, and a divergence judged against
the near-tie rule (rounding alone can flip a choice between logits that close)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from quickdraft.tools.check.law import _process
from quickdraft.tools.check.report import Divergence, GreedyResult

if TYPE_CHECKING:
    import torch

    from quickdraft.api import LLM
    from quickdraft.params import SamplingParams

# A greedy divergence is a near-tie when both tokens' logits lie within NEAR_TIE_ULPS x eps(dtype) x
# max(1, |largest logit|) of the largest: a few units in the last place of the logit for 16-bit runners,
# where the logits themselves are rounded to 8 or 11 bits; for float32, rounding accumulated over the layers
# (rows computed by different matmul shapes), about 1.5e-4 at a logit of 20.
NEAR_TIE_ULPS = {"bfloat16": 4, "float16": 4, "float32": 64, "float64": 64}


def _near_tie_rule(dtype_name: str) -> str:
    ulps = NEAR_TIE_ULPS.get(dtype_name, 4)
    return (f"both tokens' penalised logits within {ulps} x eps({dtype_name}) x max(1, |largest logit|) of the "
            f"largest, on the common prefix")


def near_tie_tolerance(dtype_name: str, largest_logit: float) -> float:
    """The logit gap below which rounding alone can flip greedy decoding's choice (see NEAR_TIE_ULPS)."""
    import torch

    eps = torch.finfo(getattr(torch, dtype_name, torch.float32)).eps
    return NEAR_TIE_ULPS.get(dtype_name, 4) * eps * max(1.0, abs(largest_logit))


def _greedy(spec_llm: "LLM", plain_llm: "LLM", ids: list[list[int]], params: "SamplingParams", max_tokens: int,
            dtype_name: str) -> list[GreedyResult]:
    greedy_params = dataclasses.replace(params, temperature=0.0, n=1, seed=None, max_tokens=max_tokens)
    prompts = [{"prompt_token_ids": p} for p in ids]
    spec_out = spec_llm.generate(prompts, greedy_params)
    plain_out = plain_llm.generate(prompts, greedy_params)
    results = []
    for index, (prompt, s, p) in enumerate(zip(ids, spec_out, plain_out)):
        a, b = s.outputs[0].token_ids, p.outputs[0].token_ids
        result = GreedyResult(index, len(a), len(b))
        if a != b:
            position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            result.divergence = _divergence(spec_llm, prompt, b[:position], a, b, position, greedy_params, dtype_name)
        results.append(result)
    return results


def _divergence(llm: "LLM", prompt: list[int], common: list[int], spec: list[int], plain: list[int], position: int,
                params: "SamplingParams", dtype_name: str) -> Divergence:
    """The target's penalised logits after prompt + common, and whether the two runs' tokens there tie."""
    a = spec[position] if position < len(spec) else None
    b = plain[position] if position < len(plain) else None
    logits = _processed_row(llm.target, prompt, common, params)  # [V]: penalised logits (greedy)
    largest = float(logits.max())
    tolerance = near_tie_tolerance(dtype_name, largest)
    if a is None or b is None:  # one run ended where the other went on: not a question of rounding
        return Divergence(position, a, b, None, tolerance, False)
    gap = largest - min(float(logits[a]), float(logits[b]))
    return Divergence(position, a, b, gap, tolerance, gap <= tolerance)


def _processed_row(runner, prompt: list[int], output: list[int], params: "SamplingParams") -> "torch.Tensor":
    """sampling.process of the target's next-token logits after prompt + output, with output as the penalty
    history: penalised logits for greedy params, probabilities otherwise. One forward of the whole prefix."""
    import torch

    cache = runner.new_cache()
    tokens = torch.tensor(prompt + output, dtype=torch.long, device=runner.device)
    logits = runner.forward(cache, tokens, 1)  # [1, V]
    return _process(runner, logits, prompt, output, params)[0]

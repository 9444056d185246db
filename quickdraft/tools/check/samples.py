"""Samples for the sampled check: drawn through the engine by rejection sampling from one seeded generator, or
with a request seed through LLM.generate."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quickdraft.api import LLM
    from quickdraft.params import SamplingParams


def _sample_rejection(llm: "LLM", ids: list[list[int]], per_prompt: list[int], params: "SamplingParams",
                      generator_seed: int, chunk: int = 8):
    """per_prompt[i] completions of prompt i verified by rejection sampling, through a continuous-batching
    scheduler on llm's engine and KV memory (batches mix prompts, prefills and drafting steps as generate's do),
    every sequence drawing from ONE generator seeded with generator_seed: the public API draws a random
    generator seed for requests without one, which would make the check irreproducible. Requests of `chunk`
    completions each, prompts in turn. Returns (samples per prompt, the sequences' metrics)."""
    import torch

    from quickdraft.scheduler import Scheduler, SequenceSetup

    engine = llm.engine
    generator = torch.Generator(device=engine.device).manual_seed(generator_seed)
    scheduler = Scheduler(engine, llm.tokenizer, llm.max_num_seqs, llm.max_num_batched_tokens,
                          lambda request_params: [SequenceSetup(generator)] * request_params.n, memory=llm.kv_memory)
    remaining = list(per_prompt)
    requests: list[tuple[int, Any]] = []
    while any(remaining):
        for index, prompt in enumerate(ids):
            size = min(chunk, remaining[index])
            if size:
                remaining[index] -= size
                requests.append((index, scheduler.add_request(str(len(requests)), prompt,
                                                              dataclasses.replace(params, n=size))))
    while scheduler.has_unfinished():
        scheduler.step()
    samples: list[list[tuple[int, ...]]] = [[] for _ in ids]
    metrics = []
    for index, request in requests:
        for seq in request.sequences:
            samples[index].append(tuple(seq.output_ids))
            metrics.append(seq.metrics)
    return samples, metrics


def _sample_seeded(llm: "LLM", ids: list[list[int]], per_prompt: list[int], params: "SamplingParams"):
    """per_prompt[i] completions of prompt i with the request seed (position-keyed noise), through LLM.generate
    with n completions per prompt."""
    prompts = [{"prompt_token_ids": p} for p in ids]
    outs = llm.generate(prompts, [dataclasses.replace(params, n=n) for n in per_prompt])
    return [[tuple(c.token_ids) for c in out.outputs] for out in outs], [out.metrics for out in outs]

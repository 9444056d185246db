"""What a speculative step costs on a GPU, part by part, for models of real size with random weights (the
packaged GGUF files are too large to travel to a lent GPU, and a forward's time does not depend on its weights'
values; acceptance does, so none is measured here: tokens a step come from the real pair's CPU runs, RESULTS.md).

1. A forward by its number of new rows (1: a decoding step; K + 1: a chain's verification; a tree's nodes + 1),
   after `--context` cached positions, target and draft, medians over rounds (a device sync before every timing).
   On a GPU also the same forwards captured once as CUDA graphs and replayed: the kernels' own time, what the
   eager loop's launches hide.
2. The engine's steps end to end, greedy, 128 tokens after a 256-token prompt: plain decoding, a chain of K drafts
   from the draft model, a token tree of N nodes; the wall time of a step and how it splits between the draft's
   forwards and the target's (part 1's figures) and the rest (the host: Python, sampling, verification, cache
   bookkeeping). Random drafts are rejected, so a step here emits one token: its cost is what the figures are for.

    python benchmarks/cuda_costs.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--rows 1,2,4,5,8,9,13,16,32,64] [--rounds 20] [--device cuda] [--dtype bfloat16]

Runs on the CPU too (`--device cpu`), slowly. `benchmarks/gpu_check.sh` runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

# The shapes of the models the project measures on the CPU (their GGUF files' metadata), for random weights.
SHAPES = {
    "qwen2.5-coder-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                               rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                               rope_theta=1000000.0, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, tie_word_embeddings=True),
}


def build(name: str, device: torch.device, dtype: torch.dtype, max_len: int, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[name])
    config = AutoConfig.for_model(shape.pop("model_type"), max_position_embeddings=max_len, eos_token_id=None,
                                  bos_token_id=None, pad_token_id=None, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def runner_after_context(model, context: int, device: torch.device):
    """A native runner of `model`, a cache holding `context` random tokens, and the generator that drew them (for
    the rows to come)."""
    from quickdraft.models.native import NativeRunner

    runner = NativeRunner(model)
    cache = runner.new_cache()
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        runner.forward(cache, torch.randint(0, runner.vocab_size, (context,), generator=generator).to(device), 1)
    return runner, cache, generator


def forward_by_rows(model, rows: list[int], context: int, rounds: int, device: torch.device) -> dict[int, float]:
    """Median ms of one forward of n new rows after `context` cached positions, rows interleaved round by round."""
    runner, cache, generator = runner_after_context(model, context, device)
    vocab = runner.vocab_size
    with torch.inference_mode():
        times: dict[int, list[float]] = {n: [] for n in rows}
        for round_index in range(rounds + 2):  # two warm-up rounds
            for n in rows:
                ids = torch.randint(0, vocab, (n,), generator=generator).to(device)
                sync(device)
                start = time.perf_counter()
                runner.forward(cache, ids, n)
                sync(device)
                if round_index >= 2:
                    times[n].append((time.perf_counter() - start) * 1e3)
                cache.rollback(context)
    return {n: statistics.median(t) for n, t in times.items()}


def graph_replay_by_rows(model, rows: list[int], context: int, rounds: int, device: torch.device) -> dict:
    """Median ms of the same forwards captured once as a CUDA graph and replayed: the GPU's own time for the layer
    loop's kernels with no launches from Python, i.e. what capturing the engine's forwards would leave. Each row
    count's graph rewrites the same positions (context..context + n) at every replay, which is all a timing needs.
    {n: ms}, or {n: "the error"} where capture failed."""
    runner, cache, generator = runner_after_context(model, context, device)
    vocab = runner.vocab_size
    results: dict = {}
    with torch.inference_mode():
        cache.reserve(context + max(rows))  # no growth (a new tensor) inside a capture
        for n in rows:
            ids = torch.randint(0, vocab, (n,), generator=generator).to(device)
            try:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # warm-up off the default stream, as torch's docs ask
                    for _ in range(2):
                        runner.forward(cache, ids, n)
                        cache.rollback(context)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    runner.forward(cache, ids, n)
                cache.rollback(context)
                times = []
                for round_index in range(rounds + 2):
                    sync(device)
                    start = time.perf_counter()
                    graph.replay()
                    sync(device)
                    if round_index >= 2:
                        times.append((time.perf_counter() - start) * 1e3)
                results[n] = statistics.median(times)
                del graph
            except Exception as exc:  # a capture that fails is a finding, not the end of the run
                results[n] = f"{type(exc).__name__}: {str(exc)[:200]}"
                cache.rollback(context)
    return results


def engine_steps(target, draft, configs: dict[str, dict], device: torch.device, tokens: int, repeats: int):
    from quickdraft import LLM, SamplingParams

    prompt = torch.randint(0, target.config.vocab_size, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    results = {}
    llms = {}
    for name, config in configs.items():
        config = dict(config)
        graphs = config.pop("cuda_graphs", False)
        if config.get("method") == "draft_model":
            config["model"] = draft
        llm = llms[name] = LLM(target, device=device, speculative_config=config)
        if graphs:  # every one-sequence forward of the target and the draft captured once and replayed
            llm.target.use_cuda_graphs(True)
            if config.get("method") == "draft_model":
                llm.proposer.runner.use_cuda_graphs(True)
    runs: dict[str, list] = {name: [] for name in configs}
    for _ in range(repeats + 1):  # the first pass warms every configuration up
        for name, llm in llms.items():
            sync(device)
            start = time.perf_counter()
            out = llm.generate({"prompt_token_ids": prompt}, params)[0]
            sync(device)
            runs[name].append((time.perf_counter() - start, out.metrics))
    for name, measured in runs.items():
        best = sorted(measured[1:], key=lambda r: r[0])[len(measured[1:]) // 2]  # the median run
        wall, m = best
        steps = m.target_forwards - 1  # the prefill's forward is not a step
        results[name] = {
            "tok_s": m.num_generated_tokens / wall,
            "steps": steps,
            "tokens_per_step": (m.num_generated_tokens - 1) / steps,
            "ms_per_step": 1e3 * (wall - (m.first_token_time_s or 0.0)) / steps,
            "acceptance": m.acceptance_rate,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,4,5,8,9,13,16,32,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        print("device:", torch.cuda.get_device_name(device), "| torch", torch.__version__, "| cuda", torch.version.cuda)
    rows = [int(r) for r in args.rows.split(",")]
    report: dict = {"device": str(device), "dtype": args.dtype, "context": args.context}
    models = {}
    for seed, name in enumerate((args.target, args.draft)):
        models[name] = model = build(name, device, dtype, max_len=4096, seed=seed)
        by_rows = forward_by_rows(model, rows, args.context, args.rounds, device)
        report[f"forward_ms {name}"] = by_rows
        one = by_rows[rows[0]]
        print(f"\n{name} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {args.dtype}), "
              f"forward after {args.context} cached, ms (x {rows[0]} row):")
        print("  " + "  ".join(f"{n}: {t:.2f} ({t / one:.2f}x)" for n, t in by_rows.items()))
        if device.type == "cuda":
            replayed = graph_replay_by_rows(model, [1, 5, 13, 64], args.context, args.rounds, device)
            report[f"graph_replay_ms {name}"] = replayed
            print("  the same forwards captured as CUDA graphs and replayed, ms: " + "  ".join(
                f"{n}: {t:.3f}" if isinstance(t, float) else f"{n}: {t}" for n, t in replayed.items()))
    configs = {
        "none": {"method": "none"},
        "chain K=4": {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
        "tree 8 nodes, depth 4": {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False,
                                  "tree": {"max_nodes": 8, "max_depth": 4}},
        "tree 12 nodes, depth 4": {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False,
                                   "tree": {"max_nodes": 12, "max_depth": 4}},
    }
    if device.type == "cuda":
        configs["none, CUDA graphs"] = {"method": "none", "cuda_graphs": True}
        configs["chain K=4, CUDA graphs"] = {**configs["chain K=4"], "cuda_graphs": True}
    steps = engine_steps(models[args.target], models[args.draft], configs, device, args.tokens, args.repeats)
    report["engine"] = steps
    # The engine's own timers see a GPU's work where the host first waits for it (verification reads the tokens),
    # so the forwards' share of a step is taken from part 1: K one-row draft forwards and one target forward of
    # the step's rows (the chain's K + 1; a full tree's nodes + 1; a draft model's tree levels are batched
    # forwards of a few rows, counted here as one row each).
    target_ms, draft_ms = report[f"forward_ms {args.target}"], report[f"forward_ms {args.draft}"]

    def forwards_ms(config: dict) -> float | None:
        if config.get("cuda_graphs"):
            return None  # part 1 times eager forwards
        if config["method"] == "none":
            return target_ms.get(1)
        k = config["num_speculative_tokens"]
        verify_rows = config["tree"]["max_nodes"] + 1 if "tree" in config else k + 1
        if verify_rows not in target_ms or 1 not in draft_ms:
            return None
        return k * draft_ms[1] + target_ms[verify_rows]

    print(f"\nengine, greedy, {args.tokens} tokens after 256 (random drafts: rejected, a step emits one token):")
    print(f"  {'configuration':24} {'tokens/step':>11} {'ms/step':>8} {'forwards':>9} {'rest':>7} {'tok/s':>7}")
    for name, r in steps.items():
        forwards = forwards_ms(configs[name])
        r["forwards_ms_from_part_1"] = forwards
        rest = f"{r['ms_per_step'] - forwards:7.2f}" if forwards is not None else f"{'-':>7}"
        shown = f"{forwards:9.2f}" if forwards is not None else f"{'-':>9}"
        print(f"  {name:24} {r['tokens_per_step']:11.2f} {r['ms_per_step']:8.2f} {shown} {rest} {r['tok_s']:7.1f}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Issue 49's targets on a GPU, measured in one run: models of the Qwen2.5-Coder-1.5B/0.5B shapes with random bf16
weights (the packaged GGUF files are too large to travel to a lent GPU, and a forward's time does not depend on its
weights' values; acceptance does, so none is measured here: tokens a step come from the real pair's CPU runs,
RESULTS.md). Everything runs as a user gets it: the factory's runner for the device (on CUDA the CUDA runner, every
forward a CUDA graph), defaults otherwise.

1. Plain decoding at batch 1 (a 256-token prompt, 128 greedy tokens, the prefill subtracted), ms a token, against
   the memory floor (the weights' bytes at the copy bandwidth measured here) and against transformers' own
   static-cache `generate` (it compiles its forward itself) on the same device in the same run.
2. A forward by its number of new rows after 256 cached positions, target and draft: 1 (a decoding step), 5 (a
   K = 4 chain's verification), a 16-node token tree with its root (17 rows, tree attention), and more; medians
   over rounds, a device sync around each. Also the same one-row forward run eagerly (graphs off), for scale.
3. The engine's whole steps, host work included: plain, ngram and suffix lookups, an EAGLE head (random) and the
   0.5B-shape draft model, K = 4 fixed. Random drafts are rejected, so a step here emits about one token: its
   cost is what the figures are for (the lookups' drafted tokens a step are printed: a lookup that finds nothing
   drafts nothing).
Then a table of the issue's targets, measured against their goals.

    python benchmarks/cuda_costs.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b] [--rounds 20]
        [--tokens 128] [--repeats 3] [--device cuda] [--dtype bfloat16] [--no-peer] [--out FILE.json]

Runs on the CPU too (`--device cpu --target tiny --draft tiny`: every part, at a toy size; the targets then mean
nothing). `benchmarks/gpu_check.sh` runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
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
    "tiny": dict(model_type="qwen2", vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True),
}
ROWS = "1,2,4,5,8,9,13,16,17,32,64"
TREE_NODES = 16
# The goals: (what is compared, the goal, whether the measured figure must be at most (True) or at least it).
GOALS = {
    "plain decoding, ms a token": (1.6, True),
    "plain decoding / memory floor": (2.2, True),
    "transformers static-cache generate / plain decoding": (2.8, False),
    "K=4 chain forward (5 rows) / decoding step": (1.1, True),
    f"{TREE_NODES}-node tree forward / decoding step": (1.2, True),
    "ngram step / plain step": (1.3, True),
    "suffix step / plain step": (1.3, True),
    "eagle step / plain step": (1.3, True),
    "0.5B draft-model step, K=4 / plain step": (3.0, True),
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


def copy_bandwidth(device: torch.device, size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes a second the device moves in a copy of size_bytes (read and written: 2 x size_bytes a copy), median of
    `repeats`: the rate a decoding step's weight reads cannot beat."""
    source = torch.ones(size_bytes // 4, device=device)
    target = torch.empty_like(source)
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    del source, target
    return 2 * size_bytes / statistics.median(times)


def forward_costs(model, rows: list[int], context: int, rounds: int, device: torch.device) -> tuple[object, dict]:
    """(the runner, {rows: median ms}) of one forward of n new rows after `context` cached positions (rows
    interleaved round by round, two warm-up rounds: a CUDA runner captures a shape at its second sighting), "tree"
    a TREE_NODES-node tree with its root (TREE_NODES + 1 rows), and "eager 1" the one-row forward with graphs off
    where the runner has them."""
    from quickdraft.models.base import TreeAttention
    from quickdraft.models.factory import native_runner

    runner = native_runner(model)
    generator = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    cache = runner.new_cache()
    cache.reserve(context + max(rows + [TREE_NODES + 1]))  # no growth (a new tensor, new graphs) while timing
    runner.forward(cache, torch.randint(0, vocab, (context,), generator=generator).to(device), 1)
    # A bushy tree: each node's parent the node TREE_NODES // 4 before it, the first four children of the root.
    tree = TreeAttention.of_tree(context + 1, [i - 4 if i >= 4 else -1 for i in range(TREE_NODES)])
    cases = {n: (n, None) for n in rows}
    cases["tree"] = (TREE_NODES + 1, [tree])
    times: dict = {name: [] for name in cases}
    graphed = runner.backend == "cuda" and runner.capture_graphs
    if graphed:
        times["eager 1"] = []
    with torch.inference_mode():
        for round_index in range(rounds + 2):
            for name in times:
                n, trees = cases.get(name, (1, None))
                ids = torch.randint(0, vocab, (n,), generator=generator).to(device)
                if graphed:
                    runner.capture_graphs = name != "eager 1"
                sync(device)
                start = time.perf_counter()
                runner.forward_batch([cache], [ids], [n], trees=trees)
                sync(device)
                if round_index >= 2:
                    times[name].append((time.perf_counter() - start) * 1e3)
                cache.rollback(context)
    return runner, {name: statistics.median(t) for name, t in times.items()}


def engine_steps(target, draft, configs: dict[str, dict], prompt: list[int], device: torch.device, tokens: int,
                 repeats: int) -> dict:
    """Per configuration, the median of `repeats` generations (after one warm-up each): ms a step with the prefill
    subtracted, tokens a step, drafted tokens a step, tok/s."""
    from quickdraft import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llms = {}
    for name, config in configs.items():
        config = dict(config)
        if config.get("method") == "draft_model":
            config["model"] = draft
        llms[name] = LLM(target, device=device, speculative_config=config)
    runs: dict[str, list] = {name: [] for name in configs}
    for _ in range(repeats + 1):  # the first pass warms every configuration up (and its graphs)
        for name, llm in llms.items():
            sync(device)
            start = time.perf_counter()
            out = llm.generate({"prompt_token_ids": prompt}, params)[0]
            sync(device)
            runs[name].append((time.perf_counter() - start, out.metrics))
    results = {}
    for name, measured in runs.items():
        wall, m = sorted(measured[1:], key=lambda r: r[0])[len(measured[1:]) // 2]  # the median run
        steps = max(1, m.target_forwards - 1)  # the prefill's forward is not a step
        results[name] = {"ms_per_step": 1e3 * (wall - (m.first_token_time_s or 0.0)) / steps, "steps": steps,
                         "tokens_per_step": (m.num_generated_tokens - 1) / steps,
                         "drafted_per_step": m.proposed_tokens / steps, "tok_s": m.num_generated_tokens / wall}
    return results


def transformers_static_ms(model, prompt: list[int], tokens: int, repeats: int, device: torch.device) -> float:
    """transformers' greedy `generate` with its static cache (compiled by transformers on a GPU; the first call
    compiles and is not timed): ms a token, the prefill subtracted (a generation of 1 token timed apart)."""
    ids = torch.tensor([prompt], device=device)

    def generate(count: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False,
                           cache_implementation="static", pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    generate(tokens)  # compiles
    whole = statistics.median(generate(tokens) for _ in range(repeats))
    prefill = statistics.median(generate(1) for _ in range(repeats))
    return 1e3 * (whole - prefill) / (tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' static-cache generate")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        print("device:", torch.cuda.get_device_name(device), "| torch", torch.__version__, "| cuda", torch.version.cuda)
    rows = [int(r) for r in args.rows.split(",")]
    report: dict = {"device": str(device), "dtype": args.dtype, "context": args.context, "tokens": args.tokens}
    bandwidth = copy_bandwidth(device)
    report["copy_GB_s"] = bandwidth / 1e9
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s")

    models, forwards = {}, {}
    for seed, name in enumerate(dict.fromkeys((args.target, args.draft))):
        models[name] = model = build(name, device, dtype, max_len=4096, seed=seed)
        runner, forwards[name] = forward_costs(model, rows, args.context, args.rounds, device)
        report[f"forward_ms {name}"] = forwards[name]
        report[f"runner {name}"] = type(runner).__name__
        report[f"weight_bytes {name}"] = runner.weight_bytes
        one = forwards[name][1]
        print(f"\n{name} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {args.dtype}, "
              f"{type(runner).__name__}; {runner.weight_bytes / 1e9:.2f} GB a step, floor "
              f"{1e3 * runner.weight_bytes / bandwidth:.2f} ms), forward after {args.context} cached, ms (x 1 row):")
        print("  " + "  ".join(f"{n}: {t:.3f} ({t / one:.2f}x)" for n, t in forwards[name].items()))
        del runner  # its caches and graphs
    target, draft = models[args.target], models[args.draft]

    # A prompt of a 32-token block repeated: the lookups find continuations in it.
    block = torch.randint(0, SHAPES[args.target]["vocab_size"], (32,), generator=torch.Generator().manual_seed(1))
    prompt = block.repeat(8).tolist()
    with tempfile.TemporaryDirectory() as heads:
        from quickdraft import LLM
        from quickdraft.drafts import eagle

        plain_target = LLM(target, device=device, speculative_config={"method": "none"}).target
        vocab = min(32768, plain_target.vocab_size)
        eagle.new_head(plain_target, torch.arange(vocab), 0).save(heads, {"benchmark": "random head"})
        fixed = {"num_speculative_tokens": 4, "adaptive": False}
        configs = {"plain": {"method": "none"},
                   "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, **fixed},
                   "suffix": {"method": "suffix", **fixed},
                   "eagle": {"method": "eagle", "model": heads, "eagle_lookup": False, **fixed},
                   "draft model": {"method": "draft_model", **fixed}}
        steps = report["engine"] = engine_steps(target, draft, configs, prompt, device, args.tokens, args.repeats)
    print(f"\nengine, greedy, {args.tokens} tokens after {len(prompt)}, K = 4 (random drafts: rejected):")
    print(f"  {'configuration':14} {'ms/step':>8} {'x plain':>8} {'tokens/step':>11} {'drafted/step':>12} {'tok/s':>7}")
    plain = steps["plain"]["ms_per_step"]
    for name, r in steps.items():
        print(f"  {name:14} {r['ms_per_step']:8.3f} {r['ms_per_step'] / plain:8.2f} {r['tokens_per_step']:11.2f} "
              f"{r['drafted_per_step']:12.2f} {r['tok_s']:7.1f}")

    peer = None
    if not args.no_peer:
        peer = report["transformers_static_ms_per_token"] = transformers_static_ms(
            target, prompt, args.tokens, args.repeats, device)
        print(f"\ntransformers generate, static cache: {peer:.3f} ms a token")
    floor = 1e3 * report[f"weight_bytes {args.target}"] / bandwidth
    decoding = forwards[args.target][1]
    measured = {
        "plain decoding, ms a token": plain,
        "plain decoding / memory floor": plain / floor,
        "transformers static-cache generate / plain decoding": None if peer is None else peer / plain,
        "K=4 chain forward (5 rows) / decoding step": forwards[args.target].get(5, float("nan")) / decoding,
        f"{TREE_NODES}-node tree forward / decoding step": forwards[args.target]["tree"] / decoding,
        "ngram step / plain step": steps["ngram"]["ms_per_step"] / plain,
        "suffix step / plain step": steps["suffix"]["ms_per_step"] / plain,
        "eagle step / plain step": steps["eagle"]["ms_per_step"] / plain,
        "0.5B draft-model step, K=4 / plain step": steps["draft model"]["ms_per_step"] / plain,
    }
    report["targets"] = {}
    print(f"\nissue 49's targets ({args.target} shape, {args.dtype}, {device}; floor {floor:.3f} ms):")
    print(f"  {'figure':54} {'measured':>9} {'goal':>8}  met")
    for name, value in measured.items():
        goal, at_most = GOALS[name]
        met = None if value is None else (value <= goal if at_most else value >= goal)
        report["targets"][name] = {"measured": value, "goal": goal, "at_most": at_most, "met": met}
        shown = "-" if value is None else f"{value:.3f}"
        print(f"  {name:54} {shown:>9} {('<= ' if at_most else '>= ') + str(goal):>8}  "
              f"{'-' if met is None else 'yes' if met else 'no'}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1, default=str)


if __name__ == "__main__":
    main()

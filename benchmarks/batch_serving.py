"""Issue 50's targets on a GPU, in one run: batched serving on the CUDA runner's paged KV pool (random weights of
the Qwen2.5-Coder-1.5B shape, bf16; a forward's time does not depend on its weights' values).

1. Plain decoding by batch size (--batches, 256-token prompts, 128 greedy tokens each, `LLM.generate` as a user
   calls it): output tok/s (all output tokens / wall time, prefills included), and with ngram drafts and adaptive
   K on; a table of batch size against tok/s for none and ngram.
2. transformers `generate` (static cache) at batch 16 on the same prompts in the same run: tok/s.
3. Verification at batch: one forward of 16 sequences x 5 rows (a K = 4 chain each) against 16 x 1 row, after
   256 cached positions each; medians over --rounds (two warm-up rounds: a shape is captured at its second
   sighting).
4. Prefix sharing: 16 requests sharing a --system-token system prompt (each its own 16-token question), added
   one at a time while the earlier ones keep decoding; each request's time to first token, and the KV blocks in
   use once all 16 run, with prefix caching off (every request holds its own copy) and on (the system prompt's
   blocks held once). Measured on a second pass with another system prompt: the first captures the steps'
   shapes (a shape seen once runs eagerly).
Then the issue's targets against their goals, and the CUDA runner's graph replays, eager and unbucketed steps.

    python benchmarks/batch_serving.py [--target qwen2.5-coder-1.5b] [--batches 1,2,4,8,16,32,64] [--out F.json]

Runs on the CPU too, on the CUDA runner's paged path run eagerly, at a toy size (the targets then mean nothing;
it checks the script):
    python benchmarks/batch_serving.py --device cpu --dtype float32 --target tiny --prompt 32 --tokens 8 \
        --batches 1,2,4 --system 64 --requests 4 --rounds 2 --kv-cache-memory 64MiB
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from cuda_costs import SHAPES, build, sync

GOALS = {  # (goal, whether the measured figure must be at most it (True) or at least it)
    "plain tok/s, 16 sequences": (8000, False),
    "plain tok/s at 16 / transformers generate at 16": (15, False),
    "plain tok/s, 64 sequences": (20000, False),
    "16 x 5 rows forward / 16 x 1 row": (1.3, True),
    "ngram tok/s / plain tok/s, lowest over batch sizes": (1.0, False),
    "TTFT of requests 2-16 / the first's, highest": (0.2, True),
    "KV blocks in use with sharing / without": (None, True),
}


def parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    for suffix, factor in units.items():
        if text.lower().endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def decode_throughput(llm, prompts: list[list[int]], tokens: int) -> dict:
    """tok/s of greedy generation of `tokens` tokens for every prompt at once (after a warm-up run of the same
    batch: its shapes are then captured)."""
    from quickdraft import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.max_num_seqs = len(prompts)
    llm.generate(batch, params)
    sync(llm.device)
    start = time.perf_counter()
    out = llm.generate(batch, params)
    sync(llm.device)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in out)
    proposed = sum(o.metrics.proposed_tokens for o in out)
    accepted = sum(o.metrics.accepted_tokens for o in out)
    return {"tok_s": generated / wall, "wall_s": wall, "tokens": generated, "proposed": proposed,
            "accepted": accepted}


def transformers_throughput(model, prompts: list[list[int]], tokens: int, device) -> float:
    """tok/s of transformers' greedy `generate` with its static cache over the batch (the first call compiles)."""
    ids = torch.tensor(prompts, device=device)

    def run() -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, cache_implementation="static", pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    run()
    return len(prompts) * tokens / min(run(), run())


def rows_forward(runner, batch: int, context: int, rounds: int) -> dict[int, float]:
    """{rows: median ms} of one forward of `batch` sequences x rows new rows after `context` cached each."""
    generator = torch.Generator().manual_seed(0)
    vocab, device = runner.vocab_size, runner.device
    caches = [runner.new_cache() for _ in range(batch)]
    runner.forward_batch(caches, [torch.randint(0, vocab, (context,), generator=generator) for _ in caches],
                         [1] * batch)
    times: dict[int, list[float]] = {1: [], 5: []}
    with torch.inference_mode():
        for round_index in range(rounds + 2):
            for rows in times:
                ids = [torch.randint(0, vocab, (rows,), generator=generator).to(device) for _ in caches]
                sync(device)
                start = time.perf_counter()
                runner.forward_batch(caches, ids, [rows] * batch)
                sync(device)
                if round_index >= 2:
                    times[rows].append((time.perf_counter() - start) * 1e3)
                for cache in caches:
                    cache.rollback(context)
    for cache in caches:
        cache.release()
    return {rows: statistics.median(t) for rows, t in times.items()}


def prefix_sharing(llm, system: list[int], requests: int, tokens: int, rng: random.Random) -> dict:
    """Requests sharing `system`, added one at a time while the earlier ones decode: each one's time to first
    token, and the KV blocks in use once all run."""
    from quickdraft import SamplingParams

    scheduler = llm.new_scheduler(max_num_seqs=requests)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    vocab = llm.target.vocab_size
    ttft = []
    for i in range(requests):
        question = [rng.randrange(vocab) for _ in range(16)]
        sync(llm.device)
        start = time.perf_counter()
        scheduler.add_request(str(i), system + question, params)
        while not any(update.request_id == str(i) for update in scheduler.step()):
            pass
        sync(llm.device)
        ttft.append(time.perf_counter() - start)
    usage = scheduler.kv_usage or {}
    while scheduler.has_unfinished():
        scheduler.step()
    return {"ttft_s": ttft, "used_blocks": usage.get("request_blocks", usage.get("used_blocks")),
            "block_size": usage.get("block_size"), "running": requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens a request")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--peer-batch", type=int, default=16, help="transformers generate's batch (0: skip)")
    parser.add_argument("--rows-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--system", type=int, default=1000, help="shared system prompt tokens")
    parser.add_argument("--requests", type=int, default=16, help="requests sharing it")
    parser.add_argument("--kv-cache-memory", default="8GiB", help="each LLM's KV pool")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    from quickdraft import LLM

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type != "cuda":  # the CUDA runner's paged path, eagerly (the factory picks it only on CUDA)
        from quickdraft.models import factory
        from quickdraft.models.cuda_runner import CudaRunner

        factory.backend_for = lambda weights: CudaRunner
    if device.type == "cuda":
        print("device:", torch.cuda.get_device_name(device), "| torch", torch.__version__, "| cuda", torch.version.cuda)
    batches = [int(b) for b in args.batches.split(",")]
    budget = parse_bytes(args.kv_cache_memory)
    model = build(args.target, device, dtype, max_len=max(4096, args.system + args.tokens + 64), seed=0)
    vocab = SHAPES[args.target]["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(max(batches + [args.peer_batch]))]
    report: dict = {"target": args.target, "device": str(device), "dtype": args.dtype, "prompt": args.prompt,
                    "tokens": args.tokens}

    plain = LLM(model, device=device, dtype=dtype, kv_cache_memory=budget, speculative_config={"method": "none"})
    ngram = plain.with_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    runner = plain.target
    print(f"{args.target} on {type(runner).__name__}, KV pool {runner.kv_pool.total_blocks} blocks of "
          f"{runner.kv_pool.block_size}")
    table = report["throughput"] = {}
    print(f"\ngreedy, {args.prompt}-token prompts, {args.tokens} tokens each: output tok/s by batch size")
    print(f"  {'batch':>5} {'none':>10} {'ngram':>10} {'ngram/none':>10} {'accepted/drafted':>17}")
    for batch in batches:
        row = table[batch] = {"none": decode_throughput(plain, prompts[:batch], args.tokens),
                              "ngram": decode_throughput(ngram, prompts[:batch], args.tokens)}
        n = row["ngram"]
        print(f"  {batch:5d} {row['none']['tok_s']:10.1f} {n['tok_s']:10.1f} {n['tok_s'] / row['none']['tok_s']:10.2f} "
              f"{n['accepted']:8d}/{n['proposed']:<8d}")
    peer = None
    if args.peer_batch:
        peer = report["transformers_tok_s"] = transformers_throughput(model, prompts[:args.peer_batch], args.tokens,
                                                                      device)
        print(f"\ntransformers generate (static cache), batch {args.peer_batch}: {peer:.1f} tok/s")
    forward = report["rows_forward_ms"] = rows_forward(runner, args.rows_batch, args.prompt, args.rounds)
    print(f"\none forward of {args.rows_batch} sequences after {args.prompt} cached: x 1 row {forward[1]:.3f} ms, "
          f"x 5 rows {forward[5]:.3f} ms ({forward[5] / forward[1]:.2f}x)")
    try:  # the same with FlexAttention over the pool in place (compiled on CUDA), for comparison
        runner.attention = "flex"
        flex = report["rows_forward_ms_flex"] = rows_forward(runner, args.rows_batch, args.prompt, args.rounds)
        print(f"  FlexAttention instead: x 1 row {flex[1]:.3f} ms, x 5 rows {flex[5]:.3f} ms")
    except Exception as error:  # noqa: BLE001 - a measurement that fails is reported, the run goes on
        report["rows_forward_flex_error"] = repr(error)[:300]
        print(f"  FlexAttention failed: {repr(error)[:300]}")
    finally:
        runner.attention = "sdpa"

    sharing = report["prefix_sharing"] = {}
    for enabled in (False, True):
        llm = LLM(model, device=device, dtype=dtype, kv_cache_memory=budget, enable_prefix_caching=enabled,
                  speculative_config={"method": "none"})
        for _ in range(2):  # the first pass (another system prompt) captures the steps' shapes; the second counts
            system = [rng.randrange(vocab) for _ in range(args.system)]
            sharing["on" if enabled else "off"] = prefix_sharing(llm, system, args.requests, args.tokens, rng)
        del llm
    off, on = sharing["off"], sharing["on"]
    print(f"\n{args.requests} requests sharing a {args.system}-token system prompt: KV blocks in use with all running "
          f"{off['used_blocks']} without sharing, {on['used_blocks']} with; time to first token (ms) "
          f"first {1e3 * on['ttft_s'][0]:.1f}, later ones {', '.join(f'{1e3 * t:.1f}' for t in on['ttft_s'][1:])}")
    report["runner"] = runner.kv_pool_metrics()
    print("paged runner:", ", ".join(f"{key} {value}" for key, value in report["runner"].items()))

    def tok_s(batch, method="none"):
        return table[batch][method]["tok_s"] if batch in table else None

    measured = {
        "plain tok/s, 16 sequences": tok_s(16),
        "plain tok/s at 16 / transformers generate at 16": None if peer is None or 16 not in table else
        tok_s(16) / peer,
        "plain tok/s, 64 sequences": tok_s(64),
        "16 x 5 rows forward / 16 x 1 row": forward[5] / forward[1],
        "ngram tok/s / plain tok/s, lowest over batch sizes": min(tok_s(b, "ngram") / tok_s(b) for b in table),
        "TTFT of requests 2-16 / the first's, highest": max(on["ttft_s"][1:]) / on["ttft_s"][0]
        if len(on["ttft_s"]) > 1 else None,
        "KV blocks in use with sharing / without": on["used_blocks"] / off["used_blocks"] if off["used_blocks"] else None,
    }
    report["targets"] = {}
    print(f"\nissue 50's targets ({args.target} shape, {args.dtype}, {device}):")
    print(f"  {'figure':52} {'measured':>10} {'goal':>9}  met")
    for name, value in measured.items():
        goal, at_most = GOALS[name]
        met = None if value is None or goal is None else (value <= goal if at_most else value >= goal)
        report["targets"][name] = {"measured": value, "goal": goal, "at_most": at_most, "met": met}
        shown = "-" if value is None else f"{value:.3f}"
        wanted = "-" if goal is None else ("<= " if at_most else ">= ") + str(goal)
        print(f"  {name:52} {shown:>10} {wanted:>9}  {'-' if met is None else 'yes' if met else 'no'}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1, default=str)


if __name__ == "__main__":
    main()

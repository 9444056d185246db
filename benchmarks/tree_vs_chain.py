"""Token trees against chains of the same depth, interleaved, greedy and sampled (issue 25's benchmark).

    .venv/bin/python benchmarks/tree_vs_chain.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--depth 4] [--tree 16,4|auto] [--code-prompts 4] [--spec-bench 4] [--max-new-tokens 128]
        [--temperatures 0,0.8] [--seeds 1] [--threads 2] [--adaptive-chain]

--draft: a draft model (alias, path), or a method name (eagle, ngram, suffix) for a method without a model.
Prompts are held out from the other benchmarks: the last HumanEval-style stubs of vs_llamacpp_pair.py and
Spec-Bench dev records from the 10th of each category on. For each prompt and temperature the chain (K = depth,
fixed) and the tree run one after the other, in an order that alternates from prompt to prompt; T = 0 is
greedy (the texts must be equal), T > 0 is unseeded sampling (rejection sampling: the chain's draft draws from
q; a tree row's first child is that draw and its siblings q's next most probable tokens, verified by recursive
rejection sampling), each prompt --seeds times (sampled texts, and with them acceptance, differ from run to run by
more than a tree's gain). Reported: median decode tok/s (after the first token), tokens per target forward, the
tree's mean verified nodes, and the tree/chain ratios per run (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vs_llamacpp_pair import CODE_STUBS, DATASET

MODEL_LESS = {"eagle", "ngram", "suffix", "model_lookup"}


def held_out_prompts(code: int, spec_bench: int, skip: int = 10) -> tuple[list[str], list[str]]:
    texts = [f"Complete this Python function. Reply with the whole function in one code block.\n\n```python\n{stub}```"
             for stub in CODE_STUBS[len(CODE_STUBS) - code:]]
    kinds = ["code"] * len(texts)
    records = [json.loads(line) for line in DATASET.read_text().splitlines() if line.strip()]
    by_category: dict[str, list] = {}
    for record in records:
        by_category.setdefault(record["category"], []).append(record)
    picked = []
    for depth in range(skip, 40):
        for items in by_category.values():
            if len(picked) < spec_bench and depth < len(items):
                picked.append(items[depth]["turns"][0])
    return texts + picked, kinds + ["spec-bench"] * len(picked)


def chat_prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as one user turn in the model's chat template, as token ids."""
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)["input_ids"]
            for t in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tree", default="16,4", help="MAX_NODES,MAX_DEPTH or auto (bounded by 32 nodes, --depth)")
    parser.add_argument("--code-prompts", type=int, default=4)
    parser.add_argument("--spec-bench", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="0,0.8")
    parser.add_argument("--seeds", type=int, default=1, help="runs of each prompt at T > 0, each pair its own seed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="the target's dtype (default: the loader's)")
    parser.add_argument("--adaptive-chain", action="store_true",
                        help="the chain sizes K by adaptive K (at most --depth) instead of a fixed K: the fair "
                             "baseline for --tree auto, whose depth adaptive K chooses")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from quickdraft import LLM, SamplingParams
    from quickdraft.models.loader import quiet_transformers

    quiet_transformers()
    if args.tree == "auto":
        tree = "auto"
    else:
        nodes, depth = (int(x) for x in args.tree.split(","))
        tree = {"max_nodes": nodes, "max_depth": depth}
    method = {"method": args.draft} if args.draft in MODEL_LESS else {"method": "draft_model", "model": args.draft}
    base = {**method, "num_speculative_tokens": args.depth, "adaptive": False}
    options = {"dtype": args.dtype} if args.dtype else {}
    chain = LLM(args.target, speculative_config={**base, "adaptive": args.adaptive_chain}, **options)
    tree_llm = chain.with_speculative_config({**base, "tree": tree})
    tokenizer = chain.tokenizer
    texts, kinds = held_out_prompts(args.code_prompts, args.spec_bench)
    prompts = chat_prompt_ids(tokenizer, texts)
    n = args.max_new_tokens

    def run(llm, ids, temperature, seed):
        params = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        m = out.metrics
        decode = m.wall_time_s - m.first_token_time_s
        nodes = m.proposed_tokens / m.num_drafts if m.num_drafts else 0.0
        return {"rate": (n - 1) / decode, "per_forward": m.tokens_per_target_forward, "nodes": nodes,
                "tokens": out.outputs[0].token_ids, "wall": time.perf_counter() - start,
                "paths": list(m.accepted_path_lengths)}

    for llm in (chain, tree_llm):  # warm-up: kernels, page cache
        run(llm, prompts[0][:64], 0.0, 0)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    results = {(t, name): [] for t in temperatures for name in ("chain", "tree")}
    for index, (ids, kind) in enumerate(zip(prompts, kinds)):
        for t in temperatures:
            for run_index in range(args.seeds if t > 0 else 1):
                order = [("chain", chain), ("tree", tree_llm)]
                if (index + run_index) % 2:
                    order.reverse()
                for name, llm in order:
                    r = run(llm, ids, t, seed=1000 + 100 * index + run_index)
                    r["kind"] = kind
                    results[(t, name)].append(r)
                    print(f"  prompt {index} ({kind}) T={t} run {run_index} {name}: {r['rate']:.1f} tok/s, "
                          f"{r['per_forward']:.2f} tokens/forward, {r['nodes']:.1f} drafts/step", flush=True)
    print(f"\n{args.target} + {args.draft}: {len(prompts)} held-out prompts ({args.code_prompts} code, "
          f"{len(prompts) - args.code_prompts} Spec-Bench; {args.seeds} run(s) each at T > 0), {n} new tokens, "
          f"{args.threads} threads; chain K={args.depth} "
          f"vs tree {args.tree} ({'chain with adaptive K' if args.adaptive_chain else 'adaptive K off'})")
    print("| T | method | median tok/s | tokens / target forward | drafts / step | tree/chain tok/s | "
          "tree/chain tokens/forward | greedy text = chain |")
    print("|---|---|---|---|---|---|---|---|")
    for t in temperatures:
        c, tr = results[(t, "chain")], results[(t, "tree")]
        rate_ratio = statistics.median([b["rate"] / a["rate"] for a, b in zip(c, tr)])
        fwd_ratio = statistics.median([b["per_forward"] / a["per_forward"] for a, b in zip(c, tr)])
        same = f"{sum(a['tokens'] == b['tokens'] for a, b in zip(c, tr))}/{len(c)}" if t == 0 else "-"
        for name, rows in (("chain", c), ("tree", tr)):
            print(f"| {t} | {name} | {statistics.median(r['rate'] for r in rows):.1f} | "
                  f"{statistics.median(r['per_forward'] for r in rows):.2f} | "
                  f"{statistics.mean(r['nodes'] for r in rows):.1f} | "
                  + (f"{rate_ratio:.2f}x | {fwd_ratio:.2f}x | {same} |" if name == "tree" else "| | |"))


if __name__ == "__main__":
    main()

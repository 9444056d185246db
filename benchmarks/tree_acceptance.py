"""Tokens per target forward of a token tree against the chain inside it, at the same contexts (issue 25).

    .venv/bin/python benchmarks/tree_acceptance.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--tree 12,4 | --tree auto [--depth 4]] [--code-prompts 4] [--spec-bench 8] [--max-new-tokens 96]
        [--temperatures 0,0.8]

tree_vs_chain.py times a tree and a chain on separate generations, so at T > 0 their texts, and with them their
acceptance, differ from run to run by more than a tree's gain. Here every tree step is scored twice on the same
target forward: the tree, and the chain it contains (each row's first child: at T = 0 the draft's argmax, for an
unseeded sampled request the draw from q the chain would make, ChildSelection.DRAWN_FIRST). At T > 0 the
verifier's randomness is integrated out: the expected accepted length is the sum over nodes of the probability
that the walk reaches them (verify_tree.tree_acceptance's per-node acceptance), for the tree and for the chain
(the same first-child acceptances). At T = 0 both are the greedy match lengths. Steps where the tree came out as a
line (a chain) are counted apart and left out. Reported per temperature over the tree steps: tokens per forward
(accepted + 1) of each, their ratio over all steps and the median of per-prompt ratios, and the share of steps
where the tree expects more than its chain.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tree_vs_chain import MODEL_LESS, chat_prompt_ids, held_out_prompts


def expected_accepted(tree, accept_probs: torch.Tensor) -> float:
    """Sum over nodes of P(the walk reaches the node): its parent reached, every earlier sibling rejected, it
    accepted (accept_probs [N], tree_acceptance's)."""
    reach = []
    for i in range(tree.num_nodes):
        parent = int(tree.parents[i])
        before = [s for s in tree.children(parent + 1) if s < i]
        chance = (reach[parent] if parent >= 0 else 1.0) * float(accept_probs[i])
        for s in before:
            chance *= 1.0 - float(accept_probs[s])
        reach.append(chance)
    return sum(reach)


def score_step(seq, tree, rows: torch.Tensor, q: torch.Tensor | None) -> tuple[float, float]:
    """(tree, chain) accepted tokens of one step: rows [N + 1, V] the processed target rows (logits when greedy,
    else probabilities), q [N, V] the draft rows (None when every child is ranked)."""
    from quickdraft.verify_tree import tree_acceptance, tree_greedy_accept

    chain_nodes = tree.first_child_path()
    if seq.params.greedy:
        accepted = tree_greedy_accept(tree, rows).num_accepted.item()
        chain = tree_greedy_accept(tree.subtree(chain_nodes), rows[[0] + [n + 1 for n in chain_nodes]])
        return float(accepted), float(chain.num_accepted.item())
    a = tree_acceptance(tree, rows.double(), None if q is None else q.double()).accept_probs
    chain, reach = 0.0, 1.0
    for node in chain_nodes:  # a first child's acceptance is the chain's: tried first, against p itself
        reach *= float(a[node])
        chain += reach
    return expected_accepted(tree, a), chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tree", default="12,4", help="MAX_NODES,MAX_DEPTH, or auto (the engine sizes each step's "
                        "tree, depth by adaptive K up to --depth: what its branches add to the chain it keeps)")
    parser.add_argument("--depth", type=int, default=4, help="with --tree auto: the deepest tree (K)")
    parser.add_argument("--code-prompts", type=int, default=4)
    parser.add_argument("--spec-bench", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", default="0,0.8")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from quickdraft import LLM, SamplingParams
    from quickdraft import engine
    from quickdraft.models.loader import quiet_transformers

    quiet_transformers()
    method = {"method": args.draft} if args.draft in MODEL_LESS else {"method": "draft_model", "model": args.draft}
    if args.tree == "auto":
        spec = {"num_speculative_tokens": args.depth, "tree": "auto"}  # auto sizes K by adaptive K
    else:
        nodes, depth = (int(x) for x in args.tree.split(","))
        spec = {"num_speculative_tokens": depth, "adaptive": False, "tree": {"max_nodes": nodes, "max_depth": depth}}
    llm = LLM(args.target, speculative_config={**method, **spec})
    texts, _ = held_out_prompts(args.code_prompts, args.spec_bench)
    prompts = chat_prompt_ids(llm.tokenizer, texts)

    scored: list[tuple[float, float]] = []  # this prompt's tree steps: (tree, chain) accepted tokens
    verify_batch = engine.verify_batch

    def scoring(seqs, processed, batch, relaxed_threshold=None):
        for i, seq in enumerate(seqs):
            if batch.trees[i] is not None:
                lo, hi = batch.rows(i)
                tree = batch.trees[i].to(processed.device)
                scored.append(score_step(seq, tree, processed[lo:hi], batch.draft_probs[i]))
        return verify_batch(seqs, processed, batch, relaxed_threshold)

    engine.verify_batch = scoring  # the step's verification, seen before it runs
    temperatures = [float(t) for t in args.temperatures.split(",")]
    print(f"{args.target} + {args.draft}, tree {args.tree}: {len(prompts)} held-out prompts ({args.code_prompts} "
          f"code), {args.max_new_tokens} new tokens")
    print("| T | tree steps (lines) | chain tokens/forward | tree tokens/forward | ratio (all steps) | "
          "median per-prompt ratio | steps the tree gains |")
    print("|---|---|---|---|---|---|---|")
    for t in temperatures:
        params = SamplingParams(temperature=t, max_tokens=args.max_new_tokens, ignore_eos=True)
        tree_total = chain_total = 0.0
        ratios, gains, tree_steps, line_steps = [], 0, 0, 0
        for index, ids in enumerate(prompts):
            scored.clear()
            torch.manual_seed(1000 + index)
            out = llm.generate([{"prompt_token_ids": ids}], params)[0]
            line_steps += out.metrics.num_drafts - len(scored)  # drafted as a line: the tree was its chain
            if not scored:
                continue
            tree_steps += len(scored)
            gains += sum(tree > chain + 1e-9 for tree, chain in scored)
            per_tree = sum(tree + 1 for tree, _ in scored)
            per_chain = sum(chain + 1 for _, chain in scored)
            tree_total, chain_total = tree_total + per_tree, chain_total + per_chain
            ratios.append(per_tree / per_chain)
        steps = max(tree_steps, 1)
        print(f"| {t} | {tree_steps} ({line_steps}) | {chain_total / steps:.2f} | {tree_total / steps:.2f} | "
              f"{tree_total / max(chain_total, 1e-9):.3f}x | {statistics.median(ratios or [0]):.3f}x | "
              f"{gains / steps:.0%} |", flush=True)


if __name__ == "__main__":
    main()

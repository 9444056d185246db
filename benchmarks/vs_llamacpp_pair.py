"""The Qwen2.5-Coder pair (1.5B target, 0.5B draft) against llama.cpp's plain and speculative decoding, on the
same GGUF files with the same threads, interleaved.

    .venv/bin/python benchmarks/vs_llamacpp_pair.py [--code-prompts 5] [--spec-bench 3] [--max-new-tokens 128]
        [--threads 2] [--k 4] [--methods none,draft_model,ngram,model_lookup] [--llamacpp DIR]

Prompts: HumanEval-style function stubs written below (chat template: "complete this function") and the first
Spec-Bench dev records of a few categories. For each prompt in turn, each engine runs once (the order rotates
from prompt to prompt): llama.cpp plain (`llama-bench -p 0 -n N`: decode only, no prompt), llama.cpp
speculative (`llama-speculative-simple --spec-type draft-simple --spec-draft-n-max K`, greedy, its own decode
rate), and quickdraft's methods (greedy, ignore_eos; decode rate after the first token). Medians over prompts
and ratios to llama.cpp plain are printed, with each method's acceptance rate and whether its greedy text
equals plain decoding's; then the same seeded sampled text (T = 0.8, a request seed) for every method.
DIR: llama.cpp's build/bin (default: the one built from the llama-cpp-python sdist, see pyproject's bench
extra). The Qwen aliases need the extra models-large.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

DATASET = Path(__file__).resolve().parents[2] / "shared" / "bench" / "spec_bench_dev.jsonl"
LLAMACPP = Path("/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")

# HumanEval-style stubs (written for this benchmark): a signature and a docstring to complete.
CODE_STUBS = [
    'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same forwards and backwards,\n'
    '    ignoring case and every character that is not a letter or a digit.\n    >>> is_palindrome("A man, a plan")'
    '\n    False\n    """\n',
    'def running_max(values: list[int]) -> list[int]:\n    """Return the list whose i-th element is the largest of\n'
    '    values[0..i].\n    >>> running_max([1, 3, 2, 5, 4])\n    [1, 3, 3, 5, 5]\n    """\n',
    'def count_vowels(word: str) -> int:\n    """Count the vowels a, e, i, o, u in word (either case); y counts\n'
    '    as a vowel only at the end of the word.\n    >>> count_vowels("Hey")\n    2\n    """\n',
    'def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n    """Merge overlapping '
    'closed intervals and return them sorted by start.\n    >>> merge_intervals([(1, 3), (2, 6), (8, 10)])\n'
    '    [(1, 6), (8, 10)]\n    """\n',
    'def digits_sum_sort(numbers: list[int]) -> list[int]:\n    """Sort numbers by the sum of their decimal digits '
    '(ignoring\n    the sign), ties kept in their original order.\n    >>> digits_sum_sort([12, -3, 30, 5])\n'
    '    [12, 30, -3, 5]\n    """\n',
    'def rotate_matrix(matrix: list[list[int]]) -> list[list[int]]:\n    """Return the square matrix rotated 90 '
    'degrees clockwise.\n    >>> rotate_matrix([[1, 2], [3, 4]])\n    [[3, 1], [4, 2]]\n    """\n',
    'def caesar_shift(text: str, shift: int) -> str:\n    """Shift every ASCII letter of text by shift places in '
    'the\n    alphabet (wrapping around, keeping case); other characters stay.\n    >>> caesar_shift("abz", 1)\n'
    '    \'bca\'\n    """\n',
    'def longest_common_prefix(words: list[str]) -> str:\n    """Return the longest prefix shared by every word '
    '("" for none).\n    >>> longest_common_prefix(["flower", "flow", "flight"])\n    \'fl\'\n    """\n',
]


def code_prompts(count: int) -> list[str]:
    return [f"Complete this Python function. Reply with the whole function in one code block.\n\n```python\n{stub}```"
            for stub in CODE_STUBS[:count]]


def spec_bench_prompts(count: int) -> list[str]:
    records = [json.loads(line) for line in DATASET.read_text().splitlines() if line.strip()]
    by_category: dict[str, list] = {}
    for record in records:
        by_category.setdefault(record["category"], []).append(record)
    picked: list[str] = []
    while len(picked) < count and any(by_category.values()):
        for items in by_category.values():
            if items and len(picked) < count:
                picked.append(items.pop(0)["turns"][0])
    return picked


def llama_bench(binary: Path, model: Path, threads: int, n: int) -> float:
    """llama.cpp's plain decode rate (tok/s) of n tokens after no prompt."""
    out = subprocess.run([str(binary / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(n),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def llama_speculative(binary: Path, target: Path, draft: Path, text: str, threads: int, n: int, k: int
                      ) -> tuple[float, float | None]:
    """llama.cpp's speculative decode rate (tok/s, as it reports it) and acceptance on one prompt, greedy."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    out = subprocess.run([str(binary / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
                          "--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "-t", str(threads), "-td",
                          str(threads), "-n", str(n), "--temp", "0", "--ignore-eos", "-c", "4096", "-f", f.name,
                          "-ngl", "0"], capture_output=True, text=True)
    Path(f.name).unlink()
    log = out.stdout + out.stderr
    speed = re.search(r"decoded\s+\d+\s+tokens in\s+[\d.]+\s+seconds, speed:\s+([\d.]+)\s+t/s", log)
    if out.returncode != 0 or speed is None:
        raise RuntimeError(f"llama-speculative-simple failed ({out.returncode}): {log[-2000:]}")
    accept = re.search(r"accept\s*=\s*([\d.]+)%", log)
    return float(speed.group(1)), float(accept.group(1)) / 100 if accept else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--code-prompts", type=int, default=5)
    parser.add_argument("--spec-bench", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--methods", default="none,draft_model,ngram,model_lookup")
    parser.add_argument("--seeded-prompts", type=int, default=2, help="prompts of the seeded T=0.8 check")
    parser.add_argument("--llamacpp", type=Path, default=LLAMACPP)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from quickdraft import LLM, SamplingParams
    from quickdraft.bench.costs import measure_read_bandwidth
    from quickdraft.models.loader import quiet_transformers, resolve

    quiet_transformers()
    target_file, draft_file = resolve(args.target).gguf_path, resolve(args.draft).gguf_path
    start = time.perf_counter()
    plain = LLM(args.target, speculative_config={"method": "none"})
    load_s = time.perf_counter() - start
    configs = {"draft_model": {"method": "draft_model", "model": args.draft},
               "ngram": {"method": "ngram"},
               "model_lookup": {"method": "model_lookup", "model": args.draft},
               "suffix": {"method": "suffix"}}
    methods = args.methods.split(",")
    llms = {m: plain if m == "none" else plain.with_speculative_config({**configs[m], "num_speculative_tokens": args.k})
            for m in methods}
    tokenizer = plain.tokenizer
    texts = code_prompts(args.code_prompts) + spec_bench_prompts(args.spec_bench)
    kinds = ["code"] * args.code_prompts + ["spec-bench"] * args.spec_bench
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    n = args.max_new_tokens
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def run_quickdraft(llm, chat):
        ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
        out = llm.generate([{"prompt_token_ids": ids}], greedy)[0]
        m = out.metrics
        return (n - 1) / (m.wall_time_s - m.first_token_time_s), m.acceptance_rate, out.outputs[0].token_ids

    engines = {"llama.cpp plain": lambda chat: (llama_bench(args.llamacpp, target_file, args.threads, n), None, None),
               f"llama.cpp speculative (K={args.k})": lambda chat: (*llama_speculative(
                   args.llamacpp, target_file, draft_file, chat, args.threads, n, args.k), None)}
    engines.update({f"quickdraft {m}": (lambda chat, llm=llm: run_quickdraft(llm, chat)) for m, llm in llms.items()})
    for run in engines.values():  # warm-up: kernels, page cache, first-call costs
        run(chats[0][:200])
    results = {name: {"rate": [], "accept": [], "tokens": [], "kind": []} for name in engines}
    names = list(engines)
    for index, (chat, kind) in enumerate(zip(chats, kinds)):
        order = names[index % len(names):] + names[:index % len(names)]
        for name in order:
            rate, accept, tokens = engines[name](chat)
            r = results[name]
            r["rate"].append(rate)
            r["accept"].append(accept)
            r["tokens"].append(tokens)
            r["kind"].append(kind)
            print(f"  prompt {index} ({kind}) {name}: {rate:.1f} tok/s" + (f", acceptance {accept:.0%}" if accept
                                                                           is not None else ""), flush=True)
    bandwidth = measure_read_bandwidth(torch.device("cpu"))
    print(f"\n{args.target} + draft {args.draft}: {len(chats)} prompts ({args.code_prompts} code, {args.spec_bench} "
          f"Spec-Bench), chat template, greedy, {n} new tokens, {args.threads} threads, K <= {args.k}; "
          f"quickdraft target load {load_s:.1f} s; memory read {bandwidth / 1e9:.1f} GB/s")
    reference = results["llama.cpp plain"]["rate"]
    plain_tokens = results.get("quickdraft none", {}).get("tokens")
    print("| | code tok/s | Spec-Bench tok/s | all: median tok/s | vs llama.cpp plain | acceptance | greedy = none |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        by_kind = {k: [x for x, kk in zip(r["rate"], r["kind"]) if kk == k] for k in ("code", "spec-bench")}
        ratio = statistics.median([a / b for a, b in zip(r["rate"], reference)])
        accepts = [a for a in r["accept"] if a is not None]
        same = "" if plain_tokens is None or r["tokens"][0] is None else \
            f"{sum(a == b for a, b in zip(r['tokens'], plain_tokens))}/{len(chats)}"
        cells = [f"{statistics.median(v):.1f}" if v else "-" for v in by_kind.values()]
        acceptance = f"{statistics.mean(accepts):.0%}" if accepts else "-"
        print(f"| {name} | {' | '.join(cells)} | {statistics.median(r['rate']):.1f} | {ratio:.2f}x | {acceptance} | "
              f"{same} |")

    # Seeded sampling: the same request seed gives the same text with every method (position-keyed noise).
    seeded = SamplingParams(temperature=0.8, max_tokens=min(n, 64), seed=2026, ignore_eos=True)
    agree = {m: 0 for m in methods}
    for chat in chats[:args.seeded_prompts]:
        ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
        outs = {m: llm.generate([{"prompt_token_ids": ids}], seeded)[0].outputs[0].token_ids for m, llm in llms.items()}
        for m in methods:
            agree[m] += outs[m] == outs[methods[0]]
    print(f"seeded T=0.8 ({seeded.max_tokens} tokens, {args.seeded_prompts} prompts): same text as "
          f"{methods[0]}: " + ", ".join(f"{m} {agree[m]}/{args.seeded_prompts}" for m in methods))


if __name__ == "__main__":
    main()

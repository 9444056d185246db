"""What structured outputs cost a step: the same greedy requests with and without a JSON-schema constraint,
plain and speculative, interleaved round by round; the time spent in the grammar (llguidance's masks and
matcher moves, and applying the masks to logits rows) measured inside the run, as a share of its wall time.

    .venv/bin/python benchmarks/structured_cost.py --model smollm2-135m --rounds 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

from quickdraft import LLM, SamplingParams, sequence, structured

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "colors": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "colors"], "additionalProperties": False}
PROMPTS = ["Describe a cat as JSON with its name, age and colors.",
           "Give a JSON record of a dog: name, age, colors of its coat."]


class GrammarTimer:
    """Wall time inside the grammar's functions (patched for the measured runs only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0  # only the outermost timed call counts (stopped() calls blocked(), say)
        self._patched = []

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start

        self._patched.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    target = LLM(args.model, speculative_config={"method": "none"})
    llms = {"none": target, "ngram": target.with_speculative_config({"method": "ngram", "num_speculative_tokens": 5})}
    prompts = [target.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    modes = {"free": SamplingParams(temperature=0, max_tokens=args.max_tokens),
             "json": SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})}
    for llm in llms.values():  # warm-up: kernels, llguidance's tokenizer, adaptive K's step costs
        llm.generate(prompts, modes["json"])
        llm.generate(prompts, modes["free"])
    results: dict[tuple[str, str], list[float]] = {}
    shares: list[float] = []
    for round_index in range(args.rounds):
        order = [(m, k) for m in llms for k in modes]
        for method, mode in (order if round_index % 2 == 0 else list(reversed(order))):
            timer = GrammarTimer()
            if mode == "json":
                timer.wrap(structured.GrammarState, "blocked")
                timer.wrap(structured.GrammarState, "valid_prefix")
                timer.wrap(structured.GrammarState, "stopped")
                timer.wrap(sequence, "masked_rows")
            start = time.perf_counter()
            outs = llms[method].generate(prompts, modes[mode])
            wall = time.perf_counter() - start
            timer.restore()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            results.setdefault((method, mode), []).append(tokens / wall)
            if mode == "json":
                shares.append(timer.seconds / wall)
    for (method, mode), rates in sorted(results.items()):
        print(f"{method:6s} {mode:5s} {statistics.median(rates):7.1f} tok/s (median of {len(rates)})")
    for method in llms:
        ratio = statistics.median(results[(method, "json")]) / statistics.median(results[(method, "free")])
        print(f"{method}: constrained / free = {ratio:.2f}x")
    print(f"grammar time share of a constrained run: median {statistics.median(shares):.1%} "
          f"(min {min(shares):.1%}, max {max(shares):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How close the quantized kernels' numerics stay to the model: teacher-forced next-token top-1 agreement and mean
KL against the dequantized float32 model, at every position of some Spec-Bench dev prompts.

    .venv/bin/python benchmarks/quant_quality.py [MODEL] [--prompts 13] [--max-tokens 192] [--kernels int8,int16,bf16]
        [--residual float32,bf16] [--llamacpp]

The reference is the GGUF file's weights dequantized to float32 (transformers, float32 activations). Each kernel
(kernels/cpu_quant*.cpp: int8 or int16 digits an activation on integer dot products, or bf16 activations) runs
quickdraft's native runner on the file's blocks, each prompt as one forward; --llamacpp adds llama.cpp's
computation of the same file (llama-cpp-python, logits_all) on the same token ids. Prompts: the first turn of one
record per category (benchmarks/vs_llamacpp.py's choice, with the chat template where the model has one).
--residual: the dtype of the hidden states between layers (float32, the default for GGUF blocks since session 21, as
llama.cpp keeps them; bf16, the model dtype, as before), each kernel run with each.
KL(reference || kernel) in nats, averaged over positions; agreement: the kernel's argmax equals the reference's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from vs_llamacpp import prompts  # the same prompts as the speed comparison


def compare(reference: torch.Tensor, logits: torch.Tensor) -> tuple[int, float]:
    """(positions whose argmax agrees, sum of KL(reference || logits)) over the rows of two [n, V] logits."""
    ref, other = reference.double().log_softmax(-1), logits.double().log_softmax(-1)
    kl = (ref.exp() * (ref - other)).sum(-1)
    return int((reference.argmax(-1) == logits.argmax(-1)).sum()), float(kl.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--max-tokens", type=int, default=192, help="positions per prompt (its first tokens)")
    parser.add_argument("--kernels", default="int8,int16,bf16")
    parser.add_argument("--residual", default="float32", help="residual stream dtypes to compare: float32,bf16")
    parser.add_argument("--llamacpp", action="store_true", help="also llama.cpp's logits (needs llama-cpp-python)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from quickdraft.models.factory import load_runner
    from quickdraft.models.loader import load, resolve

    source = resolve(args.model)
    if source.gguf_path is None:
        raise SystemExit(f"{args.model} is not a GGUF model: nothing quantized to compare")
    cpu = torch.device("cpu")
    reference, tokenizer = load(source, torch.float32, cpu)
    runner, _ = load_runner(args.model)
    if runner.quantized_weights is None:
        raise SystemExit("this comparison needs quickdraft's quantized CPU kernels (an AVX512-BF16 CPU)")
    module = runner.kernels
    ids_list = [ids[: args.max_tokens] for ids in prompts(tokenizer, args.prompts)]
    residuals = {"float32": torch.float32, "bf16": torch.bfloat16}
    for name in args.residual.split(","):
        if name not in residuals:
            raise SystemExit(f"--residual: {name!r} is not one of {', '.join(residuals)}")
    engines = {f"quickdraft {name} {residual}": (name, residuals[residual])
               for name in args.kernels.split(",") for residual in args.residual.split(",")}
    llama = None
    if args.llamacpp:
        from llama_cpp import Llama

        llama = Llama(model_path=str(source.gguf_path), n_ctx=max(len(i) for i in ids_list) + 8, logits_all=True,
                      n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        engines["llama.cpp"] = None
    totals = {name: [0, 0.0] for name in engines}
    kl_per_prompt: dict[str, list[float]] = {name: [] for name in engines}
    positions = 0
    before = module.set_quant_kernel("")  # the override before ("": none), restored below
    try:
        for ids in ids_list:
            tokens = torch.tensor(ids)
            with torch.inference_mode():
                exact = reference(tokens[None]).logits[0].float()
            for name, kernel in engines.items():
                if kernel is not None:
                    module.set_quant_kernel(kernel[0])
                    runner.weights.residual_dtype = kernel[1]
                    logits = runner.forward(runner.new_cache(), tokens, len(ids))
                else:
                    llama.reset()
                    llama.eval(ids)
                    logits = torch.from_numpy(llama.scores[: len(ids)].copy()).float()
                agree, kl = compare(exact, logits)
                totals[name][0] += agree
                totals[name][1] += kl
                kl_per_prompt[name].append(kl / len(ids))
            positions += len(ids)
    finally:
        module.set_quant_kernel(before)
    print(f"{args.model}: {len(ids_list)} prompts, {positions} positions (up to {args.max_tokens} a prompt), "
          f"teacher-forced against the dequantized float32 model")
    print(f"  {'engine':30s} {'top-1 agreement':>16s} {'mean KL (nats)':>15s} {'median prompt KL':>17s}")
    for name, (agree, kl) in totals.items():
        print(f"  {name:30s} {agree / positions:16.4f} {kl / positions:15.6f} {statistics.median(kl_per_prompt[name]):17.6f}")


if __name__ == "__main__":
    main()

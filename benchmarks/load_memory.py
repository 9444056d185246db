"""How much a loaded model grows the process, against the bytes of its weights and of its GGUF tensors.

    .venv/bin/python benchmarks/load_memory.py [MODEL] [DTYPE]     (DTYPE: auto | bfloat16 | float32)

Run once per model and dtype, each in a fresh process: resident memory after `LLM(MODEL, dtype=DTYPE)` and a
two-token generate, minus before (libraries imported and the kernels built first), after a garbage
collection and malloc_trim; then what loading the tokenizer alone adds, for comparison. Also the peak: the
process's high-water resident memory (VmHWM, reset to the current size just before loading), minus before,
against the GGUF file's size plus the KV cache the generate allocated. Cold or warm depends on
$QUICKDRAFT_CACHE (empty: cold; after one run: warm).
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def reset_peak() -> bool:
    """Reset VmHWM to the current resident size (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def settle() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
    import gguf
    import transformers.models.gemma3.modeling_gemma3  # noqa: F401  (imports outside the measurement)
    import transformers.models.llama.modeling_llama  # noqa: F401

    from quickdraft import LLM, SamplingParams, kernels
    from quickdraft.models import loader

    kernels.cpu_linear()
    source = loader.resolve(model)
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(source.gguf_path)).tensors) if source.gguf_path else 0
    settle()
    before, start = rss_mb(), time.perf_counter()
    resettable = reset_peak()
    llm = LLM(model, speculative_config={"method": "none"}, dtype=dtype)
    seconds = time.perf_counter() - start
    llm.generate("Hello there", SamplingParams(max_tokens=2))
    peak = peak_mb() - before
    settle()
    grown = rss_mb() - before
    file_mb = source.gguf_path.stat().st_size / 1e6 if source.gguf_path else float("nan")
    # The generate's KV cache: a few tokens in a cache grown 64 positions at a time (128 bounds it).
    kv_mb = llm.target.kv_bytes_per_token * 128 / 1e6
    mark = rss_mb()
    tokenizer = loader._load_tokenizer(source.path, source.gguf_file, False)
    settle()
    held = llm.target.weight_bytes / 1e6
    print(f"{model} dtype {dtype}: load {seconds:.1f} s, process +{grown:.0f} MB; weights a step streams {held:.1f} MB"
          f" ({held / (stored / 1e6):.2f}x the GGUF's {stored / 1e6:.1f} MB of tensors); a tokenizer alone "
          f"+{rss_mb() - mark:.0f} MB" + ("" if tokenizer is not None else " (none)"))
    if resettable:
        print(f"  peak +{peak:.0f} MB over the {before:.0f} MB before loading = {peak / file_mb:.2f}x the file's "
              f"{file_mb:.0f} MB (KV cache of the generate <= {kv_mb:.0f} MB); process peak {before + peak:.0f} MB")


if __name__ == "__main__":
    main()

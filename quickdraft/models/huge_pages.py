"""A GGUF model's packed matrices moved into transparent huge pages (2 MB) on Linux.

Why: a decoding step streams every packed matrix (about 1 GB for the Qwen2.5-Coder 1.5B), and as loaded they sit
in 4 KB pages: the memory-mapped packed cache (file pages are mapped 4 KB at a time) or fresh allocations (THP's
common `madvise` mode gives them none). On 4 KB pages a step takes a TLB miss every 4 KB (a two-level page walk
under a hypervisor), and the hardware prefetchers stop at every page boundary. Measured on the 1.5B's forward
(benchmarks/RESULTS.md, session 25; Intel Xeon under KVM, 2 threads, one process, rounds interleaved): 2 MB pages
take 0.93-0.97x the time of one row, 0.86-0.96x of 5 and 0.91-0.95x of 8; the 0.5B 0.93x / 0.96x / 0.94x.

The matrices are copied one by one into one anonymous arena advised MADV_HUGEPAGE (so no more than one matrix is
held twice at a time), and each QuantizedWeight then points into it; the bytes are the same, so every result is
bitwise unchanged. The cost: the weights are then private to the process (a memory-mapped cache is shared by every
process that maps it), so several processes serving one model hold one copy each; and faulting in huge pages
compacts memory synchronously (THP's `madvise` defrag), measured 0.2-2.8 s a GB here depending on fragmentation.

Opt-in (QUICKDRAFT_HUGE_PAGES=1): end to end the forward's gain did not show above the spread. The Qwen pair, 3
code + 3 Spec-Bench prompts, 96 tokens, greedy, one process: plain 1.022x (0.95-1.18), draft_model 1.007x
(0.92-1.06); a batch of 8 requests, 48 tokens, 4 rounds: 0.997x.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each matrix starts on a cache line
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> str | None:
    """None where the weights can move into huge pages, else why not."""
    if os.environ.get("QUICKDRAFT_HUGE_PAGES", "0") != "1":
        return "off (QUICKDRAFT_HUGE_PAGES=1 turns it on)"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux (no transparent huge pages)"
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return "this kernel has no transparent huge pages"
    if "[never]" in setting:
        return f"transparent huge pages are off ({_THP_SETTING}: never)"
    return None


def move_into_huge_pages(weights) -> bool:
    """Point each matrix of `weights` (models/gguf_weights.QuantizedWeights) that a step streams at a copy of its
    packed bytes in one huge-page arena (an embedding apart from the output head stays: a step gathers a few of
    its rows). Returns whether it did (False: not available here, or under one huge page in all)."""
    reason = available()
    if reason is not None:
        log.info("packed weights stay in 4 KB pages: %s", reason)
        return False
    streamed = weights.named()
    if weights.output is not None or not weights.tied:  # an embedding that is not the head: a few rows a step
        streamed.pop("embedding", None)
    matrices = [w for w in streamed.values() if w.packed.device.type == "cpu"]
    total = sum(_padded(w.packed) for w in matrices)
    if total < HUGE_PAGE:
        return False
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # a kernel that refuses the advice: the copy would only cost memory traffic
        log.info("packed weights stay in 4 KB pages: madvise(MADV_HUGEPAGE) failed (%s)", exc)
        arena.close()
        return False
    # The tensors keep the mmap object alive (torch.frombuffer holds a reference to its buffer).
    memory = torch.frombuffer(arena, dtype=torch.uint8)
    at = (-memory.data_ptr()) % HUGE_PAGE  # the arena's first 2 MB boundary
    for w in matrices:
        view = memory[at:at + w.packed.nbytes].view(w.packed.dtype).view(w.packed.shape)
        view.copy_(w.packed)
        w.packed = view  # the original (a file mapping or an allocation) is released here
        at += _padded(view)
    return True


def _padded(t: torch.Tensor) -> int:
    return (t.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN

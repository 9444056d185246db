"""The Runner protocol: a causal LM behind one small interface, each sequence with its own cache.

A runner is stateless across sequences; each sequence owns a SequenceCache of the runner's own class (new_cache).
forward_batch takes several sequences at once (one model call for all on quickdraft's decoder, one call per
sequence on the transformers runner, models/hf.py, behind the same interface), so that batching requests changes
the runner, not its callers. There is one runner class per backend, each with its own forward and cache layout,
none switched by flags: quickdraft's decoder as CpuKernelRunner (models/cpu_runner.py, the C++ layer loop),
TorchRunner (models/torch_runner.py, eager torch, the reference) and CudaRunner (models/cuda_runner.py, static
shapes and CUDA graphs), sharing one DecoderWeights (models/weights.py); models/factory.py picks among them.
What callers need to know of a runner (its kind and backend, config, weight bytes, kept-quantized blocks,
whether rows are computed alike) is declared here, so that no caller probes for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from quickdraft.models.gguf_weights import QuantizedWeights

@dataclass(frozen=True)
class TreeAttention:
    """How one sequence's new rows of a forward attend when they form a token tree (issue 25; token_tree.py).

    The cache's slots [0, base) are a plain causal prefix (slot = position). Every slot s in [base, end) is a
    tree node with a parent slot parents[s - base]: base - 1 (a child of the prefix's last token, the tree's
    root) or a tree slot in [base, s). A node sees the prefix [0, base), its ancestors in the tree and itself,
    and sits at position base + depth - 1 (depth 1 for a child of the root), so a path of the tree is computed
    exactly as the same tokens in a line (bitwise on the native kernels). `parents` covers every tree slot up to
    the end of this call, those already cached by earlier calls (a draft growing its tree level by level) and
    the new ones; new rows below `base` are plain causal rows. A chain is parents = [base - 1, base, base + 1..].
    """

    base: int
    parents: tuple[int, ...]  # [end - base] the parent slot of each tree slot

    def __post_init__(self) -> None:
        if self.base < 1:
            raise ValueError(f"TreeAttention: base {self.base}; a tree hangs off at least one cached token")
        for i, parent in enumerate(self.parents):
            slot = self.base + i
            if not (parent == self.base - 1 or self.base <= parent < slot):
                raise ValueError(f"TreeAttention: slot {slot} has parent {parent}; a parent is {self.base - 1} (the "
                                 f"root) or an earlier tree slot in [{self.base}, {slot})")

    @property
    def end(self) -> int:
        return self.base + len(self.parents)

    def depths(self) -> list[int]:
        """[end - base] each tree slot's depth (1: a child of the root)."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent == self.base - 1 else depth[parent - self.base] + 1)
        return depth

    def positions(self, start: int, count: int) -> list[int]:
        """The positions of slots start..start+count-1 (plain below base, base + depth - 1 in the tree)."""
        depth = self.depths()
        return [slot if slot < self.base else self.base + depth[slot - self.base] - 1
                for slot in range(start, start + count)]

    def visible(self, slot: int) -> list[int]:
        """The slots `slot` attends to, in position order (the prefix, its ancestors, itself)."""
        if slot < self.base:
            return list(range(slot + 1))
        path = []
        while slot >= self.base:
            path.append(slot)
            slot = self.parents[slot - self.base]
        return list(range(self.base)) + path[::-1]

    @staticmethod
    def of_tree(base: int, tree_parents) -> "TreeAttention":
        """The tree of token_tree.TokenTree.parents (node i's parent node, -1: the root) with its nodes at slots
        base.. in node order (the root, the last committed token, at base - 1)."""
        return TreeAttention(base, tuple(base - 1 if p < 0 else base + int(p) for p in tree_parents))


# The weight-only quantizations a runner's quantized(scheme) takes (quickdraft's decoder's; see models/linear.py).
QUANTIZATION_SCHEMES = ("int8", "q4")


@runtime_checkable
class Runner(Protocol):
    """What the engine, the drafts, the bench and the tools use of a model: quickdraft's own decoder (the runners
    of models/decoder.py) and the transformers forward (models/hf.py) all provide it."""

    name: str
    kind: str  # "native" (quickdraft's own decoder) or "hf" (the transformers forward)
    # The backend that computes it, one runner class each: "cpu-kernels", "torch", "cuda" (quickdraft's decoder)
    # or "transformers".
    backend: str
    model: nn.Module  # the transformers model it was built from (a native runner may have released weights of it)
    text_config: PretrainedConfig  # the decoder's transformers config (models/config.get_text_config)
    vocab_size: int
    max_len: int
    forwards: int  # model calls so far, for metrics
    quantized_weights: QuantizedWeights | None  # a GGUF file's blocks the runner keeps in their stored format
    # The activation scheme those blocks run now (int16, int8x32, int8, bf16: the family's choice or the
    # QUICKDRAFT_QUANT_KERNEL override, kernels/cpu_quant.cpp), None where the runner keeps no blocks.
    quant_kernel_in_use: str | None

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int:
        """What one position of one sequence's cache takes: layers x kv_heads x head_dim x 2 x dtype size."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decoding step reads (the input embedding's rows it gathers are not counted)."""

    @property
    def rows_invariant(self) -> bool:
        """Whether a row's outputs are bitwise the same whatever the other rows of a forward (then a token's
        logits and cached keys do not depend on how it was batched, verified or prefilled)."""

    def new_cache(self) -> SequenceCache: ...

    def forward(self, cache: SequenceCache, tokens: torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        """Append tokens [n] to the sequence; float32 logits of the last num_logits inputs [num_logits, V]."""

    def forward_batch(self, caches: list[SequenceCache], tokens: list[torch.Tensor],
                      num_logits: list[int], return_hidden: bool = False,
                      trees: list[TreeAttention | None] | None = None, argmax_only: bool = False):
        """Several sequences in one step; their logits concatenated in order, [sum(num_logits), V]. With
        argmax_only, each of those rows' argmax instead, [sum(num_logits)] int64 (the first index of the maximum,
        as logits.argmax(-1)): all a step verified greedily with nothing to process reads, which a runner may
        compute without writing the logits (the CPU kernels' output layer keeps them in cache). With
        return_hidden, (logits, hidden): every input row's last hidden state after the final norm (the output
        layer's input; what an EAGLE head reads), [sum(n_i), hidden], at no extra forward.
        trees: per sequence None (causal rows) or a TreeAttention whose end is len(cache) + n_i: its rows are
        written at slots len(cache).. and attend as the tree says; the cache then holds the tree's slots until
        the caller compacts it (SequenceCache.compact) or rolls it back."""

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [n] -> the input embeddings the first layer reads, [n, hidden]."""

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] (forward_batch's return_hidden) -> float32 logits [n, V]."""

    def output_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] -> each row's argmax of output_logits [n] int64 (the first index of the
        maximum; logits.argmax(-1) where a row holds a NaN)."""

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the output layer's weight, float32 on the CPU [len(ids), hidden]."""

    def final_norm_weight(self) -> torch.Tensor:
        """The final norm's weight as the transformers model stores it, float32 on the CPU [hidden] (what an
        EAGLE head copies)."""

    def truncated(self, num_layers: int) -> "Runner":
        """The first num_layers layers, final norm and head, sharing this runner's weights (a self-draft)."""

    def quantized(self, scheme: str) -> "Runner":
        """A weight-only quantized copy (a self-draft), or a QuickdraftError where the runner has none."""

    def with_vocabulary(self, size: int) -> "Runner":
        """A view scoring only token ids [0, size) (logits [n, size], its vocab_size `size`), sharing this runner's
        weights and reading only that part of its output head (a draft's smaller head), or a QuickdraftError
        where the runner cannot."""


def check_batch(runner: Runner, caches: list, tokens: list, num_logits: list) -> list[torch.Tensor]:
    """What a runner's forward_batch checks before it changes any cache: one token tensor [n_i] (n_i >= 1) and
    one num_logits (0 <= k_i <= n_i) per cache, no cache twice, and every sequence within the runner's
    context. Returns the token tensors flattened to [n_i]."""
    if not len(caches) == len(tokens) == len(num_logits):
        raise QuickdraftError(f"{runner.name}: forward_batch takes one token tensor and one num_logits per cache; "
                              f"got {len(caches)} caches, {len(tokens)} token tensors and {len(num_logits)} num_logits")
    if not caches:
        raise QuickdraftError(f"{runner.name}: forward_batch needs at least one sequence")
    if len({id(cache) for cache in caches}) != len(caches):
        raise QuickdraftError(f"{runner.name}: forward_batch got the same cache twice; each sequence has its own")
    flat = []
    max_len = runner.max_len
    for i, (cache, ids, k) in enumerate(zip(caches, tokens, num_logits)):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            ids = torch.as_tensor(ids).reshape(-1)  # [n_i]
        n = ids.shape[0]
        if n == 0 or not 0 <= k <= n or len(cache) + n > max_len:  # asked of every sequence every step: once
            which = f" (sequence {i} of the batch)" if len(caches) > 1 else ""
            if n == 0:
                raise QuickdraftError(f"{runner.name}: no tokens to append{which}; each sequence needs at least one")
            if not 0 <= k <= n:
                raise QuickdraftError(f"{runner.name}: num_logits {int(k)} of a sequence of {n} new tokens{which}; "
                                      f"it must be in [0, {n}]")
            raise QuickdraftError(f"{runner.name}: sequence of {len(cache) + n} tokens exceeds the context of "
                                  f"{max_len}{which}; shorten the prompt or max_tokens")
        flat.append(ids)
    return flat


def check_tree(name: str, tree: TreeAttention, length: int, count: int, which: str = "") -> None:
    """A QuickdraftError unless `tree` describes a forward that appends `count` rows to a cache of `length`
    slots (its parents cover every tree slot up to the end of this call)."""
    if not isinstance(tree, TreeAttention):
        raise QuickdraftError(f"{name}: trees take a models.base.TreeAttention or None per sequence, got "
                              f"{type(tree).__name__}{which}")
    if tree.end != length + count:
        raise QuickdraftError(f"{name}: a token tree ending at slot {tree.end} (base {tree.base}, "
                              f"{len(tree.parents)} tree slots) for {count} new rows on a cache of {length}{which}; "
                              f"its parents must cover every tree slot up to len(cache) + n = {length + count}")


def check_trees(runner: Runner, caches: list, tokens: list[torch.Tensor],
                trees: list[TreeAttention | None] | None) -> list[TreeAttention | None] | None:
    """What a runner checks of forward_batch's trees before it changes any cache: one entry per sequence, each
    None or a tree ending where the call does (check_tree). Returns the trees, or None when no sequence has one."""
    if trees is None:
        return None
    if len(trees) != len(caches):
        raise QuickdraftError(f"{runner.name}: forward_batch takes one tree (or None) per sequence; got {len(trees)} "
                              f"for {len(caches)} sequences")
    for i, (cache, ids, tree) in enumerate(zip(caches, tokens, trees)):
        if tree is not None:
            check_tree(runner.name, tree, len(cache), int(ids.shape[0]),
                       f" (sequence {i} of the batch)" if len(caches) > 1 else "")
    return trees if any(tree is not None for tree in trees) else None

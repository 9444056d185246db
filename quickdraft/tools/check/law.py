"""The exact law of plain sampling over output prefixes (a pruned prefix tree, one target forward per expanded
prefix) and the engine's processing of a row of logits that it rests on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from quickdraft.params import SamplingParams

EXPAND_MIN_COUNT = 5.0  # expand a prefix (one target forward) when its expected count reaches this
STORE_MIN_COUNT = 0.5  # keep a child's probability when its expected count reaches this (pooled otherwise)


def _process(runner, logits: "torch.Tensor", prompt: list[int], output: list[int] | tuple[int, ...],
             params: "SamplingParams") -> "torch.Tensor":
    """sampling.process of logits [1, V] (float32, as the engine computes them) with the history prompt +
    output, as the engine's Sequence.process does. [1, V]."""
    import torch

    from quickdraft.sampling import PenaltyHistory, process

    seen = counts = None
    if params.uses_penalties:
        history = PenaltyHistory(prompt, runner.vocab_size, logits.device)
        history.append(list(output))
        seen, counts = history.rows(torch.empty(0, dtype=torch.long, device=logits.device), 1)
    return process(logits, params, seen, counts)


class _OverBudget(Exception):
    pass


class _PrefixTree:
    """The exact law of plain sampling over output prefixes of up to `depth` tokens, pruned.

    probs: prefix -> its probability, for the prefixes kept (expected count >= STORE_MIN_COUNT under an
        expanded parent); the root () has probability 1.
    expanded: prefix -> the packed mask of tokens of probability zero after it (None: none), for every prefix
        whose next-token distribution was computed (one target forward each).
    terminal: kept prefixes that end the sequence (EOS or a stop token id) before `depth`."""

    def __init__(self, depth: int):
        self.depth = depth
        self.probs: dict[tuple[int, ...], float] = {(): 1.0}
        self.expanded: dict[tuple[int, ...], Any] = {}
        self.terminal: set[tuple[int, ...]] = set()
        self.forwards = 0

    @classmethod
    def build(cls, runner, prompt: list[int], params: "SamplingParams", n: int, depth: int, terminal_tokens: set[int],
              budget: int) -> "_PrefixTree | None":
        """Expand from the prompt, depth first, one forward per prefix on one cache rolled back between
        siblings; None when it would take more than `budget` forwards."""
        import torch

        tree = cls(depth)
        cache = runner.new_cache()
        device = runner.device

        def visit(prefix: tuple[int, ...], logits: torch.Tensor) -> None:
            probs = _process(runner, logits, prompt, prefix, params)[0]  # [V] float32, the engine's numbers
            zero = probs == 0
            tree.expanded[prefix] = _pack(zero) if bool(zero.any()) else None
            child_probs = probs.double() * tree.probs[prefix]  # [V]
            kept = torch.nonzero(child_probs * n >= STORE_MIN_COUNT).flatten().tolist()
            for token in kept:
                tree.probs[prefix + (token,)] = float(child_probs[token])
            for token in kept:
                child = prefix + (token,)
                if token in terminal_tokens:
                    tree.terminal.add(child)
                    continue
                if len(child) >= depth or tree.probs[child] * n < EXPAND_MIN_COUNT:
                    continue
                tree.forwards += 1
                if tree.forwards > budget:
                    raise _OverBudget
                row = runner.forward(cache, torch.tensor([token], dtype=torch.long, device=device), 1)
                visit(child, row)
                cache.rollback(len(prompt) + len(prefix))

        tree.forwards = 1
        try:
            visit((), runner.forward(cache, torch.tensor(prompt, dtype=torch.long, device=device), 1))
        except _OverBudget:
            return None
        return tree

    def impossible(self, tokens: tuple[int, ...]) -> bool:
        """Whether a sample takes a token of probability zero after a prefix whose distribution is known."""
        for i, token in enumerate(tokens):
            prefix = tokens[:i]
            if prefix not in self.expanded:
                return False
            mask = self.expanded[prefix]
            if mask is not None and _is_set(mask, token):
                return True
        return False

    def known(self, view: tuple[int, int]) -> dict[tuple[int, ...], float]:
        """The view's cells the tree knows (key -> probability): kept prefixes of the view's end length, and kept
        terminal ones shorter (a sequence that ended); the rest of the mass is the remainder."""
        start, end = view
        cells: dict[tuple[int, ...], float] = {}
        for prefix, p in self.probs.items():
            if len(prefix) == end or (len(prefix) < end and prefix in self.terminal):
                key = prefix[start:end]
                cells[key] = cells.get(key, 0.0) + p
        return cells

    def key(self, tokens: tuple[int, ...], view: tuple[int, int]) -> tuple[int, ...] | None:
        """A sample's key in the view, or None when its prefix is not one the tree knows (the remainder)."""
        start, end = view
        prefix = tokens[:end]
        if prefix in self.probs and (len(prefix) == end or prefix in self.terminal):
            return prefix[start:end]
        return None


def _pack(mask: "torch.Tensor") -> Any:
    import numpy as np

    return np.packbits(mask.cpu().numpy())


def _is_set(packed: Any, index: int) -> bool:
    return bool((int(packed[index >> 3]) >> (7 - (index & 7))) & 1)

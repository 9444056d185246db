"""Logits processing shared by the target and the draft: penalties, temperature, top-k, top-p, min-p.

Pure tensor functions with no I/O. Every function takes logits of shape [..., n, V] where the n rows are
consecutive positions of one sequence; the speculative engine processes the target's K+1 positions and
the draft's K positions with the same functions and the same per-position histories, which is what makes
the processed draft distribution q and target distribution p comparable in rejection sampling.
"""

from __future__ import annotations

import hashlib

import torch

from quickdraft import kernels
from quickdraft.params import SamplingParams


def _float(logits: torch.Tensor) -> torch.Tensor:
    # Half-precision logits are upcast: top-p cumsums and the p/q ratios need the precision.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _row_kernels(x: torch.Tensor):
    """The compiled row reductions (kernels/cpu_rows.cpp) where they take x: float32 CPU rows, contiguous."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] == 0 \
            or not x.is_contiguous():
        return None
    return kernels.cpu_linear()  # built on first use, None where it cannot run


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the first index of each row's maximum, [...]: on float32 CPU rows by one vectorized pass a
    row (torch's argmax over the Qwen pair's 151,936 tokens took 8x its amax here), elsewhere torch's."""
    module = _row_kernels(x)
    if module is not None:
        index, has_nan = module.rows_argmax(x.reshape(-1, x.shape[-1]))
        if not has_nan:  # torch's argmax takes a NaN as the maximum: leave those rows to it
            return index.reshape(x.shape[:-1])
    return x.argmax(-1)


def top_k_rows(x: torch.Tensor, k: int, with_logsumexp: bool = False):
    """torch.topk(x, k) over the last dimension of [R, V] rows, most first, equal values in index order: (values,
    indices), and with_logsumexp also each row's logsumexp [R] (float32). On float32 CPU rows one vectorized pass a
    row (kernels/cpu_rows.cpp), elsewhere torch's (whose order among equal values is unspecified)."""
    module = _row_kernels(x) if x.dim() == 2 and 1 <= k <= x.shape[-1] else None
    if module is not None:
        values, indices, lse, ok = module.rows_top_k(x, k, with_logsumexp)
        if ok:
            return (values, indices, lse) if with_logsumexp else (values, indices)
    values, indices = torch.topk(x, k)
    return (values, indices, torch.logsumexp(x.float(), -1)) if with_logsumexp else (values, indices)


class PenaltyTable:
    """The seen tokens and output counts of many requests as rows of two [rows, V] tensors on the device (the
    engine keeps one for every sequence with penalties): each row is updated in place as its tokens commit, and a
    step reads all its sequences' rows with one index (PenaltyTable.gather). Rows are reused once freed. Its
    tensors are inference tensors (made and updated under torch.inference_mode, whether or not the caller is in
    it: a table made during a step is updated between steps)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [rows, V]
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)  # [rows, V]
        self._free: list[int] = []

    @torch.inference_mode()
    def add(self) -> int:
        """A zeroed row (the table doubles when none is free)."""
        if not self._free:
            rows = self.seen.shape[0]
            more = max(rows, 1)
            self.seen = torch.cat([self.seen, self.seen.new_zeros(more, self.vocab_size)])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(more, self.vocab_size)])
            self._free = list(range(rows + more - 1, rows - 1, -1))
        return self._free.pop()

    @torch.inference_mode()
    def free(self, row: int) -> None:
        self.seen[row] = False
        self.counts[row] = 0
        self._free.append(row)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [n, V], output counts [n, V]) of the table rows `rows` [n]."""
        return self.seen.index_select(0, rows), self.counts.index_select(0, rows)


class PenaltyHistory:
    """Counts of the committed tokens of one request, kept on the device for penalties: a row of a PenaltyTable
    (the engine's, shared by its sequences; a table of its own when none is given).

    `seen` marks tokens of the prompt or the output (repetition penalty); `output_counts` counts tokens of
    the output (presence and frequency penalties).
    """

    def __init__(self, prompt_ids: list[int], vocab_size: int, device: torch.device,
                 table: PenaltyTable | None = None):
        self.vocab_size = vocab_size
        self.table = table if table is not None else PenaltyTable(vocab_size, device)
        self.row = self.table.add()
        ids = torch.tensor([t for t in prompt_ids if t < vocab_size], dtype=torch.long, device=self.table.seen.device)
        with torch.inference_mode():
            self.seen[ids] = True

    @property
    def seen(self) -> torch.Tensor:
        return self.table.seen[self.row]  # [V], a view: the table may have grown since the last call

    @property
    def output_counts(self) -> torch.Tensor:
        return self.table.counts[self.row]

    def release(self) -> None:
        """Give the row back to the table (the sequence is done)."""
        self.table.free(self.row)

    @torch.inference_mode()
    def move_to(self, table: PenaltyTable) -> None:
        """Keep this history in a row of `table` from now on (the engine's shared one), giving back its row."""
        if table is self.table:
            return
        row = table.add()
        table.seen[row] = self.seen
        table.counts[row] = self.output_counts
        self.release()
        self.table, self.row = table, row

    @torch.inference_mode()
    def append(self, token_ids: list[int] | torch.Tensor) -> None:
        seen, counts = self.seen, self.output_counts
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=seen.device)
        ids = ids[ids < self.vocab_size]
        seen[ids] = True
        counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))

    def rows(self, pending: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Histories for `n_rows` consecutive positions: row i also contains pending[:i] (the draft tokens
        that precede position i). Returns (seen [n_rows, V], output_counts [n_rows, V])."""
        seen, output_counts = self.seen, self.output_counts
        steps = torch.zeros(n_rows, self.vocab_size, dtype=torch.float32, device=seen.device)
        m = min(n_rows - 1, pending.numel())
        if m > 0:
            rows = torch.arange(1, m + 1, device=seen.device)
            steps[rows, pending[:m].to(seen.device)] = 1.0
        counts = output_counts + steps.cumsum(0)
        return seen | (counts > output_counts), counts

    def tree_rows(self, tree) -> tuple[torch.Tensor, torch.Tensor]:
        """Histories of a token tree's rows (token_tree.TokenTree: the root's row, then each node's): row r also
        contains the draft tokens on the path to it. Returns (seen [N + 1, V], output_counts [N + 1, V])."""
        seen, output_counts = self.seen, self.output_counts
        counts = output_counts + tree.to(seen.device).row_path_counts(self.vocab_size)
        return seen | (counts > output_counts), counts


def add_logit_bias(logits: torch.Tensor, rows: list[int], token_ids: list[int], values: list[float]) -> torch.Tensor:
    """logits [R, V] with values added at (rows[i], token_ids[i]) (OpenAI's logit_bias of every biased row), in one
    scatter-add; a (row, token) appears at most once."""
    device = logits.device
    index = torch.tensor([rows, token_ids], dtype=torch.long).to(device)
    return logits.index_put((index[0], index[1]), torch.tensor(values, dtype=logits.dtype).to(device),
                            accumulate=True)


def penalize(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
             presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Repetition (multiplicative, on the `seen` tokens), presence and frequency (additive, by output `counts`)
    penalties of rows [..., V], each row with its own penalties (tensors that broadcast against the rows: [R, 1],
    or 0-d for one request). A penalty of 1 (repetition) or 0 leaves a row's logits as they are, bit for bit."""
    repetition = repetition.to(logits.dtype)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    counts = counts.to(logits.dtype)
    return logits - presence.to(logits.dtype) * (counts > 0).to(logits.dtype) - frequency.to(logits.dtype) * counts


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None, counts: torch.Tensor | None
) -> torch.Tensor:
    """The logit bias (additive, on its token ids), then repetition (multiplicative, on prompt+output tokens),
    presence and frequency (additive, on output tokens) penalties. `seen` and `counts` have the shape of
    `logits` (needed only with penalties)."""
    logits = _float(logits)
    if params.logit_bias:  # first, as vLLM does: penalties then act on the biased logits
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        values = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits = logits.index_add(-1, ids, values.expand(*logits.shape[:-1], -1))
    if not params.uses_penalties:
        return logits
    if seen is None or counts is None:
        raise ValueError("penalties need the token history (seen, counts)")
    scalars = torch.tensor([params.repetition_penalty, params.presence_penalty, params.frequency_penalty],
                           dtype=logits.dtype, device=logits.device)
    return penalize(logits, seen, counts, scalars[0], scalars[1], scalars[2])


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering; returns normalised probabilities, [..., V].

    Not for greedy requests (temperature 0), which take the argmax of the penalised logits."""
    if params.temperature <= 0:
        raise ValueError("logits_to_probs is for sampling; greedy requests use argmax")
    flat = logits.reshape(-1, logits.shape[-1])
    return probs_rows(flat, [params] * flat.shape[0]).reshape(logits.shape)


def probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits_to_probs with each row's own parameters (rows of many requests in one pass): temperature, then
    top-k, top-p, min-p. logits: [R, V]; params: R sampled (temperature > 0) SamplingParams. Returns [R, V].
    Each row is computed by the same ops whatever the other rows: the filters that a row does not use leave
    it unchanged (a top-k of 0 or V keeps every logit, a top-p of 1 and a min-p of 0 keep every token)."""
    rows, vocab = logits.shape
    device = logits.device
    if any(p.temperature <= 0 for p in params):
        raise ValueError("probs_rows is for sampling; greedy requests use argmax")
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    logits = _float(logits)
    logits = logits / temperature[:, None].to(logits.dtype)
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_ks):
        largest = max(top_ks)
        top = torch.topk(logits, largest, dim=-1).values  # [R, largest], descending: column k-1 is the k-th
        k = torch.tensor(top_ks, dtype=torch.long, device=device)
        kth = top.gather(1, (k.clamp(min=1) - 1)[:, None])
        kth = kth.masked_fill((k == 0)[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1]
    if nucleus:
        index = torch.tensor(nucleus, dtype=torch.long, device=device)
        top_p = torch.tensor([params[i].top_p for i in nucleus], dtype=probs.dtype, device=device)
        part = probs.index_select(0, index)
        sorted_probs, order = torch.sort(part, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        part = torch.zeros_like(part).scatter(-1, order, sorted_probs)
        probs = probs.index_copy(0, index, part / part.sum(-1, keepdim=True))
    floor = [i for i, p in enumerate(params) if p.min_p > 0]
    if floor:
        index = torch.tensor(floor, dtype=torch.long, device=device)
        min_p = torch.tensor([params[i].min_p for i in floor], dtype=probs.dtype, device=device)
        part = probs.index_select(0, index)
        part = part.masked_fill(part < min_p[:, None] * part.amax(-1, keepdim=True), 0.0)
        probs = probs.index_copy(0, index, part / part.sum(-1, keepdim=True))
    return probs


def process(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Penalised logits for greedy requests, processed probabilities for sampled ones."""
    logits = apply_penalties(logits, params, seen, counts)
    return logits if params.greedy else logits_to_probs(logits, params)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[dict[int, tuple[float, int]]]:
    """Per row of raw logits [n, V] (row i scores tokens[i]): {token id: (log-probability, rank)} for tokens[i]
    and the `top` most likely tokens (rank 1 is the most likely). Each row is computed alone, so a row's numbers
    do not depend on how many rows a step verified (they equal plain decoding's bitwise where the logits do)."""
    out = []
    for row, token in zip(logits, tokens.tolist()):
        logp = torch.log_softmax(row.float(), -1)  # [V]
        chosen = float(logp[token])
        entry = {token: (chosen, int((logp > chosen).sum()) + 1)}
        if top:
            values, ids = torch.topk(logp, top)
            for rank, (token_id, value) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
                entry.setdefault(token_id, (value, rank))
        out.append(entry)
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
         ) -> torch.Tensor:
    """One token from each row of probs [B, V] (weights, not necessarily normalised), by the inverse of its
    cumulative distribution at a uniform u: the first token whose cumulative weight exceeds u * total. A
    token of weight zero adds nothing to the cumulative sum, so it is never the first to exceed. [B] long.
    uniform: [B] float64 u per row, drawn by the caller (each row from its own generator); else drawn here.

    Why not torch.multinomial: for one draw over a 49k-token vocabulary it took 1.6 ms per row here, 14% of
    a batched step at T=0.8; a float64 cumulative sum and a binary search take a few tens of microseconds."""
    cumulative = probs.double().cumsum(-1)  # [B, V]
    if uniform is None:
        u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    else:
        u = uniform.to(device=probs.device, dtype=torch.float64).reshape(-1, 1)
    index = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True)
    return index.squeeze(1).clamp(max=probs.shape[-1] - 1)  # u * total < total: the clamp never binds


def sample(processed: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `process`'s output: argmax when greedy, else a draw from the probabilities."""
    if params.greedy:
        return argmax_rows(processed)
    flat = processed.reshape(-1, processed.shape[-1])
    return draw(flat, generator).reshape(processed.shape[:-1])


def derive_key(*parts: int) -> int:
    """A 63-bit key from integers (seeds, completion indices, positions) by a real hash of their bytes
    (BLAKE2b): distinct inputs give distinct keys, unlike Python's hash(), for which hash(-1) == hash(-2)
    and integers wrap modulo 2^61 - 1. Each part must fit in 128 signed bits."""
    data = b"".join(int(part).to_bytes(16, "little", signed=True) for part in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


_GRID_BITS = 52
_GRID = 1 << _GRID_BITS


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# SplitMix64 (Steele, Lea and Flood 2014): a counter-based generator, state_i = seed + i * golden, output
# mix(state_i). In int64 tensor arithmetic (multiplication wraps, shifts made logical by a mask) it runs as
# ten vectorized passes on any device, several times faster than seeding a torch Generator per position
# and drawing from its Mersenne Twister.
_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)  # >> on int64 is arithmetic; the mask makes it logical


def noise_seed(key: int, position: int) -> int:
    """The SplitMix64 seed of one output position's noise under a request's noise key."""
    return _signed(derive_key(key, position))


def _grid_cells(seeds: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Integers in [0, 2^52) [len(seeds), vocab]: cell j of row r is SplitMix64 output j + 1 of the stream
    seeded by seeds[r] (noise_seed(key, position)), its top 52 bits."""
    seeds = torch.tensor(seeds, dtype=torch.int64, device=device)
    x = seeds[:, None] + torch.arange(1, vocab + 1, dtype=torch.int64, device=device)[None, :] * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return _shift_right(x, 64 - _GRID_BITS)


def _uniform(seeds: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    # u is the midpoint of a cell of a 2^52 grid on (0, 1): never 0 or 1.
    return (_grid_cells(seeds, vocab, device).double() + 0.5) / _GRID


def position_noise(key: int, first: int, count: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise E [count, vocab] (float64) for output positions first .. first+count-1, a function of
    (key, position) only: whichever step reaches a position, and however many positions it verifies, it
    draws the same. E is strictly positive and finite: u is the midpoint of a cell of a 2^52 grid on (0, 1),
    so E = -log(u) lies in [1.1e-16, 36.7] and log E is finite (see noisy_scores)."""
    return -torch.log(_uniform([noise_seed(key, p) for p in range(first, first + count)], vocab, device))


def log_noise_rows(seeds: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """log E of the positions with these noise seeds, [len(seeds), vocab] float64: the noise of many
    positions (of many sequences) in one pass, as scores_with_log_noise takes it."""
    return torch.log(-torch.log(_uniform(seeds, vocab, device)))


def noisy_scores(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log p - log E: argmax over a row is a draw from p (the exponential race, a form of the Gumbel-max
    trick). In log space with E finite and positive, a token of probability zero scores -inf and can never
    win, whatever its noise (p / E with E = inf would score it 0, the same as every other token's floor)."""
    return scores_with_log_noise(probs, noise.log())


def scores_with_log_noise(probs: torch.Tensor, log_noise: torch.Tensor) -> torch.Tensor:
    """noisy_scores given log E (a sequence keeps log E of the positions it may verify again: see
    Sequence.log_noise)."""
    return probs.double().log() - log_noise


def sample_with_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A draw from each row of p with E_i ~ Exp(1) independent. With noise from `position_noise`, a seeded
    request draws the same token at a position whether it decodes plainly or speculatively."""
    return noisy_scores(probs, noise).argmax(-1)

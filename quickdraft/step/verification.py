"""A step's verification over its whole batch, as tensors.

`process_rows` turns the target's rows [num_rows, V] (the layout quickdraft.step_batch.StepBatch names) into
what verification reads, in grouped tensor operations over every sequence of the step: the grammar masks (built
per sequence by llguidance, applied in one masked fill), the logit bias (one scatter-add), the penalties (the
sequences' seen tokens and output counts gathered from the engine's sampling.PenaltyTable in one index, plus the
draft tokens on the path to each row in one scatter-add; sampling.penalize with per-row penalties), then
temperature, top-k, top-p and min-p for every sampled row (sampling.probs_rows). Greedy rows stay logits.

`verify` judges every sequence's drafts at once (verify.py and verify_tree.py hold the rules; vLLM's rejection
sampler is the model):
- greedy and seeded chains: one verify.greedy_accept over the batch, matching the target's own token at each
  row (one argmax over the step's rows; a seeded sequence's rows take the argmax of their noise-keyed scores);
- sampled chains without a seed: one verify.rejection_sample_rows over those sequences, each drawing its
  uniforms from its own generator (so a sequence's randomness does not depend on its batch-mates), the residual
  max(0, p - q) renormalised only on the rejected rows and every next token drawn together;
- greedy and seeded token trees: one verify_tree.match_trees over their flattened nodes; sampled trees by
  verify_tree.tree_rejection_sample, one per tree (recursive rejection sampling walks each tree's ranks).
The results stay tensors (StepVerdict: accepted counts [B] and output tokens [B, max K + 1]) until the step's one
host transfer (StepVerdict.to_host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quickdraft import sampling, verify, verify_tree
from quickdraft.sequence import Sequence, prefetch_log_noise
from quickdraft.step_batch import StepBatch

__all__ = ["StepVerdict", "Verdict", "process_rows", "reads_argmax_only", "verify_batch"]


class Verdict(NamedTuple):
    """One sequence's verification, on the host: the drafts it accepted (a chain's first ones, a tree's path:
    their indices among its drafts), then the target's token after them. (A tuple: one is made for every sequence
    of every step.)"""

    num_accepted: int
    tokens: list[int]  # [num_accepted + 1]: the accepted drafts, then the target's token
    nodes: list[int]  # [num_accepted]: the accepted drafts' indices (0..n-1 for a chain)


@dataclass(frozen=True)
class StepVerdict:
    """Every sequence's verification on the device: num_accepted [B]; tokens [B, W] (W = the longest chain or
    tree depth + 1): each row's accepted drafts then the target's token, -1 after; nodes [B, W - 1]: the accepted
    tree nodes in path order, -1 after (None when the step has no tree). Or, where the step's greedy chains were
    verified on the host (_greedy_chains_on_host), their verdicts as they are."""

    num_accepted: torch.Tensor | None  # None: a plain step's (no drafts; every count 0)
    tokens: torch.Tensor | None  # None where the verdicts were made on the host
    nodes: torch.Tensor | None
    verdicts: list[Verdict] | None = None  # made on the host already (greedy chains on the CPU)

    def to_host(self) -> list[Verdict]:
        """The verdicts on the host, in the step's one device-to-host transfer."""
        if self.verdicts is not None:
            return self.verdicts
        if self.num_accepted is None:
            return [Verdict(0, [token], []) for token in self.tokens.reshape(-1).tolist()]
        batch, width = self.tokens.shape
        parts = [self.num_accepted, self.tokens.reshape(-1)]
        if self.nodes is not None:
            parts.append(self.nodes.reshape(-1))
        values = torch.cat(parts).tolist()
        if self.nodes is None:  # chains: a chain's accepted drafts are its first ones
            return [Verdict(n, values[row: row + n + 1], list(range(n)))
                    for n, row in zip(values[:batch], range(batch, batch + batch * width, width))]
        out = []
        for i, n in enumerate(values[:batch]):
            row = batch + i * width
            first = batch + batch * width + i * (width - 1)
            nodes = values[first: first + n] if n and values[first] >= 0 else list(range(n))
            out.append(Verdict(n, values[row: row + n + 1], nodes))
        return out


def _seq_rows(batch: StepBatch, indices: list[int]) -> list[int]:
    return [r for i in indices for r in range(batch.cu_num_rows[i], batch.cu_num_rows[i + 1])]


def _grammar_masked(seqs: list[Sequence], batch: StepBatch, processed: torch.Tensor,
                    indices: list[int]) -> torch.Tensor:
    """Every grammar row at the grammar's state after the output and the draft before it (no trees under a
    grammar), masked in one fill."""
    rows, blocked = [], []
    for i in indices:
        seq, (lo, hi) = seqs[i], batch.rows(i)
        draft = batch.drafts(i).tolist()
        for j in range(hi - lo):
            mask = seq.grammar.blocked(seq.output_ids + draft[:j])
            if mask is not None:  # a state outside the grammar, which verification never reaches
                rows.append(lo + j)
                blocked.append(mask)
    if not rows:
        return processed
    index = torch.tensor(rows, dtype=torch.long, device=processed.device)
    masked = processed.index_select(0, index).masked_fill(torch.stack(blocked).to(processed.device), float("-inf"))
    return processed.index_copy(0, index, masked)


def _biased(seqs: list[Sequence], batch: StepBatch, processed: torch.Tensor, indices: list[int]) -> torch.Tensor:
    rows, tokens, values = [], [], []
    for i in indices:
        bias = seqs[i].params.logit_bias
        for row in range(*batch.rows(i)):
            rows += [row] * len(bias)
            tokens += bias.keys()
            values += bias.values()
    return sampling.add_logit_bias(processed, rows, tokens, values)


def _penalized(seqs: list[Sequence], batch: StepBatch, processed: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Penalties of every penalised row: the row's sequence's committed history (its PenaltyTable row, all
    gathered in one index; the sequences of one step share the engine's table) plus the draft tokens on the path
    to the row (a chain's drafts before it, a tree row's ancestors), added in one scatter."""
    device = processed.device
    rows, table_rows, path_rows, path_tokens, settings = [], [], [], [], []
    for i in indices:
        seq, (lo, hi), tree = seqs[i], batch.rows(i), batch.trees[i]
        draft = batch.drafts(i).tolist()
        local = len(rows)
        rows += range(lo, hi)
        table_rows += [seq.penalties.row] * (hi - lo)
        params = seq.params
        settings += [(params.repetition_penalty, params.presence_penalty, params.frequency_penalty)] * (hi - lo)
        for r in range(1, hi - lo):
            path = range(r) if tree is None else tree.path_to(r - 1)
            path_rows += [local + r] * len(path)
            path_tokens += [draft[m] for m in path]
    tables = {id(seqs[i].penalties.table): seqs[i].penalties.table for i in indices}
    if len(tables) != 1:
        raise ValueError("the step's penalised sequences must share one PenaltyTable (the engine's)")
    table = next(iter(tables.values()))
    seen, base = table.gather(torch.tensor(table_rows, dtype=torch.long, device=device))
    counts = base
    if path_rows:
        where = torch.tensor([path_rows, path_tokens], dtype=torch.long).to(device)
        counts = base.index_put((where[0], where[1]), torch.ones(len(path_rows), device=device), accumulate=True)
        seen = seen | (counts > base)
    penalties = torch.tensor(settings, dtype=torch.float32).to(device)  # [R, 3]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    part = sampling.penalize(processed.index_select(0, index), seen, counts, penalties[:, :1], penalties[:, 1:2],
                             penalties[:, 2:])
    return processed.index_copy(0, index, part)


def reads_argmax_only(seq: Sequence) -> bool:
    """Whether verification reads nothing of seq's rows but their argmax: greedy, with nothing process_rows applies
    to them (a grammar, a logit bias, penalties). What process_rows comes to apply belongs here too."""
    return seq.params.greedy and seq.grammar is None and seq.penalties is None and not seq.params.logit_bias


def process_rows(seqs: list[Sequence], logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """The step's rows [num_rows, V] as verification reads them: each sequence's grammar mask, logit bias and
    penalties (row j at its history plus draft[:j]; a tree's row, its history plus the path to it), in that order
    (vLLM's); then the sampled sequences' rows as probabilities. Greedy rows stay (processed) logits."""
    grammar = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    biased = [i for i, seq in enumerate(seqs) if seq.params.logit_bias]
    penalized = [i for i, seq in enumerate(seqs) if seq.penalties is not None]
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    processed = logits
    if grammar or biased or penalized:
        processed = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if grammar:
        processed = _grammar_masked(seqs, batch, processed, grammar)
    if biased:
        processed = _biased(seqs, batch, processed, biased)
    if penalized:
        processed = _penalized(seqs, batch, processed, penalized)
    if sampled:
        index = torch.tensor(_seq_rows(batch, sampled), dtype=torch.long, device=processed.device)
        params = [seqs[i].params for i in sampled for _ in range(batch.num_rows_of(i))]
        processed = processed.index_copy(0, index, sampling.probs_rows(processed.index_select(0, index), params))
    return processed


def _seeded_draws(seqs: list[Sequence], batch: StepBatch, processed: torch.Tensor, indices: list[int],
                  target: torch.Tensor) -> torch.Tensor:
    """target [num_rows] with each seeded sequence's rows replaced by its noise-keyed draws: row r draws with the
    noise of the output position it predicts (a chain's row j: committed + j; a tree's row: committed + its
    depth), so the emitted tokens are plain seeded decoding's whatever was drafted."""
    vocab = processed.shape[-1]
    wanted, rows, noise = [], [], []
    for i in indices:
        seq, tree, (lo, hi) = seqs[i], batch.trees[i], batch.rows(i)
        depths = range(hi - lo) if tree is None else [0] + tree.depth_list
        wanted.append((seq, len(seq.output_ids), max(depths) + 1))
        rows += range(lo, hi)
    prefetch_log_noise(wanted, vocab)
    for i, (seq, first, _) in zip(indices, wanted):
        tree, (lo, hi) = batch.trees[i], batch.rows(i)
        depths = range(hi - lo) if tree is None else [0] + tree.depth_list
        noise += seq.noise_rows([first + d for d in depths])
    index = torch.tensor(rows, dtype=torch.long, device=processed.device)
    scores = sampling.scores_with_log_noise(processed.index_select(0, index), torch.stack(noise).to(processed.device))
    return target.index_copy(0, index, scores.argmax(-1))


def _relaxed_passes(seqs: list[Sequence], batch: StepBatch, processed: torch.Tensor, chains: list[int],
                    threshold: float) -> torch.Tensor:
    """LOSSY (SpeculativeConfig acceptance "relaxed"): [num_draft_tokens] whether each greedy or seeded chain's
    draft passes its relaxed test (greedy: p(x) >= threshold * the target's top probability; seeded: p(x) >=
    threshold * q(x)); False elsewhere (rejection sampling takes its own relaxed test)."""
    passes = torch.zeros(batch.draft_token_ids.numel(), dtype=torch.bool, device=processed.device)
    for i in chains:
        seq, (lo, hi), draft = seqs[i], batch.rows(i), batch.drafts(i)
        k = hi - lo - 1
        if k == 0 or not (seq.params.greedy or seq.noise_key is not None):
            continue
        if seq.params.greedy:
            ok = verify.relaxed_greedy_accepts(processed[lo:lo + k][None], draft[None], threshold)[0]
        else:
            q = batch.draft_probs[i]
            ok = verify.relaxed_accepts(processed[lo:lo + k][None], None if q is None else q[None], draft[None],
                                        threshold)[0]
        passes[batch.cu_num_draft_tokens[i]: batch.cu_num_draft_tokens[i + 1]] = ok
    return passes


def _rejection_sampled(seqs: list[Sequence], batch: StepBatch, processed: torch.Tensor, indices: list[int],
                       relaxed: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted, next_token) [len(indices)] of the unseeded sampled chains, in one
    verify.rejection_sample_rows: each sequence's uniforms (k_i, then one for its next token) drawn from its own
    generator, in rejection_sample's order."""
    device, dtype = processed.device, processed.dtype
    ks = [batch.num_draft_tokens[i] for i in indices]
    uniforms, draws, q_parts, q_starts, filled = [], [], [], [], 0
    for i, k in zip(indices, ks):
        generator = seqs[i].generator
        if k:
            uniforms.append(torch.rand(k, generator=generator, device=device, dtype=dtype))
        draws.append(torch.rand(1, generator=generator, device=device, dtype=torch.float64))
        q = batch.draft_probs[i]
        q_starts.append(filled if q is not None and k else -1)
        if q is not None and k:
            q_parts.append(q)
            filled += k
    layout = verify.chain_layout(ks, device, [batch.cu_num_rows[i] for i in indices],
                                 [batch.cu_num_draft_tokens[i] for i in indices], batch.draft_token_ids.numel())
    if layout.max_k:
        flat = torch.cat(uniforms) if uniforms else torch.ones(1, device=device, dtype=dtype)
        starts = verify.chain_layout(ks, device).draft_index  # the uniforms' own flat layout
        padded = torch.where(layout.valid, flat[starts.clamp(max=flat.numel() - 1)], 1.0)
    else:
        padded = torch.ones(len(indices), 0, device=device, dtype=dtype)
    draft_probs = torch.cat(q_parts) if q_parts else None
    prob_starts = torch.tensor(q_starts, dtype=torch.long).to(device) if q_parts else None
    return verify.rejection_sample_rows(processed, layout, batch.draft_token_ids, draft_probs, prob_starts, padded,
                                        torch.cat(draws), relaxed)


def _tree_rejection_sampled(seq: Sequence, batch: StepBatch, processed: torch.Tensor, i: int
                            ) -> verify_tree.TreeVerdict:
    """An unseeded sampled sequence's token tree by recursive rejection sampling (verify_tree), with its own
    generator."""
    (lo, hi), tree = batch.rows(i), batch.trees[i].to(processed.device)
    return verify_tree.tree_rejection_sample(tree, processed[lo:hi], batch.draft_probs[i], seq.generator)


# Whether verify_batch verifies a step of greedy chains on the CPU on the host (verify.greedy_accept_on_host);
# False: as tensors (verify.greedy_accept) wherever it runs (tests compare the two, and test the engine on each).
GREEDY_CHAINS_ON_HOST = True


def _greedy_chains_on_host(target: torch.Tensor, batch: StepBatch) -> StepVerdict:
    """A step of greedy chains whose rows are on the CPU, verified on the host: the target's tokens and the drafts
    read once, then verify.greedy_accept_on_host. (The tensor path's ~15 small operations took ~0.35 ms a step in
    the engine's loop at one sequence on a 2-core CPU, a twelfth of a SmolLM2 token; this, a few microseconds a
    sequence.)"""
    drafts = batch.draft_token_ids.tolist()
    cu_drafts = batch.cu_num_draft_tokens
    accepted = verify.greedy_accept_on_host(target.tolist(), drafts, batch.cu_num_rows, cu_drafts)
    return StepVerdict(None, None, None, [Verdict(n, drafts[first: first + n] + [token], list(range(n)))
                                          for (n, token), first in zip(accepted, cu_drafts)])


def verify_batch(seqs: list[Sequence], processed: torch.Tensor | None, batch: StepBatch,
                 relaxed_threshold: float | None = None, target: torch.Tensor | None = None,
                 on_host: bool | None = None) -> StepVerdict:
    """Every sequence of the step verified by the rule of its kind (the module docstring), as tensors.

    processed: [num_rows, V], process_rows' output. relaxed_threshold: the LOSSY relaxed acceptance's (chains
    only), None (exact) by default. target: [num_rows] each row's argmax where the runner gave it in place of the
    logits (Runner.forward_batch's argmax_only: every sequence greedy with nothing to process); processed is then
    None. on_host: whether a step of greedy chains on the CPU is verified on the host (_greedy_chains_on_host: the
    same verdicts); None: GREEDY_CHAINS_ON_HOST."""
    greedy = all(seq.params.greedy for seq in seqs)
    if target is None:
        target = sampling.argmax_rows(processed)  # the target's own token at every greedy row
    elif processed is not None or not greedy:
        raise ValueError("verify_batch: the target's argmax alone verifies greedy sequences only, with no logits")
    device = target.device
    size = batch.batch_size
    if batch.num_rows == size and greedy:  # plain greedy decoding: the argmax
        return StepVerdict(None, target[:, None], None)
    trees = batch.trees
    on_host = GREEDY_CHAINS_ON_HOST if on_host is None else on_host
    if on_host and greedy and relaxed_threshold is None and device.type == "cpu" and all(t is None for t in trees):
        return _greedy_chains_on_host(target, batch)
    matched = [seq.params.greedy or seq.noise_key is not None for seq in seqs]
    chains = [i for i in range(size) if trees[i] is None]
    chain_ks = [k if tree is None else 0 for k, tree in zip(batch.num_draft_tokens, trees)]
    layout = verify.chain_layout(chain_ks, device, batch.cu_num_rows[:-1], batch.cu_num_draft_tokens[:-1],
                                 batch.draft_token_ids.numel())
    # The target's own token at every row (greedy: argmax; seeded: its noise-keyed draws). Rows of rejection-
    # sampled sequences take part in the argmax and greedy_accept, but their results are replaced below.
    seeded = [i for i, seq in enumerate(seqs) if matched[i] and not seq.params.greedy]
    if seeded:
        target = _seeded_draws(seqs, batch, processed, seeded, target)
    passes = _relaxed_passes(seqs, batch, processed, chains, relaxed_threshold) \
        if relaxed_threshold is not None else None
    num_accepted, next_token = verify.greedy_accept(target, batch.draft_token_ids, chain_ks, passes, layout=layout)
    rejection = [i for i in chains if not matched[i]]
    if rejection:
        index = torch.tensor(rejection, dtype=torch.long, device=device)
        n, token = _rejection_sampled(seqs, batch, processed, rejection, relaxed_threshold)
        num_accepted = num_accepted.index_copy(0, index, n)
        next_token = next_token.index_copy(0, index, token)
    max_k = layout.max_k
    depth = max([max_k] + [tree.max_depth for tree in trees if tree is not None])
    width = depth + 1
    tokens = torch.full((size * width + 1,), -1, dtype=torch.long, device=device)  # the last slot: a sink
    sink = size * width
    if max_k:
        j = torch.arange(max_k, device=device)
        taken = layout.valid & (j < num_accepted[:, None])
        where = torch.where(taken, torch.arange(size, device=device)[:, None] * width + j, sink)
        tokens.scatter_(0, where.reshape(-1), batch.draft_token_ids.to(device)[layout.draft_index].reshape(-1))
    nodes = None
    if chains != list(range(size)):
        num_accepted, next_token, nodes = _verify_trees(seqs, batch, processed, target, matched, num_accepted,
                                                        next_token, tokens, width)
    tokens.scatter_(0, torch.arange(size, device=device) * width + num_accepted, next_token)
    return StepVerdict(num_accepted, tokens[:sink].reshape(size, width), nodes)


def _verify_trees(seqs: list[Sequence], batch: StepBatch, processed: torch.Tensor, target: torch.Tensor,
                  matched: list[bool], num_accepted: torch.Tensor, next_token: torch.Tensor, tokens: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's token trees: greedy and seeded ones matched together over their flattened nodes, sampled ones
    one by one; each accepted path's tokens written into `tokens` (flat [B * width + 1], by depth) and its node
    indices into the returned nodes [B, width - 1]. Returns (num_accepted, next_token, nodes)."""
    device = target.device
    size = batch.batch_size
    tree_rows = [i for i in range(size) if batch.trees[i] is not None]
    accepted_parts, owners = [], []
    matched_trees = [i for i in tree_rows if matched[i]]
    if matched_trees:
        flat = verify_tree.match_trees([batch.trees[i] for i in matched_trees],
                                       [batch.cu_num_rows[i] for i in matched_trees], target)
        index = torch.tensor(matched_trees, dtype=torch.long, device=device)
        num_accepted = num_accepted.index_copy(0, index, flat.num_accepted)
        next_token = next_token.index_copy(0, index, flat.next_token)
        accepted_parts.append(flat.accepted)
        owners += matched_trees
    for i in tree_rows:
        if not matched[i]:
            verdict = _tree_rejection_sampled(seqs[i], batch, processed, i)
            index = torch.tensor([i], dtype=torch.long, device=device)
            num_accepted = num_accepted.index_copy(0, index, verdict.num_accepted.reshape(1))
            next_token = next_token.index_copy(0, index, verdict.next_token.reshape(1).long())
            accepted_parts.append(verdict.accepted.reshape(-1))
            owners.append(i)
    # Each accepted node at its depth in its sequence's row of tokens and nodes (the rest into the sink slot).
    owner, depth, local, flat_index = [], [], [], []
    for i in owners:
        tree = batch.trees[i]
        owner += [i] * tree.num_nodes
        depth += tree.depth_list
        local += range(tree.num_nodes)
        flat_index += range(batch.cu_num_draft_tokens[i], batch.cu_num_draft_tokens[i + 1])
    host = torch.tensor([owner, depth, local, flat_index], dtype=torch.long).to(device)
    accepted = torch.cat(accepted_parts)
    sink = size * width
    tokens.scatter_(0, torch.where(accepted, host[0] * width + host[1] - 1, sink), batch.draft_token_ids.to(device)[host[3]])
    nodes = torch.full((size * (width - 1) + 1,), -1, dtype=torch.long, device=device)
    node_sink = size * (width - 1)
    nodes.scatter_(0, torch.where(accepted, host[0] * (width - 1) + host[1] - 1, node_sink), host[2])
    return num_accepted, next_token, nodes[:node_sink].reshape(size, width - 1)

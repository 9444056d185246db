"""`eagle`: a small head that drafts from the target's own hidden states (EAGLE, Li et al. 2024), scoring a
reduced vocabulary (FR-Spec, Zhao et al. 2025), and taking a long lookup match instead where the text copies.

The head: at position p it reads the target's final hidden state f_p (after the final norm: the output layer's
input) and the embedding of the next token x_{p+1}, fuses them with one linear layer (fc: [f; e] -> hidden),
runs ONE decoder layer of the target's family over them (with its own small KV cache), normalises, and gives
  - its estimate of the target's next hidden state f^_{p+1}, and
  - logits over the V' most frequent tokens (the rows of the target's output layer for those tokens).
Drafting K tokens after a verification step: the head first reads the committed positions it has not read
(real features from that step's target forward, which returns them at no extra cost), draws draft 1 from its
logits, then feeds (f^, draft) back K - 1 times. The head's cache keeps the positions read from real features
and drops the drafted ones at the next step (a rollback, as for any draft model).

Exactness: each draft is drawn from the head's distribution processed like the target's (penalties,
temperature, top-k/p, min-p) over the FULL vocabulary, zero outside the V' tokens; that q is what verification
divides by, and the target verifies over its whole vocabulary, so the output is the target's (greedy: the
argmax, and verification compares with the target's argmax). A seeded request draws with the target's position
noise, as draft models do.

Copying: where the suffix index of the request's text (drafts/suffix.py) has a confident match of at least
LOOKUP_MIN_TOKENS tokens, that lookup draft is taken instead of the head's (deterministic: q one-hot, exact;
suffix's lookup_else_model, as model_lookup). As for model_lookup, draft_kind says per step which source drafts
("lookup" or "model"), so adaptive K prices and rates them apart: copies measured at K = 4 had made the head's
K = 4 look cheap, and a request whose text the head could not draft went on drafting 4-5 tokens every few steps
(qa prompts at 0.7-0.8x plain decoding; benchmarks/RESULTS.md, session 36).

Trees (EAGLE-2, Li et al. 2024): with speculative_config "tree", the head grows a DynamicTree (drafts/trees.py)
instead: the root's and then each expanded node's top tokens are candidate children ranked by the product of
the head's probabilities along their path; each level is ONE head forward over every sequence's frontier, a
node's input fusing its parent's estimate f^ with its token, with tree attention in the head's cache
(models.base.TreeAttention). The children are DETERMINISTIC (a function of the context), so verification is
exact at every temperature with q one-hot (verify_tree).

Heads are written by `quickdraft distill` (tools/distill.py): head.safetensors (fc, the decoder layer, the
norm, and `vocab_ids`, the reduced vocabulary as target token ids) and config.json (the head's shape, the
target it was trained for, and the recipe). Heads for the packaged models ship in quickdraft/heads/.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quickdraft import sampling
from quickdraft.drafts.base import Proposal, Proposer, TreeBudget, spelling_argument
from quickdraft.drafts.suffix import LOOKUP_MIN_TOKENS, SuffixOptions, SuffixProposer, SuffixState, lookup_else_model
from quickdraft.drafts.trees import DynamicTree, grow_trees, ranks_on_part, tree_proposal
from quickdraft.errors import QuickdraftError
from quickdraft.models.linear import DenseLinear
from quickdraft.models.factory import native_runner
from quickdraft.models.weights import supports
from quickdraft.sequence import DraftState

SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"
HEAD_FILE, CONFIG_FILE = "head.safetensors", "config.json"
FORMAT_VERSION = 1


# --- the head -------------------------------------------------------------------------------------------------

def fingerprint(config) -> dict[str, Any]:
    """What a head must match in a target: its family and shape."""
    return {key: getattr(config, key, None) for key in
            ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")}


def head_config(target_config, vocab_size: int):
    """The config of a one-layer model of the target's family scoring `vocab_size` tokens: full attention,
    RoPE as the target's global layers, no tied embedding (the head reads embeddings from the target)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    config.vocab_size = vocab_size
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"]
    if getattr(config, "no_rope_layers", None):
        config.no_rope_layers = [1]
    config.use_cache = True
    config.pad_token_id = None  # the target's pad id may lie outside the head's (placeholder) embedding
    return config


class EagleHead(nn.Module):
    """fc over [feature; embedding], one decoder layer of the target's family, a norm, and the target's output
    rows for the reduced vocabulary (frozen). Trained by tools/distill.py; run by EagleProposer."""

    def __init__(self, target_config, vocab_ids: torch.Tensor, output_rows: torch.Tensor,
                 norm_weight: torch.Tensor | None = None):
        super().__init__()
        from transformers import AutoModelForCausalLM

        hidden = int(target_config.hidden_size)
        self.target_config = target_config
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        config = head_config(target_config, int(vocab_ids.numel()))
        self.decoder = AutoModelForCausalLM.from_config(config)
        inner = self.decoder.model
        # The head reads fused rows, never token ids: its own embedding table is a placeholder row.
        inner.embed_tokens.weight = nn.Parameter(torch.zeros(1, hidden), requires_grad=False)
        self.decoder.lm_head.weight = nn.Parameter(output_rows.float().clone(), requires_grad=False)
        if norm_weight is not None:
            with torch.no_grad():
                inner.norm.weight.copy_(norm_weight.float())
        self.register_buffer("vocab_ids", vocab_ids.long().clone(), persistent=False)
        self.softcap = getattr(target_config, "final_logit_softcapping", None) \
            if target_config.model_type.startswith("gemma3") else None

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Reduced-vocabulary logits of (estimated) features [..., hidden] -> [..., V']."""
        logits = self.decoder.lm_head(features)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, features: torch.Tensor, embeds: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced over whole sequences (training): features [B, T, hidden] (f_p) and embeds
        [B, T, hidden] (of x_{p+1}) -> (estimated next features f^_{p+1} [B, T, hidden], logits [B, T, V'])."""
        fused = self.fc(torch.cat([features, embeds], -1))
        out = self.decoder.model(inputs_embeds=fused, attention_mask=attention_mask, use_cache=False)
        estimate = out.last_hidden_state
        return estimate, self.logits(estimate)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The head's own parameters (not the target's output rows) and its vocabulary: what a head file holds."""
        # bf16, the precision the head runs in on bf16 targets: half the bytes of float32.
        state = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in self.named_parameters()
                 if p.requires_grad}
        state["vocab_ids"] = self.vocab_ids.cpu().to(torch.int32).contiguous()
        return state

    def save(self, directory: str | Path, recipe: dict[str, Any] | None = None) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.cpu() for k, v in self.trained_state().items()}
        save_file(state, str(directory / (HEAD_FILE + ".tmp")))
        (directory / (HEAD_FILE + ".tmp")).replace(directory / HEAD_FILE)
        config = {"format": FORMAT_VERSION, "target": fingerprint(self.target_config),
                  "draft_vocab_size": int(self.vocab_ids.numel()), "recipe": recipe or {}}
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def new_head(target, vocab_ids: torch.Tensor, seed: int = 0) -> EagleHead:
    """An untrained head for `target` (a Runner) over the reduced vocabulary `vocab_ids` (target token ids)."""
    torch.manual_seed(seed)
    return EagleHead(target.text_config, vocab_ids, target.output_rows(vocab_ids), target.final_norm_weight())


def read_head_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise QuickdraftError(f"{directory} is not an EAGLE head: it has no {CONFIG_FILE}; write one with "
                              "`quickdraft distill --model MODEL --out DIR`") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise QuickdraftError(f"cannot read the EAGLE head config {path}: {exc}") from None
    if config.get("format") != FORMAT_VERSION:
        raise QuickdraftError(f"the EAGLE head {directory} has format {config.get('format')!r}, this quickdraft "
                              f"reads format {FORMAT_VERSION}; re-run `quickdraft distill`")
    return config


def load_head(directory: str | Path, target) -> EagleHead:
    """The head saved in `directory`, checked against `target` (a Runner), with the target's output rows."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = read_head_config(directory)
    want = fingerprint(target.text_config)
    if config["target"] != want:
        raise QuickdraftError(f"the EAGLE head {directory} was trained for a target {config['target']}, not this "
                              f"one {want}; train one for it with `quickdraft distill`")
    try:
        state = load_file(str(directory / HEAD_FILE))
    except Exception as exc:  # a truncated or foreign file
        raise QuickdraftError(f"cannot read the EAGLE head weights {directory / HEAD_FILE}: {exc}") from None
    vocab_ids = state.pop("vocab_ids").long()
    state = {name: t.float() for name, t in state.items()}
    if vocab_ids.numel() == 0 or int(vocab_ids.max()) >= target.vocab_size or int(vocab_ids.min()) < 0:
        raise QuickdraftError(f"the EAGLE head {directory} has a vocabulary map outside the target's "
                              f"{target.vocab_size} tokens")
    head = EagleHead(target.text_config, vocab_ids, target.output_rows(vocab_ids))
    missing, unexpected = head.load_state_dict(state, strict=False)
    trained = {name for name, p in head.named_parameters() if p.requires_grad}
    if set(missing) & trained or unexpected:
        raise QuickdraftError(f"the EAGLE head {directory} does not fit this target's family: missing "
                              f"{sorted(set(missing) & trained)[:3]}, unexpected {sorted(unexpected)[:3]}")
    return head


def shipped_head(target) -> Path | None:
    """The packaged head trained for a target of this family and shape, if there is one."""
    want = fingerprint(target.text_config)
    for config_path in sorted(SHIPPED_HEADS.glob(f"*/{CONFIG_FILE}")):
        try:
            if json.loads(config_path.read_text()).get("target") == want:
                return config_path.parent
        except (OSError, json.JSONDecodeError):
            continue
    return None


# --- drafting -------------------------------------------------------------------------------------------------

@dataclass
class EagleOptions(SuffixOptions):
    """eagle_lookup: take the suffix lookup's draft instead of the head's where it has a confident match of at
    least LOOKUP_MIN_TOKENS tokens (the answer copies text), so eagle is not worse than lookups on copying;
    False: the head only.
    The suffix_decoding_* settings are that lookup's. (The head's directory is the common `model`: default, the
    head shipped for the target.)"""

    eagle_lookup: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.eagle_lookup, bool):
            raise QuickdraftError(f"eagle_lookup must be true or false, got {self.eagle_lookup!r}")


class EagleState(DraftState):
    """One request's head cache, the target features it has not read yet, and its suffix doc (None without
    eagle_lookup).

    cache: the head's KV cache; positions < `real` were read from the target's own features, later ones are
    drafts (dropped at the next step). feats: target features of positions feat_start.., kept from real - 1 on
    (the last one read stays, in case its row must be recomputed). The head's cache is not budgeted (kv_cache
    None: about 1/layers of the target's)."""

    __slots__ = ("cache", "real", "feat_start", "feats", "suffix", "observed")

    def __init__(self, cache, suffix: SuffixState | None):
        self.cache, self.real, self.feat_start, self.feats, self.suffix = cache, 0, 0, None, suffix
        # (start, features) the target gave since feats was last brought up to date (EagleProposer._settle): a step
        # that does not draft only appends its rows here, with no tensor work (most steps, where drafting does not
        # pay: a concatenation a step cost ~30 us in the engine's loop, 1% of a SmolLM2 token)
        self.observed: list[tuple[int, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        tensors = ([] if self.feats is None else [self.feats]) + [features for _, features in self.observed]
        return self.cache.nbytes + sum(t.numel() * t.element_size() for t in tensors)


class EagleProposer(Proposer):
    name = "eagle"
    options = EagleOptions
    spelling = "eagle[:HEAD_DIR]"
    runs_a_model = True
    uses_target_features = True
    proposes_trees = True

    def __init__(self, target, head: EagleHead, lookup: SuffixProposer | None = None, head_path: str | None = None):
        super().__init__()
        self.target = target
        self.head_path = head_path
        model = copy.deepcopy(head.decoder).to(device=target.device, dtype=target.dtype).eval()
        reason = supports(model)
        if reason:
            raise QuickdraftError(f"eagle: the head of this family cannot run natively ({reason})")
        self.runner = native_runner(model, name=f"{target.name}[eagle head]")
        self.fc = DenseLinear(head.fc.weight.detach().to(device=target.device, dtype=target.dtype).contiguous())
        self.vocab_ids = head.vocab_ids.to(target.device)  # [V'] target ids of the head's rows
        self.target_vocab_size = target.vocab_size
        self.hidden_size = head.hidden_size
        self.lookup = lookup

    @classmethod
    def parse_spelling(cls, draft: str) -> dict | None:
        head = spelling_argument(draft, "eagle")
        if head == "" and draft != "eagle":
            raise QuickdraftError(f"--draft {draft}: expected eagle:HEAD_DIR, e.g. eagle:heads/smollm2 (or plain "
                                  "eagle for the shipped head)")
        return None if head is None else {"model": head} if head else {}

    @classmethod
    def from_config(cls, config, context) -> "EagleProposer":
        target = context.target
        if config.model:
            path = Path(str(config.model))
        else:
            path = shipped_head(target)
            if path is None:
                raise QuickdraftError(
                    f"eagle: no EAGLE head ships for {context.target_name} "
                    f"({fingerprint(target.text_config)}); train one with `quickdraft distill --model "
                    f"{context.target_name} --out HEAD_DIR` and pass speculative_config['model'] = HEAD_DIR")
        head = load_head(path, target)
        lookup = SuffixProposer.from_options(config.options) if config.options.eagle_lookup else None
        return cls(target, head, lookup, str(path))

    @property
    def draft_runner(self):
        return None  # the head's one-layer cache is not budgeted (about 1/layers of the target's)

    def new_state(self, seq, suffix: SuffixState | None = None) -> EagleState:
        """A fresh head cache; `suffix`: the doc of a preempted sequence, which goes on."""
        if suffix is None and self.lookup is not None:
            suffix = self.lookup.new_state(seq)
        return EagleState(self.runner.new_cache(), suffix)

    def release(self, seq, preempted: bool = False) -> None:
        state = seq.draft_state
        if preempted:
            seq.draft_state = self.new_state(seq, state.suffix)
            return
        if state.suffix is not None:
            self.lookup.finish(state.suffix, seq)
        seq.draft_state = None

    def _copy(self, seq) -> list[int]:
        """The suffix lookup's draft for seq's history now where it is confident (empty: the head drafts), looked
        up once a step."""
        suffix = seq.draft_state.suffix
        if suffix is None:
            return []
        draft = self.lookup.drafted(suffix, seq)
        return draft if len(draft) >= LOOKUP_MIN_TOKENS else []

    def prepare(self, seqs) -> None:
        if self.lookup is not None:
            for seq in seqs:
                self._copy(seq)

    def draft_kind(self, seq) -> str:
        return "lookup" if self._copy(seq) else "model"

    def max_draft_tokens(self, seq) -> int:
        draft = self._copy(seq)
        return len(draft) if draft else self.runner.max_len - len(seq.token_ids) + 1

    # Observed chunks kept apart at most this many steps (views of their steps' hidden states, which they keep).
    MAX_OBSERVED = 32

    def observe(self, seq, start: int, features: torch.Tensor) -> None:
        state = seq.draft_state
        if features.shape[0] == 0:
            return
        state.observed.append((start, features.detach()))
        state.real = min(state.real, start)
        if len(state.observed) >= self.MAX_OBSERVED:
            self._settle(state)

    @staticmethod
    def _settle(state: EagleState) -> None:
        """Bring state.feats up to date with the chunks observed since, in one concatenation: each chunk replaces
        the features from its start on (a rerun after a rollback), zeros filling positions the target did not
        compute (a reused prefix: the head reads zeros there)."""
        if not state.observed:
            return
        parts = [] if state.feats is None else [state.feats]
        start0, length = state.feat_start, (0 if state.feats is None else state.feats.shape[0])
        for start, features in state.observed:
            if not parts or start < start0:
                parts, start0, length = [features], start, features.shape[0]
                continue
            offset = start - start0
            if offset < length:  # from `offset` on, the chunk's
                parts, length = [torch.cat(parts)[:offset]], offset
            elif offset > length:
                parts.append(features.new_zeros(offset - length, features.shape[1]))
                length = offset
            parts.append(features)
            length += features.shape[0]
        state.feats = parts[0] if len(parts) == 1 else torch.cat(parts)
        state.feat_start = start0
        state.observed = []

    def _features(self, state: EagleState, first: int, last: int) -> torch.Tensor:
        """Target features of positions first..last-1 [n, hidden] (zeros where none was observed)."""
        self._settle(state)
        out = torch.zeros(last - first, self.hidden_size, dtype=self.runner.dtype, device=self.runner.device)
        if state.feats is not None:
            lo, hi = max(first, state.feat_start), min(last, state.feat_start + state.feats.shape[0])
            if hi > lo:
                out[lo - first: hi - first] = state.feats[lo - state.feat_start: hi - state.feat_start]
        return out

    def _fuse(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fc([f; e(x)]) for rows of features [n, hidden] and next tokens [n] -> [n, hidden]."""
        embeds = self.target.embed_rows(tokens).to(device=features.device, dtype=features.dtype)
        return self.fc(torch.cat([features, embeds], -1).contiguous())

    def _draw(self, seq, logits: torch.Tensor, pending: torch.Tensor, i: int):
        """One draft token from the head's logits [V'] at draft position i, and its processed full-vocabulary
        distribution q [V] (None where verification needs none: greedy, or a seeded draw verified exactly)."""
        if seq.params.greedy and seq.penalties is None and seq.params.logit_bias is None and seq.grammar is None:
            return self.vocab_ids[logits.argmax()].reshape(1), None
        full = torch.full((1, self.target_vocab_size), float("-inf"), device=seq.device)
        full[0, self.vocab_ids.to(seq.device)] = logits.to(seq.device).float()
        processed = seq.process(full, pending, first_row=i)  # [1, V]
        q = processed[0] if seq.needs_draft_probs else None
        if seq.noise_key is not None:
            log_noise = seq.log_noise(len(seq.output_ids) + i, 1, processed.shape[-1])
            return sampling.scores_with_log_noise(processed, log_noise).argmax(-1), q
        token = sampling.sample(processed, seq.params, seq.generator)
        return token.reshape(1), q

    def propose(self, seq, k: int) -> Proposal:
        return self.propose_batch([seq], [k])[0]

    @torch.inference_mode()
    def propose_batch(self, seqs, ks: list[int]) -> list[Proposal]:
        return lookup_else_model(seqs, ks, lambda j: self._copy(seqs[j]),
                                 lambda heads: self._propose_by_head(seqs, ks, heads))[0]

    @torch.inference_mode()
    def propose_tree_batch(self, seqs, budgets: list[TreeBudget]) -> list[Proposal]:
        """A confident copy where the suffix index has one (a chain), else the head's EAGLE-2 tree within each
        budget (module docstring); a grammar-constrained sequence drafts a chain."""
        depth = [min(b.max_nodes, b.max_depth, self.max_draft_tokens(seq)) if b.max_nodes > 0 else 0
                 for seq, b in zip(seqs, budgets)]
        chains = [j for j, seq in enumerate(seqs) if depth[j] > 0 and seq.grammar is not None]
        out = [Proposal.empty(seq.device) for seq in seqs]
        if chains:
            for j, proposal in zip(chains, self.propose_batch([seqs[j] for j in chains], [depth[j] for j in chains])):
                out[j] = proposal
        grown_ks = [0 if j in chains else d for j, d in enumerate(depth)]
        made, _ = lookup_else_model(seqs, grown_ks, lambda j: self._copy(seqs[j]),
                                    lambda heads: self._tree_by_head(seqs, depth, budgets, heads))
        return [made[j] if grown_ks[j] > 0 else out[j] for j in range(len(seqs))]

    def _read_committed(self, seqs, heads: list[int]):
        """The head's first forward of a step: each sequence in `heads` reads the committed positions its cache
        lacks (position p pairs f_p with x_{p+1}, p < len - 1). Returns the logits of its last row [m, V'], its
        estimate f^ of the next position [m, hidden], and each sequence's catch-up."""
        caches, token_rows, inputs, catch_ups = [], [], [], {}
        for j in heads:
            seq, state = seqs[j], seqs[j].draft_state
            ids = seq.token_ids
            last = len(ids) - 1  # positions first..last-1 are read now (the engine drafts only after the prompt)
            first = min(state.real, len(state.cache), last)
            if first == last:  # nothing new since the last read: recompute the last position for its output
                first -= 1
            state.cache.rollback(first)  # drop the drafted positions (and any not read from real features)
            tokens = torch.tensor(ids[first + 1: last + 1], dtype=torch.long, device=self.runner.device)
            caches.append(state.cache)
            token_rows.append(tokens)
            inputs.append(self._fuse(self._features(state, first, last), tokens))
            catch_ups[j] = max(0, last - first - 2)  # a step reads the bonus and maybe its last draft
        logits, hidden = self.runner.forward_batch(caches, token_rows, [1] * len(heads), inputs_embeds=inputs,
                                                   return_hidden=True)  # [m, V'], [sum rows, hidden]
        self.forwards += 1
        ends, row = [], 0
        for tokens in token_rows:
            row += int(tokens.numel())
            ends.append(row - 1)
        for j in heads:  # the features read; keep the last one
            state = seqs[j].draft_state
            state.real = len(state.cache)
            if state.feats is not None and state.real - 1 > state.feat_start:
                cut = min(state.real - 1 - state.feat_start, state.feats.shape[0])
                state.feats, state.feat_start = state.feats[cut:], state.feat_start + cut
        return logits, hidden[ends], catch_ups

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits over its V' tokens [n, V'] as target-vocabulary logits [n, V] (-inf elsewhere)."""
        full = torch.full((logits.shape[0], self.target_vocab_size), float("-inf"), device=logits.device)
        full[:, self.vocab_ids.to(logits.device)] = logits.float()
        return full

    def _tree_by_head(self, seqs, depth: list[int], budgets: list[TreeBudget], heads: list[int]) -> list[Proposal]:
        """The head's EAGLE-2 trees for seqs[j], j in heads: level 0 reads the committed positions and ranks the
        root's children; level d feeds the depth-d frontier (each node fused with its parent's estimate) as tree
        rows and ranks their children; one head forward per level over all sequences."""
        logits, estimates, catch_ups = self._read_committed(seqs, heads)
        caches = {j: seqs[j].draft_state.cache for j in heads}
        trees = {j: DynamicTree(len(caches[j]), budgets[j].max_nodes, depth[j], self.runner.max_len - len(caches[j]),
                                min_chance=budgets[j].min_chance) for j in heads}
        estimate_of = {j: {-1: estimates[row]} for row, j in enumerate(heads)}  # node -> f^ after its path
        # Ranked on the head's own V' tokens where the requests allow (a top-k and logsumexp over 49,152 tokens a
        # row were 1.6 ms of an 8-node tree's step on SmolLM2, profiled), else on full-vocabulary rows.
        on_part = all(ranks_on_part(seqs[j]) for j in heads)

        def ranked_rows(head_logits: torch.Tensor) -> torch.Tensor:
            return head_logits if on_part else self._full_logits(head_logits)

        def forward_level(rows: list[int]) -> torch.Tensor:  # the frontiers, fused with their parents' f^
            tokens, inputs = [], []
            for j in rows:
                tree = trees[j]
                ids = torch.tensor([tree.tokens[n] for n in tree.frontier], dtype=torch.long, device=self.runner.device)
                tokens.append(ids)
                inputs.append(self._fuse(torch.stack([estimate_of[j][tree.parents[n]] for n in tree.frontier]), ids))
            logits, hidden = self.runner.forward_batch([caches[j] for j in rows], tokens, [len(t) for t in tokens],
                                                       inputs_embeds=inputs, return_hidden=True,
                                                       trees=[trees[j].attention() for j in rows])
            self.forwards += 1
            row = 0
            for j in rows:  # each frontier node's estimate of the position after it
                for n in trees[j].frontier:
                    estimate_of[j][n] = hidden[row]
                    row += 1
            return ranked_rows(logits)

        grow_trees(seqs, trees, ranked_rows(logits), max(depth[j] for j in heads), forward_level,
                   self.vocab_ids if on_part else None, self.target_vocab_size)
        out = []
        for j in heads:
            caches[j].rollback(trees[j].base)  # the committed positions: the tree's slots are no path
            out.append(tree_proposal(trees[j], seqs[j].device, catch_ups[j]))
        return out

    def _propose_by_head(self, seqs, ks: list[int], heads: list[int]) -> list[Proposal]:
        """The head's proposals for seqs[j], j in heads (each ks[j] > 0)."""
        logits, estimates, catch_ups = self._read_committed(seqs, heads)

        drafts = {j: torch.empty(ks[j], dtype=torch.long, device=seqs[j].device) for j in heads}
        probs = {j: None for j in heads}
        rows = list(heads)
        for i in range(max(ks[j] for j in heads)):
            new_tokens = []
            for r, j in enumerate(rows):
                seq = seqs[j]
                token, q = self._draw(seq, logits[r], drafts[j][:i], i)
                drafts[j][i] = token[0]
                if q is not None:
                    if probs[j] is None:
                        probs[j] = torch.zeros(ks[j], self.target_vocab_size, device=seq.device)
                    probs[j][i] = q
                new_tokens.append(token.to(self.runner.device))
            keep = [r for r, j in enumerate(rows) if ks[j] > i + 1]
            if not keep:
                break
            tokens = [new_tokens[r] for r in keep]
            inputs = [self._fuse(estimates[r: r + 1], tokens[n]) for n, r in enumerate(keep)]
            rows = [rows[r] for r in keep]
            logits, hidden = self.runner.forward_batch([seqs[j].draft_state.cache for j in rows], tokens,
                                                       [1] * len(rows), inputs_embeds=inputs, return_hidden=True)
            self.forwards += 1
            estimates = hidden
        return [Proposal(drafts[j], probs[j], catch_ups[j]) for j in heads]

"""`draft_model`: a smaller model proposes K tokens autoregressively (one with another tokenizer drafts over the
vocabularies' intersection: drafts/cross_vocab.py).

Each draft token is drawn from the draft's distribution processed exactly like the target's (same
penalties with the same history, temperature, top-k/p, min-p); that processed q is what verification
divides by. Under greedy decoding the draft takes its argmax and verification needs no q. A seeded request
draws with the target's position noise (sampling.position_noise), which couples the draft's draw with the
target's: they agree wherever the two distributions put their mass alike."""

from __future__ import annotations

import torch

from quickdraft import sampling
from quickdraft.drafts.base import Proposal, Proposer
from quickdraft.errors import TokenizerMismatchError
from quickdraft.models.base import Runner


def same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> bool:
    """True when the draft reads and writes the target's token ids (the same vocabulary, or neither model has a
    tokenizer: token-id models are taken to share ids); False when both have tokenizers that differ (the draft
    then drafts over the intersection, drafts/cross_vocab.py). A draft whose tokenizer cannot be compared with
    the target's (only one of them has one) is refused."""
    if target_tokenizer is None and draft_tokenizer is None:
        return True
    if target_tokenizer is None or draft_tokenizer is None:
        raise TokenizerMismatchError(
            f"cannot tell whether draft '{draft_name}' shares the tokenizer of target '{target_name}': only one of "
            "them has a tokenizer; pass the other's (LLM(tokenizer=...) or speculative_config['tokenizer']), or "
            "use method ngram, suffix or layer_skip")
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


class DraftModelProposer(Proposer):
    name = "draft_model"
    spelling = "a draft MODEL"
    runs_a_model = True

    def __init__(self, runner: Runner, target_vocab_size: int):
        super().__init__()
        self.runner = runner
        self.target_vocab_size = target_vocab_size

    @property
    def draft_runner(self) -> Runner:
        return self.runner

    def new_state(self, seq):
        return self.runner.new_cache()

    @classmethod
    def from_config(cls, config, context) -> "DraftModelProposer":
        draft = context.load_draft_model(config.model, config.tokenizer)
        runner = draft.runner.quantized(config.quantization) if config.quantization else draft.runner
        if same_vocabulary(context.target_tokenizer, draft.tokenizer, context.target_name, draft.name):
            return cls(runner, context.target.vocab_size)
        # Another tokenizer: drafting over the vocabularies' intersection keeps verification exact.
        from quickdraft.drafts.cross_vocab import CrossVocabDraftProposer, VocabMapping

        mapping = VocabMapping(context.target_tokenizer, draft.tokenizer, context.target.vocab_size,
                               draft.runner.vocab_size)
        return CrossVocabDraftProposer(runner, context.target.vocab_size, mapping)

    def max_draft_tokens(self, seq) -> int:
        # Drafting k tokens feeds the history and k - 1 drafts through the draft model.
        return self.runner.max_len - len(self.draft_history(seq)) + 1

    def _to_draft_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids the draft proposed -> the draft's ids, to feed back (the same ids here)."""
        return tokens

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # Vocabularies that differ only by padding rows: drop the draft's extra rows, or give the target's
        # extra (padding) ids zero draft probability.
        extra = self.target_vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.target_vocab_size]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits

    def propose(self, seq, k: int) -> Proposal:
        return self.propose_batch([seq], [k])[0]

    def propose_batch(self, seqs, ks: list[int]) -> list[Proposal]:
        """k_i tokens for each sequence, autoregressively: draft position i is ONE batched draft forward over
        every sequence still drafting (the first also reads what each draft cache lacks of its history)."""
        active = [j for j, k in enumerate(ks) if k > 0]
        feeds, catch_ups, tokens, probs = {}, {}, {}, {}
        for j in active:
            seq, cache, history = seqs[j], seqs[j].draft_state, self.draft_history(seqs[j])
            start = cache.sync(history)
            if start == len(history):  # everything is cached: recompute the last position for its logits
                start -= 1
                cache.rollback(start)
            catch_ups[j] = max(0, len(history) - start - 2)  # a step reads the bonus and maybe its last draft
            feeds[j] = torch.tensor(history[start:], dtype=torch.long, device=self.runner.device)
            tokens[j] = torch.empty(ks[j], dtype=torch.long, device=seq.device)
            probs[j] = torch.empty(ks[j], self.target_vocab_size, device=seq.device) if seq.needs_draft_probs \
                else None
        for i in range(max(ks, default=0)):
            rows = [j for j in active if ks[j] > i]
            logits = self.runner.forward_batch([seqs[j].draft_state for j in rows], [feeds[j] for j in rows],
                                               [1] * len(rows))  # [len(rows), V_draft]
            logits = self._to_target_vocab(logits)
            self.forwards += 1
            for row, j in enumerate(rows):
                seq = seqs[j]
                processed = seq.process(logits[row: row + 1].to(seq.device), tokens[j][:i], first_row=i)
                if seq.noise_key is not None:
                    log_noise = seq.log_noise(len(seq.output_ids) + i, 1, processed.shape[-1])
                    token = sampling.scores_with_log_noise(processed, log_noise).argmax(-1)
                else:
                    token = sampling.sample(processed, seq.params, seq.generator)
                tokens[j][i] = token[0]
                if probs[j] is not None:
                    probs[j][i] = processed[0]
                feeds[j] = self._to_draft_tokens(token.reshape(1)).to(self.runner.device)
        return [Proposal(tokens[j], probs[j], catch_ups[j]) if ks[j] > 0 else Proposal.empty(seqs[j].device)
                for j in range(len(seqs))]

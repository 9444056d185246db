"""`draft_model`: a smaller model sharing the target's tokenizer proposes K tokens autoregressively.

Each draft token is drawn from the draft's distribution processed exactly like the target's (same
penalties with the same history, temperature, top-k/p, min-p); that processed q is what verification
divides by. Under greedy decoding the draft takes its argmax and verification needs no q. A seeded request
draws with the target's position noise (sampling.position_noise), which couples the draft's draw with the
target's: they agree wherever the two distributions put their mass alike."""

from __future__ import annotations

import torch

from quickdraft import sampling
from quickdraft.drafts.base import Proposal, Proposer
from quickdraft.models.runner import HFRunner


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, runner: HFRunner, target_vocab_size: int):
        super().__init__()
        self.runner = runner
        self.target_vocab_size = target_vocab_size

    def new_state(self, seq):
        return self.runner.new_cache()

    def max_draft_tokens(self, seq) -> int:
        # Drafting k tokens feeds the history and k - 1 drafts through the draft model.
        return self.runner.max_len - len(seq.token_ids) + 1

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
        cache = seq.draft_state
        history = seq.token_ids
        start = cache.sync(history)
        if start == len(history):  # everything is cached: recompute the last position for its logits
            start -= 1
            cache.rollback(start)
        catch_up = max(0, len(history) - start - 2)  # in step, the draft reads the bonus and maybe its last draft
        feed = torch.tensor(history[start:], dtype=torch.long, device=self.runner.device)
        tokens = torch.empty(k, dtype=torch.long, device=seq.device)
        coupled = seq.noise_key is not None  # draw with the target's position noise: no q needed
        probs = None if seq.params.greedy or coupled else torch.empty(k, self.target_vocab_size, device=seq.device)
        for i in range(k):
            logits = self._to_target_vocab(self.runner.forward(cache, feed)).to(seq.device)
            self.forwards += 1
            processed = seq.process(logits, tokens[:i], first_row=i)
            if coupled:
                noise = sampling.position_noise(seq.noise_key, len(seq.output_ids) + i, 1, processed.shape[-1],
                                                processed.device)
                token = sampling.sample_with_noise(processed, noise)
            else:
                token = sampling.sample(processed, seq.params, seq.generator)
            tokens[i] = token[0]
            if probs is not None:
                probs[i] = processed[0]
            feed = token
        return Proposal(tokens, probs, catch_up)

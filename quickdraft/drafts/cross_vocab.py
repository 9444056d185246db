"""A draft model with another tokenizer than the target's is a DraftModelProposer with an IntersectionMapping
(drafts/vocab_mapping.py, which explains why it is lossless). The names this module gave them, kept for callers."""

from quickdraft.drafts.draft_model import DraftModelProposer as CrossVocabDraftProposer
from quickdraft.drafts.vocab_mapping import IntersectionMapping as VocabMapping

__all__ = ["CrossVocabDraftProposer", "VocabMapping"]

"""A draft model with another tokenizer (drafts/vocab_mapping.py, Token-Level Intersection): the byte tables of the
three tokenizer styles, the intersection and the translation of the target's tokens, and exactness: the joint
law of 5 sampled tokens (tests/test_law.py's test, same thresholds) with a draft whose vocabulary is a
different, partly overlapping set of pieces in another order, and greedy output equal to plain output."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import assert_greedy_equals_plain, tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.drafts.draft_model import DraftModelProposer
from quickdraft.drafts.vocab_mapping import IntersectionMapping
from quickdraft.token_bytes import token_bytes
from quickdraft.errors import QuickdraftError, TokenizerMismatchError

pytestmark = pytest.mark.usefixtures("one_thread")

# The target of tests/test_law.py has 4 tokens; these are its pieces. The draft (5 tokens) has a, b and ab too,
# at other ids, lacks c, and has d and ba, which the target lacks: the intersection is {a, b, ab}.
TARGET_PIECES = ["a", "b", "c", "ab"]
DRAFT_PIECES = ["b", "ba", "ab", "d", "a"]


def piece_tokenizer(pieces: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer whose tokens are the given pieces (multi-letter pieces by BPE merges of their letters)."""
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [(p[0], p[1:]) for p in pieces if len(p) > 1]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=merges)))


def test_piece_tokenizers_intersect_by_text():
    mapping = IntersectionMapping(piece_tokenizer(TARGET_PIECES), piece_tokenizer(DRAFT_PIECES), 4, 5)
    pairs = sorted(zip(mapping.target_ids.tolist(), mapping.draft_ids.tolist()))
    assert pairs == [(0, 4), (1, 0), (3, 2)]  # a, b, ab
    assert mapping.target_to_draft.tolist() == [4, 0, -1, 2]
    # c is not a draft token: the draft reads nothing for it (no draft token covers its bytes).
    assert [mapping.translate(t) for t in range(4)] == [(4,), (0,), (), (2,)]
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])  # draft logits by draft id
    assert mapping.to_target_logits(logits).tolist() == [[4.0, 0.0, float("-inf"), 2.0]]


def _byte_level(vocab: dict[str, int]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _metaspace(vocab: dict[str, int]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_byte_tables_of_byte_level_and_sentencepiece_styles():
    """'Ġthe' (byte-level BPE), '▁the' (SentencePiece) stand for ' the'; 'Ã©' for é's two bytes; <0xC3> for one
    byte; special tokens stand for no text and map to the other's special token of the same name."""
    byte_level = _byte_level({"\u0120the": 0, "caf": 1, "\u00c3\u00a9": 2, "\u00c3": 3, "\u00a9": 4, "x": 5})
    byte_level.add_special_tokens({"eos_token": "<eos>"})
    spm = _metaspace({"<0xC3>": 0, "<0xA9>": 1, "\u2581the": 2, "caf": 3, "é": 4, "<unk>": 5, "y": 6})
    spm.add_special_tokens({"eos_token": "<eos>", "bos_token": "<bos>"})
    table, fallback, special = token_bytes(byte_level)
    assert table[0] == b" the" and table[2] == "é".encode() and table[3] == b"\xc3" and special == {"<eos>": 6}
    table, fallback, special = token_bytes(spm)
    assert table[2] == b" the" and table[0] == b"\xc3" and fallback == {0, 1} and table[4] == "é".encode()
    assert set(special) == {"<eos>", "<bos>"}

    mapping = IntersectionMapping(spm, byte_level, len(spm), len(byte_level))
    by_target = dict(zip(mapping.target_ids.tolist(), mapping.draft_ids.tolist()))
    # ' the', 'caf', 'é' in both; the target's byte token <0xC3> and the draft's single byte 'Ã' are one byte
    # each: in the intersection too.
    assert by_target[2] == 0 and by_target[3] == 1 and by_target[4] == 2 and by_target[0] == 3 and by_target[1] == 4
    assert 6 not in by_target  # 'y' is not a draft token
    eos_target, eos_draft = spm.convert_tokens_to_ids("<eos>"), byte_level.convert_tokens_to_ids("<eos>")
    assert mapping.translate(eos_target) == (eos_draft,)
    assert mapping.translate(spm.convert_tokens_to_ids("<bos>")) == ()  # the draft has no <bos>


def test_tokenizers_with_nothing_in_common_are_refused():
    with pytest.raises(QuickdraftError, match="share no token"):
        IntersectionMapping(piece_tokenizer(["a", "b"]), piece_tokenizer(["c", "d"]), 2, 2)


def _cross_vocab_llm(seed_draft: int = 5, k: int = 3, **config) -> LLM:
    from test_law import VOCAB, _models

    target, _ = _models()
    draft = tiny_llama(seed=seed_draft, vocab_size=len(DRAFT_PIECES), layers=2)
    assert target.config.vocab_size == VOCAB == len(TARGET_PIECES)
    return LLM(target, tokenizer=piece_tokenizer(TARGET_PIECES), dtype="float32", device="cpu",
               speculative_config={"method": "draft_model", "model": draft, "tokenizer": piece_tokenizer(DRAFT_PIECES),
                                   "num_speculative_tokens": k, "adaptive": False, **config})


def test_a_draft_object_needs_its_tokenizer_when_the_target_has_one():
    from test_law import _models

    with pytest.raises(TokenizerMismatchError, match="only one of them has a tokenizer"):
        LLM(_models()[0], tokenizer=piece_tokenizer(TARGET_PIECES), dtype="float32", device="cpu",
            speculative_config={"model": tiny_llama(seed=5, vocab_size=5, layers=2)})


@pytest.mark.parametrize("setting,seeding", [("t1.3-penalties-topk-topp-minp", "rejection"), ("t0.7", "request-seed")])
def test_five_tokens_drafted_over_the_intersection_follow_the_target_law(setting, seeding):
    """tests/test_law.py's exact-law test (8 chi-square statistics at 1.25e-5 each, 1100 samples of 5 tokens, K=3
    fixed) with the cross-vocabulary draft: its q is zero on the target's token c, and its context reads the
    target's tokens translated (c as nothing)."""
    from test_law import N, REQUEST_SEED, SETTINGS, T, _sample_rejection, _setup, assert_follows_law

    prompt, _, law, test = _setup("draft_model", setting)
    llm = _cross_vocab_llm()
    assert isinstance(llm.proposer, DraftModelProposer) and llm.proposer.mapping.size == 3
    n = N["draft_model"]
    params = SETTINGS[setting]
    if seeding == "rejection":
        samples, metrics, steps = _sample_rejection(llm, n, prompt, SamplingParams(max_tokens=T, **params))
        assert steps.get((3, 3), 0) >= 5 and steps.get((3, 1), 0) >= 5, steps
    else:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=n, max_tokens=T, seed=REQUEST_SEED, **params))[0]
        samples, metrics, steps = [tuple(c.token_ids) for c in out.outputs], [out.metrics], None
    assert_follows_law(test, samples, metrics, steps, n, f"{seeding} cross-vocab {setting}")
    # The draft never proposed the target's token c (2): it is outside the intersection.
    assert all(not m.lossy for m in metrics)


def test_greedy_output_is_plain_output_at_any_batch_size():
    from test_law import _models

    llm = _cross_vocab_llm(k=4)
    plain = LLM(_models()[0], dtype="float32", device="cpu")
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 0, 1, 2], [0, 3, 3, 1], [2, 2, 2], [3, 0, 1, 0, 3, 1, 2])]
    assert_greedy_equals_plain(llm, plain, prompts, SamplingParams(temperature=0, max_tokens=24))
    # The draft's cache holds draft tokens: its length follows the translated history, not the target's.
    seq = llm.engine.new_sequence([2, 0, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    assert llm.proposer.draft_history(seq) == [4, 2]  # c, a, c, ab -> a, ab


def test_under_a_kv_budget_the_draft_reserves_its_own_length():
    """Prefix caching leaves the draft's cache out (its positions are not the target's), and a tight budget with
    preemption still gives plain greedy output."""
    from test_law import _models

    llm = LLM(_models()[0], tokenizer=piece_tokenizer(TARGET_PIECES), dtype="float32", device="cpu",
              kv_cache_memory=60_000, enable_prefix_caching=True,
              speculative_config={"model": tiny_llama(seed=5, vocab_size=5, layers=2),
                                  "tokenizer": piece_tokenizer(DRAFT_PIECES), "num_speculative_tokens": 3})
    assert llm.kv_memory.prefix_caches[1] is None
    plain = LLM(_models()[0], dtype="float32", device="cpu")
    prompts = [{"prompt_token_ids": [i % 4, (i + 1) % 4, 3, 0, 1] * 3} for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=40)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]


def _aa_llm(blocks: int, seed: int = 2) -> LLM:
    """Target pieces [a, b, aa, bb] (the seed-2 target repeats aa under greedy decoding), draft pieces [a, b]:
    every target aa is two draft tokens, so the draft's cache grows twice as fast as the target's."""
    target = tiny_llama(seed=seed, vocab_size=4, layers=2)
    per_token = LLM(target, dtype="float32", device="cpu").kv_cache_estimate()["bytes_per_token"] * 2
    return LLM(target, tokenizer=piece_tokenizer(["a", "b", "aa", "bb"]), dtype="float32", device="cpu",
               kv_cache_memory=blocks * 16 * per_token,
               speculative_config={"model": tiny_llama(seed=5, vocab_size=2, layers=2),
                                   "tokenizer": piece_tokenizer(["a", "b"]), "num_speculative_tokens": 3})


def test_a_prompt_the_draft_reads_longer_is_refused_at_once_when_it_cannot_fit():
    """30 target tokens aa are 60 draft tokens: counted by the target's length (43 + 43 positions, 3 blocks) the
    request passed the check and then could never be reserved, and generate looped forever."""
    llm = _aa_llm(blocks=3)
    with pytest.raises(QuickdraftError, match="cannot fit in the KV cache budget.*60 of its own tokens"):
        llm.generate({"prompt_token_ids": [2] * 30}, SamplingParams(temperature=0, max_tokens=10))
    out = llm.generate({"prompt_token_ids": [2] * 8}, SamplingParams(temperature=0, max_tokens=4))  # still serves
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_draft_that_outgrows_the_budget_ends_its_request_instead_of_spinning():
    """The check counts a draft's generated part one draft token per target token; this target generates aa
    (two draft tokens each), so the request passes the check (4 blocks) but needs 5 later. The scheduler's
    no-progress guard ends it with an error instead of preempting and re-admitting it forever."""
    llm = _aa_llm(blocks=4)
    scheduler = llm.new_scheduler()
    scheduler.add_request("r", [0] * 20, SamplingParams(temperature=0, max_tokens=30))
    with pytest.raises(QuickdraftError, match="'r' can make no progress"):
        for _ in range(200):
            scheduler.step()
    assert not scheduler.has_unfinished() and scheduler.pool.used_bytes == 0
    with pytest.raises(QuickdraftError, match="can make no progress"):  # the same through generate: no hang
        llm.generate({"prompt_token_ids": [0] * 20}, SamplingParams(temperature=0, max_tokens=30))

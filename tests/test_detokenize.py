"""Incremental detokenization with stop strings: a step that commits several tokens at once (speculative
decoding) must give the text, kept tokens and finish reason that one token per step gives."""

import itertools
import random

import pytest

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.detokenize import Detokenizer
from quickdraft.errors import QuickdraftError

# Token id -> bytes; 20.. are the UTF-8 bytes of "é" (2 bytes) and "😀" (4 bytes), one byte a token.
VOCAB = {0: b"x", 1: b"a", 2: b"b", 3: b"c", 4: b"d", 5: b"e", 6: b"abcd", 7: b"bcd", 8: b"cdx", 9: b" ",
         10: b"hello", 11: b" world", 12: b"<eos>", 13: b"de",
         20: b"\xc3", 21: b"\xa9", 22: b"\xf0", 23: b"\x9f", 24: b"\x98", 25: b"\x80"}
SPECIAL = {12}


class FakeTokenizer:
    """Byte tokens; an incomplete UTF-8 character at the end decodes to "\ufffd" as real tokenizers do: one
    for the whole character, or with per_byte (as byte-level BPE does) one for each of its bytes."""

    def __init__(self, per_byte=False):
        self.per_byte = per_byte

    def decode(self, ids, skip_special_tokens=True):
        ids = [i for i in ids if not (skip_special_tokens and i in SPECIAL)]
        data = b"".join(VOCAB[i] for i in ids)
        if self.per_byte:
            text = data.decode("utf-8", errors="ignore")
            return text + "\ufffd" * (len(data) - len(text.encode()))
        return data.decode("utf-8", errors="replace")


class FakeSeq:
    """The parts of engine.Sequence the detokenizer uses; commit() ends at max_tokens like the engine."""

    def __init__(self, max_tokens):
        self.output_ids, self.finish_reason, self.max_tokens = [], None, max_tokens

    @property
    def finished(self):
        return self.finish_reason is not None

    def commit(self, tokens):
        taken = tokens[: self.max_tokens - len(self.output_ids)]
        self.output_ids.extend(taken)
        if len(self.output_ids) >= self.max_tokens:
            self.finish_reason = "length"
        return taken

    def truncate_output(self, length, reason):
        del self.output_ids[length:]
        self.finish_reason = reason


E = 22, 23, 24, 25  # "😀"
# name, stop strings, tokens, (text, number of tokens kept, finish) without / with the stop string in the text
CASES = [
    ("overlap", ["abcd", "bc"], [0, 1, 2, 3, 4, 0], ("xa", 4, "stop"), ("xabc", 4, "stop")),
    ("overlap_one_token", ["abcd", "bc"], [0, 6, 0], ("x", 2, "stop"), ("xabcd", 2, "stop")),
    ("longer_first_completes_later", ["abcde", "cd"], [1, 2, 3, 4, 5], ("ab", 4, "stop"), ("abcd", 4, "stop")),
    ("nested", ["abc", "b"], [0, 1, 2, 3, 0], ("xa", 3, "stop"), ("xab", 3, "stop")),
    # One token completes both: vLLM takes the first of the stop list that it finds, not the shorter one.
    ("nested_one_token", ["abc", "b"], [0, 6], ("x", 2, "stop"), ("xabc", 2, "stop")),
    ("nested_one_token_2", ["b", "abc"], [0, 6], ("xa", 2, "stop"), ("xab", 2, "stop")),
    # Both complete with the token "bcd": the first in the stop list wins, as vLLM's check_stop_strings does.
    ("same_token_list_order", ["cd", "bc"], [0, 1, 7, 0], ("xab", 3, "stop"), ("xabcd", 3, "stop")),
    ("same_token_list_order_2", ["bc", "cd"], [0, 1, 7, 0], ("xa", 3, "stop"), ("xabc", 3, "stop")),
    ("multi_token_stop", ["hello world"], [0, 9, 10, 11, 0, 0], ("x ", 4, "stop"), ("x hello world", 4, "stop")),
    ("stop_mid_token", ["bc"], [0, 1, 2, 8, 0], ("xa", 4, "stop"), ("xabc", 4, "stop")),
    ("stop_spans_tokens_and_mid_token", ["abcdx"], [1, 1, 2, 8, 1, 1], ("a", 4, "stop"), ("aabcdx", 4, "stop")),
    ("second_occurrence_after_partial", ["abd"], [1, 2, 1, 2, 4, 0], ("ab", 5, "stop"), ("ababd", 5, "stop")),
    ("no_stop_strings", [], [0, 6, 9, 10, 11], ("xabcd hello world", 5, "length"),
     ("xabcd hello world", 5, "length")),
    ("stop_never_seen", ["zz", "q"], [0, 6, 9, 10, 11], ("xabcd hello world", 5, "length"),
     ("xabcd hello world", 5, "length")),
    ("stop_at_last_token", ["world"], [0, 9, 10, 11], ("x hello ", 4, "stop"), ("x hello world", 4, "stop")),
    ("utf8_two_bytes", ["é"], [0, 1, 20, 21, 0], ("xa", 4, "stop"), ("xaé", 4, "stop")),
    ("utf8_four_bytes", ["😀"], [0, *E, 0], ("x", 5, "stop"), ("x😀", 5, "stop")),
    ("utf8_stop_ends_with_char", ["a😀"], [0, 1, *E, 0], ("x", 6, "stop"), ("xa😀", 6, "stop")),
    ("utf8_cut_by_length", ["q"], [0, 1, 22, 23], ("xa\ufffd", 4, "length"), ("xa\ufffd", 4, "length")),
    ("special_token_skipped", ["ab"], [1, 12, 2, 0], ("", 3, "stop"), ("ab", 3, "stop")),
    ("stop_in_first_token", ["a"], [6, 0], ("", 1, "stop"), ("a", 1, "stop")),
]


def _chunkings(n):
    """Step sizes to feed n tokens: every composition for short inputs, else 1s, all, and random ones."""
    if n <= 10:
        for cuts in itertools.product([False, True], repeat=n - 1):
            sizes, size = [], 1
            for cut in cuts:
                if cut:
                    sizes.append(size)
                    size = 1
                else:
                    size += 1
            yield sizes + [size]
        return
    yield [1] * n
    yield [n]
    rng = random.Random(0)
    for _ in range(50):
        sizes = []
        while sum(sizes) < n:
            sizes.append(rng.randint(1, 6))
        yield sizes


def _run(stop, tokens, include, sizes, per_byte=False):
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    detok, seq = Detokenizer(FakeTokenizer(per_byte), params), FakeSeq(max_tokens=len(tokens))
    deltas, start = [], 0
    for size in sizes:
        if seq.finished:
            break
        taken = seq.commit(tokens[start: start + size])
        start += size
        deltas.append(detok.update(seq, len(taken)))
    return detok.text, list(seq.output_ids), seq.finish_reason, "".join(deltas)


@pytest.mark.parametrize("per_byte", [False, True], ids=["char_ufffd", "byte_ufffd"])
@pytest.mark.parametrize("include", [False, True], ids=["exclude_stop", "include_stop"])
@pytest.mark.parametrize("name,stop,tokens,expect_excl,expect_incl", CASES, ids=[c[0] for c in CASES])
def test_multi_token_steps_equal_one_token_steps(name, stop, tokens, expect_excl, expect_incl, include, per_byte):
    text, count, finish = expect_incl if include else expect_excl
    if per_byte:
        text = text.replace("xa\ufffd", "xa\ufffd\ufffd")  # the length cut leaves two bytes of a character
    one_by_one = _run(stop, tokens, include, [1] * len(tokens), per_byte)
    assert one_by_one == (text, tokens[:count], finish, text)  # the streamed deltas add up to the text
    for sizes in _chunkings(len(tokens)):
        assert _run(stop, tokens, include, sizes, per_byte) == one_by_one, f"steps of {sizes}"


def test_random_token_streams_chunked_equal_one_by_one():
    rng = random.Random(1234)
    alphabet = [0, 1, 2, 3, 4, 5, 6, 7, 8, 13]
    stop_pool = ["ab", "bc", "cd", "abcd", "bcdx", "xa", "d", "cdx", "dex", "aa"]
    for _ in range(300):
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 12))]
        stop = rng.sample(stop_pool, rng.randint(1, 3))
        include = rng.random() < 0.5
        reference = _run(stop, tokens, include, [1] * len(tokens))
        assert reference[3] == reference[0]
        for _ in range(8):
            sizes = []
            while sum(sizes) < len(tokens):
                sizes.append(rng.randint(1, 5))
            assert _run(stop, tokens, include, sizes) == reference, (tokens, stop, include, sizes)


@pytest.mark.parametrize("include,steps", [
    (False, [([0, 0, 0], ""), ([1, 2], "xx"), ([0], "x"), ([1, 2, 3], "abx"), ([4, 0], "")]),
    # With the stop string kept in the text nothing needs holding back but an incomplete UTF-8 character.
    (True, [([0, 20], "x"), ([21, 1, 2], "éab"), ([3], "c"), ([4, 0], "d")]),
], ids=["exclude_stop", "include_stop"])
def test_streamed_text_is_held_back_only_as_needed(include, steps):
    params = SamplingParams(stop=["abcd"], include_stop_str_in_output=include)
    detok, seq = Detokenizer(FakeTokenizer(), params), FakeSeq(max_tokens=20)
    for tokens, delta in steps:
        assert detok.update(seq, len(seq.commit(tokens))) == delta
    assert seq.finish_reason == "stop" and detok.sent == len(detok.text)
    assert detok.text == ("xxxabx" if not include else "xéabcd")


def test_stop_strings_without_tokenizer_are_refused():
    with pytest.raises(QuickdraftError, match="stop_token_ids"):
        Detokenizer(None, SamplingParams(stop=["abc"]))
    llm = LLM(tiny_llama(), dtype="float32", device="cpu")
    with pytest.raises(QuickdraftError, match=r"stop.*stop_token_ids"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, stop=["abc"]))
    with pytest.raises(QuickdraftError, match="stop_token_ids"):
        list(llm.stream({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, stop="abc")))
    # Without stop strings a model without tokenizer still generates tokens (and no text).
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text == ""


class _LetterTokenizer:
    """Token i of the tiny model's 32-id vocabulary decodes to one or two letters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefgh"[i % 8] * (1 + i // 16) for i in ids)


def test_speculative_llm_stops_like_plain_decoding():
    target, prompt = tiny_llama(seed=0), [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9]
    plain = LLM(target, tokenizer=_LetterTokenizer(), dtype="float32", device="cpu")
    # The target as its own draft: every proposal is accepted, so each step commits 5 tokens. (A draft model
    # needs both or neither to have a tokenizer; this one gets its fake tokenizer afterwards.)
    spec = LLM(target, dtype="float32", device="cpu",
               speculative_config={"method": "draft_model", "model": tiny_llama(seed=0), "num_speculative_tokens": 4})
    spec.tokenizer = _LetterTokenizer()
    free = plain.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30))[0]
    text = free.outputs[0].text
    assert spec.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30))[0] \
        .outputs[0].text == text
    # Stop strings drawn from the text, overlapping ones included.
    pools = [[text[10:14], text[11:13]], [text[8:12], text[9:10]], [text[20:23]], [text[5:9], text[15:16], "zz"]]
    for stop in pools:
        for include in (False, True):
            params = SamplingParams(temperature=0, max_tokens=30, stop=stop, include_stop_str_in_output=include)
            a = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
            b = spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
            assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason), (stop, include)
            assert a.finish_reason == "stop"

"""The `suffix` draft (quickdraft/drafts/suffix.py).

The index: counts, matches and drafts on hand-built token lists; every invariant and every count against a
count from scratch under random appends, finishes, touches and evictions; the cache's token bound (least
recently used first, running texts never); a second turn that repeats an earlier answer gets long confident
drafts; random tokens get none; proposing costs well under a millisecond at a few thousand tokens of context.

The engine: greedy speculative output equals plain greedy output alone, batched, with requests joining and
leaving (and aborted), and under a KV budget that preempts; a finished request's whole text (the last step's
tokens too) enters the cache; sampled output has the target's exact law (tests/test_law.py's chi-square tests
at its sample size, rejection sampling in batches and request seeds).
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np
import pytest
import torch

from conftest import run_staggered, tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.drafts import SpeculativeConfig
from quickdraft.drafts.suffix import SuffixIndex, SuffixProposer
from quickdraft.errors import QuickdraftError
from quickdraft.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

BASE = [5, 9, 3, 7, 5, 9, 3, 1, 2, 5, 9, 4, 4, 8, 1, 5, 9, 3]
PROMPTS = [{"prompt_token_ids": BASE[:n]} for n in (3, 11, 7, 18, 1, 5)]


def _next_counts(index: SuffixIndex, pattern: list[int]) -> dict[int, int]:
    """{next token: occurrences} after `pattern` in the index (occurrences that continue)."""
    found = index._walk(pattern)
    assert found is not None, pattern
    node, offset, _ = found
    if offset < node.edge_length():
        return {node.doc.tokens[node.start + offset]: node.count}
    return {key: child.count for key, child in (node.children or {}).items()}


# --- the index --------------------------------------------------------------------------------------------
def test_counts_matches_and_drafts_on_hand_built_lists():
    index = SuffixIndex(max_depth=8, max_tokens=1000)
    doc = index.new_doc([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2])
    index.check()
    assert index.num_tokens == 11 and index.root.count == 11
    assert _next_counts(index, [1]) == {2: 4}
    assert _next_counts(index, [1, 2]) == {3: 2, 4: 1}  # the trailing 1 2 has no continuation yet
    assert _next_counts(index, [2, 3]) == {1: 2}
    assert _next_counts(index, [3, 1, 2]) == {4: 1}
    # The longest suffix seen before with a continuation: 1 2 3 1 2 (at 0, followed by 4).
    assert index.match_length(doc) == 5
    # Factor 1: at most 5 tokens; that occurrence's continuation, all of it from one occurrence.
    assert index.speculate(doc, 32, min_prob=0.1) == [4, 1, 2, 3, 1]
    assert index.speculate(doc, 3) == [4, 1, 2]
    assert index.speculate(doc, 32, factor=0.5) == [4, 1]
    assert index.speculate_pattern([1, 2, 3, 1, 2], 32) == [4, 1, 2, 3, 1]

    index.extend(doc, [3])  # ... 1 2 3: seen at 0 and 6, followed by 1 2 both times, then by 4 or 3
    index.check()
    assert index.match_length(doc) == 3
    assert _next_counts(index, [1, 2, 3, 1, 2]) == {4: 1, 3: 1}
    # 2 of 2 (smoothed: 2 / (2 + 10/4)), then a tie at 1 2 3 1 2 -> the most recent occurrence (3).
    assert index.speculate(doc, 32) == [1, 2, 3]
    assert index.speculate(doc, 32, min_prob=0.3) == [1, 2]  # 0.44 x 1 x 1/(2 + 10/16) = 0.17 < 0.3
    assert index.speculate(doc, 32, min_prob=0.5) == []  # 0.44 < 0.5 already at the first token

    # A second doc sees the first one's text (and counts add up across docs).
    other = index.new_doc([9, 9, 2, 3, 1])
    index.check()
    assert _next_counts(index, [2, 3]) == {1: 3}
    assert index.match_length(other) == 3
    assert index.speculate(other, 32) == [2, 3]  # 2 3 1 -> 2 (twice); 3 1 2 -> 4 or 3, most recent 3


def test_the_draft_length_follows_frequency_and_match_length():
    index = SuffixIndex(max_depth=24, max_tokens=1000)
    # After 7 1: 5 once, 6 once. Smoothed probability of either: 1 / (2 + 10/2) = 0.14; the more recent (6)
    # is followed by 8 in one occurrence (probability 1 inside an edge); factor 1: 2 tokens.
    doc = index.new_doc([7, 1, 5, 9, 7, 1, 6, 8, 7, 1])
    assert index.match_length(doc) == 2
    assert index.speculate(doc, 32) == [6, 8]
    assert index.speculate(doc, 32, min_prob=0.2) == []
    assert index.speculate(doc, 32, prior=0.0, min_prob=0.2) == [6, 8]  # unsmoothed: 0.5
    # A single matching token seen once before is not confident: 1 / (1 + 10) < 0.1 ...
    single = index.new_doc([3, 40, 41, 3])
    assert index.match_length(single) == 1 and index.speculate(single, 32) == []
    assert index.speculate(single, 32, prior=0.0) == [40]  # ... unless unsmoothed (factor 1: one token)
    # ... but the same continuation seen three times is: 3 / (3 + 10) = 0.23.
    frequent = index.new_doc([3, 40, 5, 3, 40, 6, 3, 40, 7, 3])
    assert index.speculate(frequent, 32) == [40]
    # A long match of one earlier occurrence drafts as far as the match is long (factor 1), up to the max.
    text = list(range(100, 160))
    long = index.new_doc(text + [1, 2] + text[:30])
    assert index.match_length(long) == 23  # the tree's depth (24) bounds the matched context
    assert index.speculate(long, 32) == text[30:53]
    assert index.speculate(long, 32, factor=2.0) == text[30:60] + [1, 2]  # past the depth: re-anchored
    assert index.speculate(long, 8, factor=2.0) == text[30:38]
    index.check()


def _brute_next(texts: list[list[int]], pattern: list[int], depth: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    m = len(pattern)
    if m + 1 > depth:
        return counts
    for toks in texts:
        for j in range(len(toks) - m):
            if toks[j:j + m] == pattern:
                counts[toks[j + m]] = counts.get(toks[j + m], 0) + 1
    return counts


@pytest.mark.parametrize("seed", range(8))
def test_the_index_against_a_count_from_scratch(seed):
    """Random appends (fresh tokens and copies of indexed text, over 1 to 5 token values: periodic texts),
    finishes, touches and evictions under several depths and budgets; after each operation every count,
    reference and recorded end is checked from scratch (SuffixIndex.check), and each running doc's match
    length and first draft token against a direct count over all texts."""
    rng = random.Random(seed)
    depth = [2, 3, 4, 6, 8, 5, 3, 24][seed]
    values = [1, 2, 3, 5, 2, 3, 5, 2][seed]
    budget = [0, 10, 40, 200, 10 ** 9, 25, 60, 30][seed]
    index = SuffixIndex(depth, budget)
    running = []
    for _ in range(150):
        r = rng.random()
        if r < 0.1 or not running:
            running.append(index.new_doc([rng.randrange(values) for _ in range(rng.randrange(5))]))
        elif r < 0.2:
            index.finish(running.pop(rng.randrange(len(running))))
        else:
            doc = rng.choice(running)
            source = rng.choice(list(index.docs)).tokens
            if rng.random() < 0.5 and source:
                start = rng.randrange(len(source))
                index.extend(doc, source[start:start + rng.randrange(1, 8)])
            else:
                index.extend(doc, [rng.randrange(values) for _ in range(rng.randrange(1, 4))])
            if rng.random() < 0.3:
                index.touch(rng.choice(list(index.docs)))
        index.check()
        assert index.num_tokens <= budget or not index.cached
        texts = [d.tokens for d in index.docs]
        for doc in running:
            toks = doc.tokens
            expected = 0
            while expected < min(len(toks), depth - 1) and _brute_next(texts, toks[len(toks) - expected - 1:], depth):
                expected += 1
            assert index.match_length(doc) == expected
            if expected:
                draft = index.speculate(doc, 10, factor=100.0, min_prob=0.0)
                counts = _brute_next(texts, toks[len(toks) - expected:], depth)
                assert draft and counts[draft[0]] == max(counts.values())
    for doc in running:
        index.finish(doc)
    index.check()


def test_the_cache_keeps_at_most_its_tokens_least_recently_used_first():
    index = SuffixIndex(max_depth=8, max_tokens=110)
    docs = []
    for i in range(4):
        docs.append(index.new_doc(list(range(1000 * i, 1000 * i + 30))))
        index.finish(docs[-1])
    # 120 tokens > 110: the oldest went.
    assert list(index.cached) == docs[1:] and index.num_tokens == 90 and index.evicted_docs == 1
    index.touch(docs[1])  # used: now the most recent
    docs.append(index.new_doc(list(range(9000, 9030))))
    index.finish(docs[-1])
    assert list(index.cached) == [docs[3], docs[1], docs[4]] and index.num_tokens == 90
    # A draft that follows a cached text uses it.
    reader = index.new_doc([5, 6] + list(range(3000, 3010)))
    assert index.speculate(reader, 5) == list(range(3010, 3015))
    assert list(index.cached)[-1] is docs[3]
    index.check()
    # A running text is never evicted, even past the bound: the cached ones go first.
    index.extend(reader, list(range(7000, 7100)))
    assert not index.cached and index.num_tokens == 112 and reader in index.docs
    index.check()
    # max_tokens 0: nothing is kept once finished.
    none_kept = SuffixIndex(max_depth=8, max_tokens=0)
    doc = none_kept.new_doc([1, 2, 3])
    none_kept.finish(doc)
    assert none_kept.num_tokens == 0 and not none_kept.docs and none_kept.root.children is None


def test_a_second_turn_that_repeats_an_earlier_answer_gets_long_confident_drafts():
    rng = random.Random(1)
    index = SuffixIndex()  # the defaults: depth 24, factor 1, min probability 0.1
    question = [rng.randrange(50_000) for _ in range(40)]
    answer = [rng.randrange(50_000) for _ in range(120)]
    first = index.new_doc(question)
    index.extend(first, answer)  # as decoded
    index.finish(first)
    # The second turn quotes the answer's start: the draft is the rest of the answer, as long as the matched
    # context allows (factor 1), and longer as the quote grows.
    second = index.new_doc([rng.randrange(50_000) for _ in range(30)] + answer[:12])
    assert index.speculate(second, 32) == answer[12:24]
    index.extend(second, answer[12:24])  # accepted
    assert index.speculate(second, 32) == answer[24:47]  # 23: the longest context the depth allows
    index.extend(second, answer[24:30])
    assert index.speculate(second, 32, factor=2.0) == answer[30:62]  # past the tree's depth by re-anchoring
    # Without the first turn in the cache nothing is drafted.
    fresh = SuffixIndex()
    alone = fresh.new_doc([rng.randrange(50_000) for _ in range(30)] + answer[:12])
    assert fresh.speculate(alone, 32) == []


def test_no_drafts_on_random_tokens():
    rng = random.Random(2)
    index = SuffixIndex()
    for _ in range(5):
        cached = index.new_doc([rng.randrange(50_000) for _ in range(500)])
        index.finish(cached)
    doc = index.new_doc([rng.randrange(50_000) for _ in range(100)])
    matched = 0
    for _ in range(2000):
        index.extend(doc, [rng.randrange(50_000)])
        matched += index.match_length(doc) > 0
        assert index.speculate(doc, 32) == []
    assert matched > 20  # single tokens seen before, followed once by something: not confident


def _natural_text(rng: random.Random, length: int) -> list[int]:
    """Zipf-distributed words with copied spans: text with the repeats suffix drafts live on."""
    words = np.arange(1, 20_001)
    weights = 1.0 / words
    weights /= weights.sum()
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.3:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randrange(3, 30)]
        else:
            out += [int(w) for w in np.random.default_rng(rng.randrange(1 << 30)).choice(words, 20, p=weights)]
    return out[:length]


def test_proposing_costs_well_under_a_millisecond_at_thousands_of_tokens():
    rng = random.Random(3)
    proposer = SuffixProposer()
    for _ in range(10):  # earlier requests in the cache
        doc = proposer.index.new_doc(_natural_text(rng, 1000))
        proposer.index.finish(doc)
    text = _natural_text(rng, 6000)
    seq = Sequence(text[:3000], SamplingParams(temperature=0, max_tokens=10_000), None, torch.device("cpu"), 20_001)
    start = time.perf_counter()
    seq.draft_state = proposer.new_state(seq)
    index_prompt = time.perf_counter() - start
    times, drafted = [], 0
    position = 3000
    while position < len(text):
        step = rng.randint(1, 4)
        for t in text[position:position + step]:
            seq.commit([], 0, t, set(), 1 << 30)
        position += step
        start = time.perf_counter()
        k = proposer.max_draft_tokens(seq)
        proposal = proposer.propose(seq, 8) if k else None
        times.append(time.perf_counter() - start)
        drafted += proposal is not None
    median = statistics.median(times)
    p90 = sorted(times)[int(0.9 * len(times))]
    print(f"\nindexing a 3000-token prompt: {1e3 * index_prompt:.1f} ms; a step (index 1-4 tokens, draft, propose) at "
          f"3000-6000 tokens of context: median {1e6 * median:.0f} us, p90 {1e6 * p90:.0f} us over {len(times)} "
          f"steps, {drafted} with a draft")
    assert drafted > len(times) // 4
    assert median < 1e-3  # measured ~60 us on this project's 2-core CPU (a generous bound for a busy machine)


def test_bad_suffix_settings():
    with pytest.raises(QuickdraftError, match="depth"):
        LLM(tiny_llama(seed=0), speculative_config={"method": "suffix", "suffix_decoding_max_tree_depth": 1})
    with pytest.raises(QuickdraftError, match="cached tokens"):
        SuffixProposer(max_cached_tokens=-1)
    with pytest.raises(QuickdraftError, match="min_token_prob"):
        SuffixProposer(min_token_prob=1.5)
    with pytest.raises(QuickdraftError, match="max_spec_factor"):
        SuffixProposer(max_spec_factor=0)
    config = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 40})
    proposer = SuffixProposer.from_config(config, None)
    assert proposer.max_spec_tokens == 40 and proposer.index.max_depth == 24


# --- the engine ---------------------------------------------------------------------------------------------
def _suffix(k: int = 4, adaptive: bool = False, **extra) -> dict:
    return {"method": "suffix", "num_speculative_tokens": k, "adaptive": adaptive, **extra}


def _outputs(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outs]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_greedy_output_equals_plain_alone_and_batched(adaptive):
    target = tiny_llama(seed=0)
    plain = LLM(target, speculative_config={"method": "none"})
    llm = LLM(target, speculative_config=_suffix(6, adaptive))
    params = [SamplingParams(temperature=0, max_tokens=40 + 7 * i) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(temperature=0.9, max_tokens=30, seed=4)  # seeded: the same whatever the drafts
    params[4] = SamplingParams(temperature=0, max_tokens=25, num_speculative_tokens=1)
    expected = _outputs(plain.generate(PROMPTS, params))
    alone = [_outputs(llm.generate(p, sp))[0] for p, sp in zip(PROMPTS, params)]
    together = _outputs(llm.generate(PROMPTS, params))  # now with the first run's text in the cache too
    assert alone == expected and together == expected
    metrics = [out.metrics for out in llm.generate(PROMPTS, params)]
    assert sum(m.proposed_tokens for m in metrics) > 0 and sum(m.accepted_tokens for m in metrics) > 0
    assert max(len(m.proposed_per_position) for m in metrics) >= 3  # some step drafted 3 tokens or more


def test_requests_join_and_leave_and_their_text_enters_the_cache():
    target = tiny_llama(seed=0)
    plain = LLM(target, speculative_config={"method": "none"})
    llm = LLM(target, speculative_config=_suffix(5))
    params = [SamplingParams(temperature=0, max_tokens=20 + 5 * i) for i in range(len(PROMPTS))]
    expected = _outputs(plain.generate(PROMPTS, params))
    scheduler = llm.new_scheduler(max_num_seqs=3)
    outputs = run_staggered(scheduler, PROMPTS, params, abort_step=4)
    assert outputs["1"] == expected[1][0][:len(outputs["1"])] and len(outputs["1"]) < len(expected[1][0])
    for i in (0, 2, 3, 4, 5):
        assert outputs[str(i)] == expected[i][0]
    # Every request's doc is finished into the cache, with its whole text: the last step's tokens too.
    proposer = llm.proposer
    index = proposer.index
    assert len(index.docs) == len(PROMPTS) and len(index.cached) == len(PROMPTS)
    texts = sorted(doc.tokens for doc in index.docs)
    whole = [PROMPTS[i]["prompt_token_ids"] + outputs[str(i)] for i in range(len(PROMPTS))]
    assert texts == sorted(whole)
    index.check()


def test_a_tight_kv_budget_preempts_and_keeps_every_output():
    target = tiny_llama(seed=0)
    plain = LLM(target, speculative_config={"method": "none"})
    params = [SamplingParams(temperature=0, max_tokens=70), SamplingParams(temperature=0.9, max_tokens=60, seed=4),
              SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=66),
              SamplingParams(temperature=0, max_tokens=72), SamplingParams(temperature=0.7, max_tokens=28, seed=-3)]
    expected = _outputs(plain.generate(PROMPTS, params))
    per_block = 16 * plain.kv_cache_estimate()["bytes_per_token"]
    tight = LLM(target, speculative_config=_suffix(4), kv_cache_memory=6 * per_block)
    scheduler = tight.new_scheduler()
    for i, (prompt, sp) in enumerate(zip(PROMPTS, params)):
        scheduler.add_request(str(i), prompt["prompt_token_ids"], sp)
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished():
        for update in scheduler.step():
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    assert scheduler.num_preemptions > 0
    assert [[outputs[str(i)]] for i in range(len(PROMPTS))] == expected
    # A preempted sequence keeps its doc: one doc per request, each with its whole text once.
    index = tight.proposer.index
    assert len(index.docs) == len(PROMPTS) and not [d for d in index.docs if not d.finished]
    index.check()


def test_an_answer_repeated_in_the_next_prompt_is_drafted_from_the_cache():
    """Turn 2's prompt is turn 1's prompt and the start of its answer: the target's greedy continuation is the
    rest of the answer, which only the cache holds; drafts follow it."""
    target = tiny_llama(seed=3, vocab_size=256)
    plain = LLM(target, speculative_config={"method": "none"})
    llm = LLM(target, speculative_config=_suffix(8))
    prompt = [17, 200, 3, 91, 45, 120, 7, 66, 31, 250]
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=60))[0]
    answer = first.outputs[0].token_ids
    second_prompt = {"prompt_token_ids": prompt + answer[:10]}
    sp = SamplingParams(temperature=0, max_tokens=40)
    second = llm.generate(second_prompt, sp)[0]
    assert second.outputs[0].token_ids == plain.generate(second_prompt, sp)[0].outputs[0].token_ids
    assert second.outputs[0].token_ids == answer[10:50]  # the target does repeat itself here
    m = second.metrics
    print(f"\nsecond turn: acceptance {m.acceptance_rate:.2f}, mean acceptance length {m.mean_acceptance_length:.2f}, "
          f"{m.target_forwards} target forwards for 40 tokens")
    assert m.acceptance_rate > 0.9 and m.mean_acceptance_length > 6 and m.target_forwards <= 8
    # Without the cache (only each request's own text) the same turn takes many more forwards.
    own_text_only = LLM(target, speculative_config=_suffix(8, suffix_decoding_max_cached_tokens=0))
    own_text_only.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=60))
    alone = own_text_only.generate(second_prompt, sp)[0]
    assert alone.outputs[0].token_ids == answer[10:50]
    print(f"without the cache: {alone.metrics.target_forwards} target forwards")
    assert alone.metrics.target_forwards >= 3 * m.target_forwards


# --- the law ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["t0.7", "t1.3-penalties-topk-topp-minp"])
@pytest.mark.parametrize("seeding", ["rejection", "request-seed"])
def test_sampled_output_follows_the_target_law(seeding, setting):
    """test_law's test for suffix drafts: N = 2000 completions of T = 5 tokens with a fixed K = 3 (every draft
    up to the cap: min_token_prob 0) fit the exact joint law on 8 chi-square statistics, each at p >= 1.25e-5,
    and contain no sequence of probability zero. The drafts come from the cache of earlier completions, so
    they differ from one sequence to the next; the steps must include ones with 3 drafts all accepted (then
    the bonus) and, under rejection sampling, rejections at draft positions 1 and 2 (the residual)."""
    from test_law import REQUEST_SEED, SETTINGS, K, T, _models, _sample_rejection, _setup, assert_follows_law

    prompt, _, law, test = _setup("ngram", setting)  # ngram's prompts and sample size; the law is the target's
    n = test.n
    params = SETTINGS[setting]
    llm = LLM(_models()[0], dtype="float32", device="cpu",
              speculative_config=_suffix(K, suffix_decoding_min_token_prob=0.0))
    if seeding == "rejection":
        samples, metrics, steps = _sample_rejection(llm, n, prompt, SamplingParams(max_tokens=T, **params))
        assert steps.get((3, 3), 0) >= 5 and steps.get((3, 1), 0) >= 5 and steps.get((3, 2), 0) >= 5, steps
    else:
        sp = SamplingParams(n=n, max_tokens=T, seed=REQUEST_SEED, **params)
        out = llm.generate({"prompt_token_ids": prompt}, sp)[0]
        samples, metrics, steps = [tuple(c.token_ids) for c in out.outputs], [out.metrics], None
        assert len(set(samples)) >= 50

    assert_follows_law(test, samples, metrics, steps, n, f"{seeding} suffix {setting}")

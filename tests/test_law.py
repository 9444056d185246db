"""The joint law of T = 5 speculatively sampled tokens against the exact law of plain sampling.

The engine's first step runs the prompt alone (k = 0) and then caps k at the tokens remaining minus one, so
with max_tokens = 5 and a fixed K = 3 the second step verifies three drafts: multi-token acceptance, the
corrections drawn from the residual at draft positions 1 and 2, and the bonus token after three (or two)
accepted drafts all decide what the 5 tokens are. On a 4-token vocabulary the exact law of plain sampling,
P(y1..y5), is enumerated over its 4^5 = 1024 cells from the transformers model itself and
quickdraft.sampling.process (penalties, then temperature, top-k, top-p, min-p), and the engine's samples are
compared with it by chi-square tests.

Covered: draft_model, ngram and eagle drafts (eagle: a head over a reduced vocabulary, so q is zero at a token
the target may draw; draft_model with draft_vocab_size likewise); rejection sampling (no seed; driven through
the engine's batched step, batches mixing prompts and sequences drafting 1-3 tokens) and position-keyed noise (a request seed;
through LLM.generate with n = N); plain sampling at temperature 0.7, and temperature 1.3 with repetition,
presence and frequency penalties and top-k, top-p and min-p, each of which cuts tokens at many prefixes,
and temperature 0.9 with a logit_bias (applied to the draft's q as to the target's p).

Thresholds: each sample set is tested on 8 statistics (the joint law and the laws of windows of 2 and 3
consecutive tokens, see WINDOWS), each at ALPHA / 8 (Bonferroni), so an exact engine fails a sample set with
probability at most ALPHA = 1e-4, and one of the 8 sample sets with probability at most 8e-4 (as far as the
chi-square approximation holds with expected counts >= 5; 50 sample sets of the exact law per setting are
checked to pass in the power test). Every seed is fixed: each test is deterministic.

Power: `test_the_law_test_has_power` computes the exact laws that bugs of the multi-token path would give
(the bonus after k >= 2 accepted drafts drawn one position early; the correction after a rejection at
position >= 1 drawn from p instead of the residual; target positions after drafts processed without the
drafts in the penalty history) and gross errors (the draft model's own law, the temperature applied
wrongly), and checks that the same tests at the same N reject samples drawn from them.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import tiny_llama
from quickdraft import LLM, SamplingParams
from quickdraft.drafts.ngram import find_continuation
from quickdraft.sampling import PenaltyHistory, process
from quickdraft.sequence import RequestMetrics

VOCAB = 4
# draft_model whose draft scores only token ids 0..2 (draft_vocab_size 3): q is zero at token 3, which the target
# still verifies and draws
DRAFT_VOCAB3 = "draft_model-vocab3"
T = 5  # tokens per sample: the prompt's step gives 1, then a step with k = min(K, T - 2) = 3 drafts
K = 3
# Samples per test. N-gram completions are cheaper, and its steps that accept all of 2 or 3 drafts rarer:
# it needs more samples to see a bug in the bonus (power 0.96 at 1500, 1.0 at 2000).
N = {"draft_model": 1100, "ngram": 2000, "eagle": 1100, "model_lookup": 1100, DRAFT_VOCAB3: 1100}
ALPHA = 1e-4
REQUEST_SEED = 1234
GENERATOR_SEED = 99
BATCH, ADMIT = 24, 8  # rejection sampling: sequences per batched step, and new ones per step
NGRAM = dict(prompt_lookup_min=1, prompt_lookup_max=3)

SETTINGS = {
    "t0.7": dict(temperature=0.7),
    "t1.3-penalties-topk-topp-minp": dict(temperature=1.3, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                                          presence_penalty=0.4, frequency_penalty=0.3),
    # logit_bias applies to the target's rows and the draft's alike (SamplingParams.logit_bias)
    "t0.9-logit-bias": dict(temperature=0.9, logit_bias={2: 1.5, 3: -1.0}),
}
# Prompts with spread-out laws (>= 50 cells of expected count >= 5 at N). The n-gram prompts are partly the
# target's own continuations, so that lookups of 3 tokens are found and sometimes all accepted.
PROMPTS = {
    ("draft_model", "t0.7"): [1, 2, 0, 1, 2],
    ("draft_model", "t1.3-penalties-topk-topp-minp"): [1, 2, 0, 1, 2],
    ("eagle", "t0.7"): [1, 2, 0, 1, 2],
    ("eagle", "t1.3-penalties-topk-topp-minp"): [1, 2, 0, 1, 2],
    ("ngram", "t0.7"): [0, 1, 3, 3, 3, 2],
    ("ngram", "t1.3-penalties-topk-topp-minp"): [1, 2, 2, 3, 1, 2, 0, 3],
    ("draft_model", "t0.9-logit-bias"): [1, 2, 0, 1, 2],
    **{(DRAFT_VOCAB3, setting): [1, 2, 0, 1, 2] for setting in SETTINGS},
    ("eagle", "t0.9-logit-bias"): [1, 2, 0, 1, 2],
    ("ngram", "t0.9-logit-bias"): [1, 2, 2, 3, 1, 2, 0, 3],
    # model_lookup: prompts where the suffix lookup finds confident matches some steps and not others, so
    # both lookup drafts (q one-hot) and the draft model's (q its processed law) are verified.
    ("model_lookup", "t0.7"): [0, 1, 3, 3, 3, 2],
    ("model_lookup", "t1.3-penalties-topk-topp-minp"): [1, 2, 2, 3, 1, 2, 0, 3],
    ("model_lookup", "t0.9-logit-bias"): [1, 2, 2, 3, 1, 2, 0, 3],
}
# The statistics: the joint law of the T tokens, and the laws of every window of 2 and of 3 consecutive
# tokens. The joint law spreads a deviation confined to two neighbours (a bonus drawn one position early)
# over many cells, most pooled; the window of those two sees it clearly.
WINDOWS = {"y1..y5": tuple(range(T)), **{f"y{i + 1}y{i + 2}": (i, i + 1) for i in range(T - 1)},
           **{f"y{i + 1}..y{i + 3}": (i, i + 1, i + 2) for i in range(T - 2)}}
LEVEL = ALPHA / len(WINDOWS)
CELLS = list(itertools.product(range(VOCAB), repeat=T))
INDEX = {cell: i for i, cell in enumerate(CELLS)}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


@functools.lru_cache(maxsize=None)
def _models():
    return tiny_llama(seed=0, vocab_size=VOCAB, layers=2), tiny_llama(seed=5, vocab_size=VOCAB, layers=2)


class _Tables:
    """The raw logits of a model after the prompt and every output prefix shorter than T, processed on demand
    with the request's parameters and a penalty history (the context, or a stale prefix of it for a bug)."""

    def __init__(self, model, prompt: list[int], params: SamplingParams):
        self.prompt, self.params = prompt, params
        self.logits = {}
        with torch.inference_mode():
            for length in range(T):
                prefixes = list(itertools.product(range(VOCAB), repeat=length))
                rows = model(input_ids=torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].double()
                self.logits.update(zip(prefixes, rows))

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one world per test module, kept for the module's life)
    def probs(self, context: tuple, history: tuple | None = None) -> torch.Tensor:
        hist = PenaltyHistory(self.prompt, VOCAB, torch.device("cpu"))
        hist.append(list(context if history is None else history))
        seen, counts = hist.rows(torch.empty(0, dtype=torch.long), 1)
        return process(self.logits[context][None], self.params, seen, counts)[0]


def _plain_law(tables: _Tables) -> np.ndarray:
    """P(y1..yT) = prod_t p(y_t | y_<t) over CELLS, by recursion over prefixes."""
    law = np.zeros(len(CELLS))

    def expand(prefix: tuple, weight: float) -> None:
        if len(prefix) == T:
            law[INDEX[prefix]] = weight
            return
        p = tables.probs(prefix)
        for token in range(VOCAB):
            expand(prefix + (token,), weight * p[token].item())

    expand((), 1.0)
    return law


def _speculative_law(target: _Tables, draft, bug: str | None = None) -> np.ndarray:
    """The exact law over CELLS of T tokens made on the engine's schedule (the prompt's step alone, then
    k = min(K, T - m - 1)) with rejection sampling, correct (bug None: it must equal the plain law) or with one
    deliberate bug where a test of 3 tokens (every step one draft) cannot see it:
    "bonus": the bonus after k >= 2 accepted drafts is drawn from the distribution of draft position k-1;
    "residual": the correction after a rejection at draft position i >= 1 is drawn from p, not from
        max(0, p - q) normalised;
    "stale_history": target positions after draft tokens are processed with the committed history only.
    draft: a _Tables of the draft model (its q), or "ngram" (the prompt-lookup draft: q one-hot)."""
    law = np.zeros(len(CELLS))

    def p_at(x: tuple, accepted: tuple) -> torch.Tensor:
        return target.probs(x + accepted, x if bug == "stale_history" else None)

    def blocks(x: tuple, k: int) -> list[tuple[tuple, float]]:
        """The tokens one step commits after output x, with their probabilities."""
        lookup = None
        if draft == "ngram" and k > 0:
            lookup = find_continuation(np.asarray(target.prompt + list(x), dtype=np.int64),
                                       NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"], k).tolist()
            k = len(lookup)
        out = []

        def walk(accepted: tuple, weight: float) -> None:
            i = len(accepted)
            p = p_at(x, accepted)
            if i == k:  # every draft accepted (or none proposed): the target's own token
                bonus = p_at(x, accepted[:-1]) if bug == "bonus" and k >= 2 else p
                out.extend((accepted + (t,), weight * bonus[t].item()) for t in range(VOCAB))
                return
            if lookup is not None:
                q = torch.zeros(VOCAB, dtype=p.dtype)
                q[lookup[i]] = 1.0
            else:
                q = draft.probs(x + accepted).to(p.dtype)
            kept = torch.minimum(p, q)  # drawn from q and accepted with probability min(1, p / q)
            for d in range(VOCAB):
                if kept[d] > 0:
                    walk(accepted + (d,), weight * kept[d].item())
            reject = 1.0 - kept.sum().item()
            if reject > 1e-12:
                residual = p if bug == "residual" and i >= 1 else (p - q).clamp_min(0)
                residual = residual / residual.sum()
                out.extend((accepted + (t,), weight * reject * residual[t].item()) for t in range(VOCAB))

        walk((), 1.0)
        return out

    def expand(x: tuple, weight: float) -> None:
        if len(x) == T:
            law[INDEX[x]] += weight
            return
        for block, w in blocks(x, 0 if not x else min(K, T - len(x) - 1)):
            expand(x + block, weight * w)

    expand((), 1.0)
    return law


class _LawTest:
    """The chi-square tests of one law for n samples: per window of WINDOWS, the window's cells with
    expected count >= 5 and one pool of the rest (the usual validity rule), fixed by the law alone."""

    def __init__(self, law: np.ndarray, n: int):
        self.law, self.n = law, n
        self.windows = {}
        for name, window in WINDOWS.items():
            keys = [tuple(cell[i] for i in window) for cell in CELLS]
            ids = {key: j for j, key in enumerate(sorted(set(keys)))}
            key_of_cell = np.array([ids[key] for key in keys])
            key_probs = np.bincount(key_of_cell, weights=law, minlength=len(ids))
            big = key_probs * n >= 5
            group_of_key = np.where(big, np.cumsum(big) - 1, big.sum())  # the small ones: one pool, last
            group_of_cell = group_of_key[key_of_cell]
            expected = np.bincount(group_of_cell, weights=law, minlength=big.sum() + 1)
            if expected[-1] == 0:  # nothing small but cells of probability zero, which no sample may hit
                expected = expected[:-1]
                group_of_cell = np.minimum(group_of_cell, len(expected) - 1)
            self.windows[name] = (group_of_cell, expected / expected.sum())

    @property
    def tested_cells(self) -> int:
        return int((self.law * self.n >= 5).sum())

    def impossible(self, counts: np.ndarray) -> list[tuple]:
        """Sampled sequences of probability zero (an error outright)."""
        return [CELLS[i] for i in np.flatnonzero((counts > 0) & (self.law == 0))]

    def pvalues(self, counts: np.ndarray) -> dict[str, float]:
        n = counts.sum()
        out = {}
        for name, (group_of_cell, expected) in self.windows.items():
            observed = np.bincount(group_of_cell, weights=counts, minlength=len(expected))
            out[name] = float(stats.chisquare(observed, expected * n).pvalue)
        return out

    def rejects(self, counts: np.ndarray) -> bool:
        return bool(self.impossible(counts)) or min(self.pvalues(counts).values()) < LEVEL


@functools.lru_cache(maxsize=None)
def _setup(method: str, setting: str):
    prompt = PROMPTS[(method, setting)]
    tables = _Tables(_models()[0], prompt, SamplingParams(**SETTINGS[setting]))
    law = _plain_law(tables)
    return prompt, tables, law, _LawTest(law, N[method])


@functools.lru_cache(maxsize=None)
def _eagle_head() -> str:
    """An EAGLE head for the target (random, its logits sharpened) over 3 of the 4 tokens: q is zero at token 2,
    which the target still verifies and draws."""
    import tempfile

    from quickdraft.drafts.eagle import new_head

    target = LLM(_models()[0], dtype="float32", device="cpu", speculative_config={"method": "none"}).target
    head = new_head(target, torch.tensor([0, 1, 3]), seed=3)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() > 1:
                p.mul_(8.0)
    directory = tempfile.mkdtemp(prefix="quickdraft-law-eagle-")
    head.save(directory)
    return directory


def _config(method: str) -> dict:
    config = {"method": method, "num_speculative_tokens": K, "adaptive": False}
    if method == DRAFT_VOCAB3:
        config.update(method="draft_model", draft_vocab_size=3)
    if method in ("draft_model", "model_lookup", DRAFT_VOCAB3):
        config["model"] = _models()[1]
        if method == "model_lookup":
            # Finished completions' text leaves the index at once (Proposer.release caches it otherwise): with all
            # of their 5-token texts kept, lookups of this 4-token vocabulary crowd out the model's drafts.
            config["suffix_decoding_max_cached_tokens"] = 0
    elif method == "eagle":
        config.update(model=_eagle_head(), eagle_lookup=False)
    else:
        config.update(NGRAM)
    return config


def _sample_rejection(llm: LLM, n: int, prompt: list[int], sp: SamplingParams):
    """n completions verified by rejection sampling with one seeded generator. The public API cannot do this
    reproducibly (an LLM seed switches requests to position-keyed noise; without one the generator's seed is
    random), so this drives the engine's batched step as the API's scheduler does: up to BATCH sequences run
    together and ADMIT new ones join per step, so a batch mixes prompts (k = 0) with sequences drafting 1, 2
    and 3 tokens. Returns the samples, the per-sequence metrics and the (k proposed, drafts accepted) of every
    step, k read from each sequence's metrics (what the engine verified, however the draft chose it)."""
    engine = llm.engine
    generator = torch.Generator().manual_seed(GENERATOR_SEED)
    finished, running, steps = [], [], {}
    while len(finished) + len(running) < n or running:
        for _ in range(min(ADMIT, BATCH - len(running), n - len(finished) - len(running))):
            running.append(engine.new_sequence(prompt, sp, generator, None))
        assert all(seq.noise_key is None for seq in running)
        before = [seq.metrics.proposed_tokens for seq in running]
        for seq, proposed, block in zip(running, before, engine.step_batch(running)):
            key = (seq.metrics.proposed_tokens - proposed, len(block) - 1)
            steps[key] = steps.get(key, 0) + 1
        for seq in running:
            if seq.finished:  # free its KV memory, as the scheduler does (a suffix draft then caches its text)
                seq.target_cache, seq.draft_state = engine.target.new_cache(), None
                finished.append(seq)
        running = [seq for seq in running if not seq.finished]
    return [tuple(seq.output_ids) for seq in finished], [seq.metrics for seq in finished], steps


def assert_follows_law(test: "_LawTest", samples, metrics, steps, n: int, label: str) -> tuple[list, list]:
    """n samples of T tokens, drafts proposed at every position up to K and accepted at the last, no sequence
    of probability zero, and every chi-square statistic at p > LEVEL. Returns (proposed, accepted) per
    position."""
    assert len(samples) == n and all(len(s) == T for s in samples)
    pooled = RequestMetrics.combine(metrics)  # per-position counts summed over the sequences
    proposed, accepted = pooled.proposed_per_position, pooled.accepted_per_position
    assert len(proposed) == K and proposed[2] > 0 and accepted[2] > 0, (proposed, accepted)
    counts = np.bincount([INDEX[s] for s in samples], minlength=len(CELLS))
    assert not test.impossible(counts), f"sampled sequences of probability zero: {test.impossible(counts)}"
    pvalues = test.pvalues(counts)
    print(f"\n{label}: min p {min(pvalues.values()):.3g}, steps {steps}, proposed {proposed}, accepted {accepted}")
    assert min(pvalues.values()) > LEVEL, (pvalues, steps, proposed, accepted)
    return proposed, accepted


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["draft_model", "ngram", "eagle", "model_lookup", DRAFT_VOCAB3])
@pytest.mark.parametrize("seeding", ["rejection", "request-seed"])
def test_five_speculative_tokens_follow_the_target_law(seeding, method, setting):
    """N (1100 or 2000) completions of T = 5 tokens with a fixed K = 3 fit the exact joint law (8 chi-square
    statistics, each failing at p < 1.25e-5), and never contain a sequence of probability zero. The steps
    must include ones that proposed 3 drafts and accepted all of them (then drew the bonus) and, under
    rejection sampling, ones that rejected at draft positions 1 and 2 (then drew from the residual)."""
    prompt, _, law, test = _setup(method, setting)
    params = SETTINGS[setting]
    llm = LLM(_models()[0], dtype="float32", device="cpu", speculative_config=_config(method))
    if seeding == "rejection":
        samples, metrics, steps = _sample_rejection(llm, N[method], prompt, SamplingParams(max_tokens=T, **params))
        # (k, accepted): (3, 3) all three accepted, then the bonus; (3, 1), (3, 2) a residual at position 1, 2.
        assert steps.get((3, 3), 0) >= 5 and steps.get((3, 1), 0) >= 5 and steps.get((3, 2), 0) >= 5, steps
    else:
        sp = SamplingParams(n=N[method], max_tokens=T, seed=REQUEST_SEED, **params)
        out = llm.generate({"prompt_token_ids": prompt}, sp)[0]
        samples, metrics, steps = [tuple(c.token_ids) for c in out.outputs], [out.metrics], None
        assert len(set(samples)) >= 50  # the n completions are distinct draws, not one draw repeated

    proposed, accepted = assert_follows_law(test, samples, metrics, steps, N[method], f"{seeding} {method} {setting}")
    if method == "model_lookup":  # both sources drafted, many times each
        proposer = llm.engine.proposer
        assert proposer.lookup_drafts >= 100 and proposer.model_drafts >= 100, (proposer.lookup_drafts,
                                                                                 proposer.model_drafts)
    reached = RequestMetrics.combine(metrics).reached_per_position  # rejected at position i: reached there, not accepted
    assert reached[1] > accepted[1] and reached[2] > accepted[2], (reached, accepted)


def _rejection_rate(test: _LawTest, sampled_law: np.ndarray, rng: np.random.Generator, repeats: int = 50) -> float:
    """How often `test` rejects samples (as many as it is made for) drawn from `sampled_law`."""
    draws = rng.multinomial(test.n, sampled_law / sampled_law.sum(), size=repeats)
    return sum(test.rejects(counts) for counts in draws) / repeats


@pytest.mark.parametrize("setting", ["t0.7", "t1.3-penalties-topk-topp-minp"])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_the_law_test_has_power(method, setting):
    """The tests above, at the same N, reject samples of laws that bugs would give, each computed exactly: 50
    sets of N samples are drawn from each, and at least 45 must be rejected (power >= 0.9). Samples of the
    right law are never rejected in 50 tries. The same calculation without a bug must reproduce the plain
    law to rounding (a check of the calculator)."""
    prompt, tables, law, test = _setup(method, setting)
    params = SETTINGS[setting]
    assert test.tested_cells >= 50  # the law is spread out: many cells are tested one by one
    draft = "ngram" if method == "ngram" else _Tables(_models()[1], prompt, SamplingParams(**params))

    assert np.abs(_speculative_law(tables, draft) - law).max() < 1e-12

    wrong = {bug: _speculative_law(tables, draft, bug) for bug in ("bonus", "residual")}
    if SamplingParams(**params).uses_penalties:
        wrong["stale_history"] = _speculative_law(tables, draft, "stale_history")
    if method == "draft_model":
        wrong["draft model's law"] = _plain_law(draft)
    no_temperature = dict(params, temperature=1.0)
    wrong["temperature not applied"] = _plain_law(_Tables(_models()[0], prompt, SamplingParams(**no_temperature)))
    assert all(abs(bad.sum() - 1) < 1e-9 for bad in wrong.values())

    rng = np.random.default_rng(7)
    power = {name: _rejection_rate(test, bad, rng) for name, bad in wrong.items()}
    false_alarms = _rejection_rate(test, law, rng)
    print(f"\n{method} {setting}: {test.tested_cells} cells tested, power {power}, false alarms {false_alarms}")
    assert false_alarms == 0
    assert all(rate >= 0.9 for rate in power.values()), power

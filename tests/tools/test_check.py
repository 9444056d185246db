"""`quickdraft check` (quickdraft/tools/check/): it passes on the real engine and fails on planted defects.

Models: the 4-token tiny Llamas of tests/test_law.py (target seed 0, draft seed 5, two layers, float32 on CPU),
K = 3 fixed, prompts as token ids. Every check draws N = 1000 samples of m = 4 tokens over the two prompts
PROMPTS (500 each; the first step commits one token, the second verifies up to two drafts), against the
exact law of plain sampling enumerated by check itself, with alpha = 1e-3 over its 6 chi-square statistics
(each at 1.67e-4, Bonferroni; one more sample set with a request seed). So a check of an exact engine fails
with probability at most 1e-3 (as far as the chi-square approximation holds with cells of expected count
>= 5); every seed is fixed, so each test is deterministic, and those below pass.

Power at this N, measured with check seeds 0..9 for each: the planted defects (a residual of p instead of
max(0, p - q); every draft accepted; the bonus after two accepted drafts drawn from the previous position's
distribution; greedy rows accepting one draft more than matched) were rejected in 10/10 runs each, with
p-values of 2.5e-9 and below where the level is 1.67e-4 (and sequences of probability zero for the bonus
defect), or (greedy) by divergences whose logit gap is 4e4 times the float32 near-tie tolerance and more;
the exact engine passed 40/40 runs (4 settings), its smallest p-value 1.1e-3. The batched sampler draws the same
samples as the per-sequence one did (each sequence's uniforms, then its token's, in batch order), so these
figures stand; a fifth defect, the batched residual read from the next row, was measured at check seed 0 only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import pytest
import torch

import quickdraft
from conftest import tiny_llama
from quickdraft import LLM, SamplingParams, verify
from quickdraft.errors import QuickdraftError
from quickdraft.tools.check import check, near_tie_tolerance
from quickdraft.tools.check import greedy as check_greedy

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

VOCAB = 4
K = 3
N = 1000
MAX_TOKENS = 16  # greedy comparison
# The second prompt repeats itself, so that n-gram lookups find drafts of 2 and some are all accepted.
PROMPTS = [[1, 2, 0, 1, 2], [0, 1, 3, 3, 3, 2]]
SETTINGS = {
    "t0.7": dict(temperature=0.7),
    "t1.3-penalties-topk-topp-minp": dict(temperature=1.3, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                                          presence_penalty=0.4, frequency_penalty=0.3),
}


@functools.lru_cache(maxsize=None)
def _models():
    return tiny_llama(seed=0, vocab_size=VOCAB, layers=2), tiny_llama(seed=5, vocab_size=VOCAB, layers=2)


def _config(method: str) -> dict:
    config = {"method": method, "num_speculative_tokens": K, "adaptive": False}
    if method == "draft_model":
        config["model"] = _models()[1]
    else:
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    return config


def _llm(method: str) -> LLM:
    return LLM(_models()[0], speculative_config=_config(method), dtype="float32", device="cpu")


def _check(method: str, setting: str = "t0.7", params: dict | None = None, **options):
    """check() of the tiny target with `method`'s draft, at N samples unless options say otherwise."""
    return check(_llm(method), PROMPTS, SamplingParams(**SETTINGS[setting], **(params or {})),
                 **{"max_tokens": MAX_TOKENS, "samples": N, **options})


# --- check passes on the real engine ----------------------------------------------------------------------
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_check_passes_on_the_engine(method, setting):
    """Greedy output equal on both prompts, every p-value above its level, no sequence of probability zero, the
    exact law enumerated for both prompts, and drafts accepted at both draft positions (so corrections and
    bonus tokens after two accepted drafts were sampled). The TV distance is about what noise alone gives."""
    report = _check(method, setting)
    print("\n" + report.render())
    assert report.passed, report.render()
    assert all(g.identical for g in report.greedy)
    [stats] = report.stats
    assert stats.path == "rejection sampling" and stats.samples == N
    assert stats.exact_prompts == [0, 1] and not stats.fallback_prompts
    assert len(stats.accepted_per_position) == 2 and min(stats.accepted_per_position) > 20, stats
    assert min(stats.pvalues.values()) >= stats.level and stats.level == pytest.approx(1e-3 / 6)
    assert set(stats.pvalues) == {"y1", "y1..y2", "y1..y3", "y1..y4", "y2y3", "y3y4"}
    assert stats.tv_distance < 2 * stats.tv_noise
    assert "verdict: PASS" in report.render()


def test_check_passes_on_the_seeded_path():
    """With a request seed, a second sample set goes through LLM.generate (position-keyed noise) and passes too,
    at alpha / 12 per statistic."""
    report = _check("ngram", "t1.3-penalties-topk-topp-minp", params={"seed": 7})
    assert report.passed, report.render()
    assert [s.path for s in report.stats] == ["rejection sampling", "seeded"]
    assert all(s.level == pytest.approx(1e-3 / 12) for s in report.stats)


def test_check_is_reproducible():
    """The same check seed gives the same samples (the generator that drives rejection sampling is seeded)."""
    first, second = (_check("ngram", samples=300, max_tokens=4) for _ in range(2))
    assert first.stats[0].pvalues == second.stats[0].pvalues
    assert first.stats[0].tv_distance == second.stats[0].tv_distance


# --- check fails on planted defects -----------------------------------------------------------------------
def _fails_statistically(report) -> None:
    print("\n" + report.render())
    assert not report.passed
    assert all(g.identical for g in report.greedy)  # a sampling defect: greedy output is untouched
    stats = report.stats[0]
    assert stats.impossible or stats.min_pvalue < stats.level * 1e-3, stats
    assert stats.tv_distance > stats.tv_noise
    assert "verdict: FAIL" in report.render()


def test_check_fails_when_the_residual_is_p(monkeypatch):
    """Defect (a): after a rejection the correction is drawn from p instead of max(0, p - q) normalised. Draft
    model drafts: min p-value 4.2e-43 at check seed 0 (window y2y3), at most 1.8e-31 over check seeds 0..9."""
    monkeypatch.setattr(verify, "residual_probs", lambda p, q, draft_tokens: p)
    _fails_statistically(_check("draft_model"))


def test_check_fails_when_every_draft_is_accepted(monkeypatch):
    """Defect (b): acceptance probability 1 for every draft token. N-gram drafts: p-values 0 (TV about 0.55)."""
    monkeypatch.setattr(verify, "acceptance_rates", lambda px, qx: torch.ones_like(px))
    _fails_statistically(_check("ngram"))


def test_check_fails_when_the_bonus_comes_from_the_previous_position(monkeypatch):
    """Defect (c): after k >= 2 accepted drafts the bonus token is drawn from row k-1 (the last draft's
    distribution) instead of row k: an off-by-one that only steps accepting two drafts show. Under top-k,
    top-p, min-p and penalties it draws tokens that row k's filters removed (sequences of probability zero),
    and the window y3y4 rejects it (p 3.1e-11; at most 2.5e-9 over check seeds 0..9, each with 7 to 12
    sequences of probability zero)."""
    def bonus_one_position_early(row_starts, num_accepted, num_draft_tokens):
        early = (num_accepted == num_draft_tokens) & (num_draft_tokens >= 2)
        return row_starts + num_accepted - early.long()  # the bonus row K replaced by row K-1

    monkeypatch.setattr(verify, "residual_rows", bonus_one_position_early)
    report = _check("draft_model", "t1.3-penalties-topk-topp-minp")
    _fails_statistically(report)
    assert report.stats[0].impossible
    assert "sequences of probability zero: prompt" in report.render()


def test_check_fails_when_the_batched_residual_reads_the_next_row(monkeypatch):
    """Defect (e): an off-by-one in the batched rejection sampler's rows: after a rejection at draft position n
    the correction is drawn from max(0, p - q) with p the NEXT row's (n + 1: the distribution after the
    rejected draft) instead of row n's. N-gram drafts under the penalties setting: p-values 0 (windows y1..y3, y2y3,
    y3y4) and 35 sequences of probability zero at check seed 0."""
    def next_row(row_starts, num_accepted, num_draft_tokens):
        return row_starts + torch.where(num_accepted < num_draft_tokens, num_accepted + 1, num_accepted)

    monkeypatch.setattr(verify, "residual_rows", next_row)
    _fails_statistically(_check("ngram", "t1.3-penalties-topk-topp-minp"))


def test_check_fails_when_greedy_accepts_one_draft_too_many(monkeypatch):
    """Defect (d): greedy rows keep the first mismatching draft too, then take the target's token after it.
    The greedy comparison flags it as a real defect: at the divergence the target's logit gap is ~1, far above
    the float32 near-tie tolerance (~1e-5). Sampled rows are untouched, so the statistical test passes."""
    greedy_accept = verify.greedy_accept

    def one_draft_too_many(target_tokens, draft_tokens, num_draft_tokens, passes=None, layout=None):
        layout = layout if layout is not None else verify.chain_layout(num_draft_tokens, target_tokens.device)
        accepted, _ = greedy_accept(target_tokens, draft_tokens, num_draft_tokens, passes, layout)
        accepted = torch.where(accepted < layout.num_draft_tokens, accepted + 1, accepted)
        return accepted, target_tokens[layout.row_starts + accepted]

    greedy_accept_on_host = verify.greedy_accept_on_host

    def one_draft_too_many_on_host(target_tokens, draft_tokens, cu_num_rows, cu_num_draft_tokens):
        # the same defect where the CPU verifies greedy chains on the host
        out = []
        for i, (n, _) in enumerate(greedy_accept_on_host(target_tokens, draft_tokens, cu_num_rows, cu_num_draft_tokens)):
            n = min(n + 1, cu_num_draft_tokens[i + 1] - cu_num_draft_tokens[i])
            out.append((n, target_tokens[cu_num_rows[i] + n]))
        return out

    monkeypatch.setattr(verify, "greedy_accept", one_draft_too_many)
    monkeypatch.setattr(verify, "greedy_accept_on_host", one_draft_too_many_on_host)
    report = _check("draft_model")
    print("\n" + report.render())
    assert not report.passed
    assert report.stats[0].passed
    divergences = [g.divergence for g in report.greedy if g.divergence is not None]
    assert divergences and not any(d.near_tie for d in divergences)
    assert all(d.gap > 100 * d.tolerance for d in divergences)
    assert "DEFECT" in report.render() and "not at a near-tie" in report.render()


def test_check_fails_the_lossy_relaxed_acceptance():
    """SpeculativeConfig(acceptance="relaxed", threshold=0.2), passed as a speculative_config dict on the same
    loaded target: check fails it and reports its TV distance (about 0.4, noise alone 0.08)."""
    if "acceptance" not in {f.name for f in dataclasses.fields(quickdraft.SpeculativeConfig)}:
        pytest.skip("this build has no relaxed acceptance mode")
    llm = LLM(_models()[0], dtype="float32", device="cpu")
    relaxed = dict(_config("ngram"), acceptance="relaxed", threshold=0.2)
    report = check(llm, PROMPTS, SamplingParams(temperature=0.7), speculative_config=relaxed,
                   max_tokens=MAX_TOKENS, samples=N)
    print("\n" + report.render())
    assert not report.passed
    assert report.stats[0].tv_distance > 3 * report.stats[0].tv_noise
    assert "acceptance=relaxed" in report.render() and "lossy" in report.render()


# --- the two-sample fallback ------------------------------------------------------------------------------
def test_two_sample_fallback_passes_the_engine_and_fails_a_defect(monkeypatch):
    """With a forward budget too small for any exact law, each prompt is compared with as many plain-decoding
    samples (two-sample chi-square; 600 samples of each): the engine passes, accept-every-draft fails (p-values
    below 1e-30 here)."""
    report = _check("ngram", max_forwards=2, samples=600)
    assert report.passed, report.render()
    assert report.stats[0].fallback_prompts == [0, 1] and not report.stats[0].exact_prompts
    assert "plain samples each for prompts [0, 1]" in report.render()
    monkeypatch.setattr(verify, "acceptance_rates", lambda px, qx: torch.ones_like(px))
    report = _check("ngram", max_forwards=2, samples=600)
    assert not report.passed and report.stats[0].min_pvalue < 1e-10


# --- near-ties --------------------------------------------------------------------------------------------
class _FixedLogits:
    """A stand-in runner whose next-token logits are always `row` (check's _divergence reads only these)."""

    vocab_size = VOCAB
    device = torch.device("cpu")

    def __init__(self, row: list[float]):
        self.row = torch.tensor([row], dtype=torch.float32)

    def new_cache(self):
        return None

    def forward(self, cache, tokens, num_logits=1):
        return self.row


def test_near_tie_rule():
    """A gap of a few ulps of the logit is a near-tie; a gap of 1e-3 is one for bf16, not for float32."""
    assert near_tie_tolerance("bfloat16", 20.0) == pytest.approx(4 * 2 ** -7 * 20)
    assert near_tie_tolerance("float32", 20.0) == pytest.approx(64 * 2 ** -23 * 20)
    assert near_tie_tolerance("float32", 0.1) == near_tie_tolerance("float32", 1.0)  # at least the eps of 1
    llm = argparse.Namespace(target=_FixedLogits([10.0, 10.0 - 1e-3, 3.0, 10.0 - 2e-6]))
    greedy = SamplingParams(temperature=0)
    divergence = functools.partial(check_greedy._divergence, llm, [1, 2], [], params=greedy)
    assert divergence(spec=[0], plain=[3], position=0, dtype_name="float32").near_tie
    assert not divergence(spec=[0], plain=[1], position=0, dtype_name="float32").near_tie
    assert divergence(spec=[1], plain=[0], position=0, dtype_name="bfloat16").near_tie
    far = divergence(spec=[2], plain=[0], position=0, dtype_name="bfloat16")
    assert not far.near_tie and far.gap == pytest.approx(7.0)


def test_check_rejects_bad_arguments():
    llm = _llm("ngram")
    with pytest.raises(QuickdraftError, match="at least one prompt"):
        check(llm, [], SamplingParams())
    with pytest.raises(QuickdraftError, match="samples must be an integer >= 1"):
        check(llm, PROMPTS, SamplingParams(), samples=0)
    with pytest.raises(QuickdraftError, match="method 'none'"):
        check(llm, PROMPTS, SamplingParams(), speculative_config={"method": "none"})
    with pytest.raises(QuickdraftError, match="has no tokenizer"):
        check(llm, ["text"], SamplingParams())


# --- token trees ------------------------------------------------------------------------------------------
def _check_trees(method: str, monkeypatch, samples: int = N, **options):
    """check() with token trees of up to 6 nodes and depth 3 (K = 3), counting the trees verified."""
    config = {**_config(method), "tree": {"max_nodes": 6, "max_depth": 3}}
    llm = LLM(_models()[0], speculative_config=config, dtype="float32", device="cpu")
    from quickdraft.step import verification

    verified = []
    verify_tree_of = verification._tree_rejection_sampled

    def counting(seq, batch, processed, i):
        verified.append(batch.trees[i].num_nodes)
        return verify_tree_of(seq, batch, processed, i)

    monkeypatch.setattr(verification, "_tree_rejection_sampled", counting)
    report = check(llm, PROMPTS, SamplingParams(**SETTINGS["t0.7"]), max_tokens=MAX_TOKENS, samples=samples,
                   **options)
    return report, verified


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_check_passes_with_token_trees(method, monkeypatch):
    """Trees (several children per node: the draft model's draw and ranked tokens, ngram's continuations) verified by
    recursive rejection sampling pass the exact-law check, and trees were verified."""
    report, verified = _check_trees(method, monkeypatch)
    assert report.passed, report.render()
    assert len(verified) > 100 and max(verified) > 3, verified[:20]


def test_check_fails_with_token_trees_and_a_wrong_residual(monkeypatch):
    """A planted defect in tree verification: the residual after a rejected child is not reduced (max(0, r - q)
    skipped), so a rejected token may still be drawn. check must FAIL."""
    from quickdraft import verify_tree

    monkeypatch.setattr(verify_tree, "_next_residual", lambda residual, proposal: residual)
    report, verified = _check_trees("draft_model", monkeypatch)
    _fails_statistically(report)
    assert verified


def test_check_fails_when_a_drawn_childs_ranked_siblings_are_verified_as_draws(monkeypatch):
    """A planted defect in the draft model's sampled trees: each row's first child is drawn from q and the others
    ranked (DRAWN_FIRST), but the tree says all were drawn i.i.d. (IID), so the ranked siblings are accepted with
    min(1, r / q) as if q had proposed them: SpecInfer's rule where it is not exact. check must FAIL."""
    from quickdraft.drafts import draft_model
    from quickdraft.token_tree import ChildSelection, TokenTree

    def as_draws(tree, device, catch_up=0):
        proposal = tree_proposal(tree, device, catch_up)
        if proposal.tree is not None:
            proposal.tree = TokenTree.from_parents(proposal.tokens, proposal.tree.parents.tolist(), ChildSelection.IID)
        return proposal

    tree_proposal = draft_model.tree_proposal
    monkeypatch.setattr(draft_model, "tree_proposal", as_draws)
    # On a vocabulary of 4 the siblings are every other token and the defect moves the law by less than the
    # other planted ones: 3000 samples (at 1000 it failed at p ~ 1e-4, short of _fails_statistically's margin).
    report, verified = _check_trees("draft_model", monkeypatch, samples=3 * N)
    _fails_statistically(report)
    assert max(verified) > 1


# --- the command line -------------------------------------------------------------------------------------
@pytest.fixture
def tiny_cli(monkeypatch, tmp_path):
    """`quickdraft check` on the tiny target: quickdraft.LLM builds it whatever --model says (the draft config
    from the command line is kept, a draft model swapped for the tiny draft); prompts as token ids."""
    loaded = []

    def tiny_llm(model, speculative_config=None, **kwargs):
        config = dict(speculative_config)
        if config.get("method") == "draft_model":
            config["model"] = _models()[1]
        loaded.append(config)
        return LLM(_models()[0], speculative_config=config, dtype="float32", device="cpu")

    monkeypatch.setattr(quickdraft, "LLM", tiny_llm)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in PROMPTS) + "\n", encoding="utf-8")
    return str(prompts), loaded


def _cli(*argv: str) -> int:
    from quickdraft.cli import main

    return main(["check", *argv])


def test_cli_exit_status_and_report(tiny_cli, monkeypatch, capsys):
    """0 and a PASS report on the engine; 1 and a FAIL report with a planted defect; --k and --draft reach the
    speculative config (K fixed unless --adaptive)."""
    prompts, loaded = tiny_cli
    common = ["--prompts", prompts, "--model", "tiny", "--samples", str(N), "--max-tokens", str(MAX_TOKENS)]
    assert _cli(*common, "--draft", "ngram", "--k", "3") == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "1. greedy" in out and "chi-square p-values" in out
    assert loaded[-1] == {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}

    monkeypatch.setattr(verify, "residual_probs", lambda p, q, draft_tokens: p)
    assert _cli(*common, "--draft", "ngram", "--k", "3") == 1
    assert "verdict: FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("draft", ["ngram", "some/draft-model"])
def test_cli_checks_token_trees(tiny_cli, capsys, draft):
    """--tree reaches the speculative config, and tree verification of ngram's and a draft model's trees passes."""
    prompts, loaded = tiny_cli
    common = ["--prompts", prompts, "--model", "tiny", "--samples", str(N), "--max-tokens", str(MAX_TOKENS)]
    assert _cli(*common, "--draft", draft, "--k", "3", "--tree", "6,3") == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert loaded[-1]["tree"] == {"max_nodes": 6, "max_depth": 3}


def test_cli_speculative_config_and_json(tiny_cli, tmp_path, capsys):
    """--speculative-config (JSON text or a file) overrides --draft and --k; --json prints one object."""
    prompts, loaded = tiny_cli
    config = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False, "prompt_lookup_max": 3}
    common = ["--prompts", prompts, "--samples", "200", "--max-tokens", "8", "--temperature", "0"]
    assert _cli(*common, "--draft", "layers:1", "--speculative-config", json.dumps(config)) == 0
    assert loaded[-1] == config
    assert "sampled law: not tested (temperature 0" in capsys.readouterr().out
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    assert _cli(*common, "--speculative-config", str(path), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["speculative_config"]["num_speculative_tokens"] == 2
    assert _cli(*common, "--draft", "some/draft-model", "--k", "2", "--adaptive") == 0
    assert {k: v for k, v in loaded[-1].items() if k != "model"} == {"method": "draft_model",
                                                                       "num_speculative_tokens": 2, "adaptive": True}
    assert "draft draft_model" in capsys.readouterr().out


def test_cli_usage_errors(tiny_cli, tmp_path, capsys):
    """Bad input: one `error:` line and exit status 2, before any model loads."""
    prompts, loaded = tiny_cli
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    cases = [(["--prompts", str(tmp_path / "missing.txt")], "does not exist"),
             (["--prompts", str(empty)], "holds no prompts"),
             (["--prompts", prompts, "--top-p", "0"], "--top-p"),
             (["--prompts", prompts, "--speculative-config", "{not json"], "not valid JSON"),
             (["--prompts", prompts, "--speculative-config", "nowhere.json"], "is neither"),
             (["--prompts", prompts, "--draft", "none"], "nothing to check"),
             (["--prompts", prompts, "--alpha", "2"], "alpha")]
    for argv, message in cases:
        assert _cli(*argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (argv, err)
    assert not loaded

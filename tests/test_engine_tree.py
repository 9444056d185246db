"""Token trees through the engine (issue 25) on a tiny bf16 model on quickdraft's CPU kernels: greedy and
seeded output equal plain decoding's token for token at several batch sizes, the joint law of the first tokens
under unseeded tree verification is the target's (chi-square), the KV cache keeps exactly the committed path,
and the metrics count trees per depth.

The proposer here builds random trees (distinct children per node, DETERMINISTIC: chosen without looking at the
target's draws) and, for greedy and seeded runs, hides the plain output's next tokens among them at random
depths, so that long paths, side branches and rejections all occur."""

import itertools
from collections import Counter

import pytest
import torch

from conftest import tiny_llama16
from quickdraft.drafts.base import Proposal, Proposer, TreeSettings
from quickdraft.drafts.none import NoDraft
from quickdraft import engine as engine_module
from quickdraft.engine import Engine
from quickdraft.step import verification
from quickdraft.step.policy import SpeculationPolicy
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import cpu_linear
from quickdraft.models.factory import native_runner
from quickdraft.params import SamplingParams
from quickdraft.sampling import PenaltyHistory, process
from quickdraft.token_tree import ChildSelection, TokenTree
from test_engine import _chi_square_pvalue

pytestmark = pytest.mark.skipif(cpu_linear() is None, reason="the CPU kernels need AVX512-BF16")

# Parents of a tree of 12 nodes, depth 4 (-1: a child of the root).
N_SAMPLES = 4000
SHAPE = [-1, -1, -1, 0, 0, 1, 3, 3, 4, 6, 6, 9]


class RandomTreeProposer(Proposer):
    name = "random_tree"
    proposes_trees = True

    def __init__(self, vocab: int, seed: int, oracle: dict[int, list[int]] | None = None, hit: float = 0.7,
                 ranker=None):
        super().__init__()
        self.vocab, self.gen, self.oracle, self.hit = vocab, torch.Generator().manual_seed(seed), oracle, hit
        # ranker(output tokens) -> the target's probabilities there: children are then its most likely tokens
        # (a function of the context, as DETERMINISTIC children must be), the hardest case for a wrong rule.
        self.ranker = ranker
        self.budgets = []

    def propose(self, seq, k):
        return Proposal(torch.randint(0, self.vocab, (k,), generator=self.gen))

    def _tree(self, seq, budget):
        depth = []
        for p in SHAPE:
            depth.append(1 if p < 0 else depth[p] + 1)
        keep = [i for i in range(len(SHAPE)) if depth[i] <= budget.max_depth][:budget.max_nodes]
        parents = [-1 if SHAPE[i] < 0 else keep.index(SHAPE[i]) for i in keep]
        tokens = [0] * len(parents)
        children = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        for p, kids in sorted(children.items()):  # parents before children: a node's path is known
            if self.ranker is not None:
                path, node = [], p
                while node >= 0:
                    path.insert(0, tokens[node])
                    node = parents[node]
                ranked = self.ranker(tuple(seq.output_ids + path)).argsort(descending=True).tolist()
            else:
                ranked = torch.randperm(self.vocab, generator=self.gen).tolist()
            for i, t in zip(kids, ranked):
                tokens[i] = t
        truth = self.oracle.get(id(seq)) if self.oracle is not None else None
        if truth is not None:  # hide the plain output's tokens along one path, while a coin says so
            node, pos = -1, len(seq.output_ids)
            while node in children and pos < len(truth) and torch.rand((), generator=self.gen) < self.hit:
                kids = children[node]
                chosen = kids[int(torch.randint(0, len(kids), (), generator=self.gen))]
                clash = [i for i in kids if tokens[i] == truth[pos]]
                if clash:  # keep the children distinct: swap tokens
                    tokens[clash[0]] = tokens[chosen]
                tokens[chosen] = truth[pos]
                node, pos = chosen, pos + 1
        return TokenTree.from_parents(torch.tensor(tokens), parents, ChildSelection.DETERMINISTIC)

    def propose_tree_batch(self, seqs, budgets):
        self.budgets.extend(budgets)
        out = []
        for seq, budget in zip(seqs, budgets):
            tree = self._tree(seq, budget)
            out.append(Proposal(tree.tokens, None, tree=tree))
        return out


@pytest.fixture(scope="module")
def runner():
    return native_runner(tiny_llama16(seed=0).to(torch.bfloat16))


def _plain(runner, prompt, params, key=None, generator=None):
    engine = Engine(runner, NoDraft(), 0)
    seq = engine.new_sequence(prompt, params, generator, key)
    for _ in engine.run(seq):
        pass
    return seq.output_ids


def _run_batch(engine, seqs):
    active = list(seqs)
    while active:
        engine.step_batch(active)
        active = [s for s in active if not s.finished]


PROMPTS = [[5, 9, 3, 7, 5, 9, 3, 1, 2], [1, 2, 3, 4], [7] * 13, [11, 4, 11, 4, 11, 4, 8]]


@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0, repetition_penalty=1.3),
                                    dict(temperature=0.8, top_k=20, seed=7), dict(temperature=1.0, seed=3,
                                                                                 presence_penalty=0.4)],
                         ids=["greedy", "greedy-penalty", "seeded", "seeded-penalty"])
def test_tree_output_equals_plain_output(runner, batch, params):
    sp = SamplingParams(max_tokens=24, **params)
    vocab = runner.vocab_size
    prompts = PROMPTS[:batch]
    keys = [None if sp.seed is None else sp.seed + i for i in range(batch)]  # a request seed keys its noise
    expected = [_plain(runner, p, sp, key) for p, key in zip(prompts, keys)]
    oracle = {}
    proposer = RandomTreeProposer(vocab, seed=batch, oracle=oracle)
    engine = Engine(runner, proposer, 4, tree=TreeSettings(max_nodes=12, max_depth=4))
    seqs = [engine.new_sequence(p, sp, None, key) for p, key in zip(prompts, keys)]
    for seq, truth in zip(seqs, expected):
        oracle[id(seq)] = truth
    _run_batch(engine, seqs)
    assert [s.output_ids for s in seqs] == expected
    for seq in seqs:
        m = seq.metrics
        assert m.tree_steps > 0 and m.accepted_tokens > 0
        assert sum(m.accepted_path_lengths) == m.tree_steps
        # One token per target forward plus the accepted drafts; each target forward after the prompt's drafts.
        assert m.target_forwards + m.accepted_tokens == len(seq.output_ids)
        # The cache holds the committed history but its last token (the next step's root)
        assert seq.target_cache.token_ids == seq.token_ids[:len(seq.target_cache)]
        assert len(seq.target_cache) >= len(seq.token_ids) - 1
    assert all(b.max_depth <= 4 and b.max_nodes <= 12 for b in proposer.budgets)


@pytest.mark.parametrize("kind", ["native-float32", "hf-float32"])
def test_tree_output_equals_plain_output_on_the_torch_forwards(kind):
    """The same on the forwards that run on torch ops (the native layer loop in float32, the transformers
    runner): the tree's masks and positions there, greedy, two sequences."""
    from quickdraft.models.hf import HFRunner

    model = tiny_llama16(seed=0)
    runner = native_runner(model) if kind == "native-float32" else HFRunner(model)
    sp = SamplingParams(max_tokens=20, temperature=0)
    expected = [_plain(runner, p, sp) for p in PROMPTS[:2]]
    oracle = {}
    engine = Engine(runner, RandomTreeProposer(runner.vocab_size, 4, oracle), 4, tree=TreeSettings(12, 4))
    seqs = [engine.new_sequence(p, sp) for p in PROMPTS[:2]]
    oracle.update({id(seq): truth for seq, truth in zip(seqs, expected)})
    _run_batch(engine, seqs)
    assert [s.output_ids for s in seqs] == expected
    assert all(s.metrics.tree_steps > 0 and s.metrics.accepted_tokens > 0 for s in seqs)


def test_tree_steps_keep_the_cache_a_line_that_plain_decoding_continues(runner):
    """After tree steps the cache's keys are those of the committed tokens in a line: a forward on it gives
    bitwise the logits of a fresh cache fed the same history."""
    sp = SamplingParams(max_tokens=15, temperature=0)
    truth = _plain(runner, PROMPTS[0], sp)
    engine = Engine(runner, RandomTreeProposer(runner.vocab_size, 2, {}), 4, tree=TreeSettings(12, 4))
    seq = engine.new_sequence(PROMPTS[0], sp)
    engine.proposer.oracle[id(seq)] = truth
    for _ in range(4):
        engine.step(seq)
    cache = seq.target_cache
    fresh = runner.new_cache()
    runner.forward(fresh, torch.tensor(cache.token_ids), 1)
    probe = torch.tensor([3, 4])
    assert torch.equal(runner.forward(cache, probe, 2), runner.forward(fresh, probe, 2))


def _tiny_vocab_llama():
    """A kernel-sized Llama with a vocabulary of 6, so that the law of four tokens can be enumerated."""
    from conftest import _sharpen
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=6, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return _sharpen(LlamaForCausalLM(config).eval())


def _exact_law(runner, prompt, params, length):
    """P(y_1..y_length) under plain sampling from the runner, by enumeration (a tiny vocabulary), and the
    function giving the processed next-token probabilities after output tokens `prefix`."""
    vocab = runner.vocab_size
    memo = {}

    def probs(prefix):
        if prefix not in memo:
            logits = runner.forward(runner.new_cache(), torch.tensor(prompt + list(prefix)), 1).double()
            hist = PenaltyHistory(prompt, vocab, torch.device("cpu"))
            hist.append(list(prefix))
            seen, counts = hist.rows(torch.empty(0, dtype=torch.long), 1)
            memo[prefix] = process(logits, params, seen, counts)[0]
        return memo[prefix]

    law = {}
    for cell in itertools.product(range(vocab), repeat=length):
        p = 1.0
        for i in range(length):
            p *= probs(cell[:i])[cell[i]].item()
            if p == 0:
                break
        law[cell] = p
    return law, probs


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, frequency_penalty=0.5),
                                    dict(temperature=1.3, top_p=0.8, repetition_penalty=1.4)],
                         ids=["t1", "topk-freq", "topp-rep"])
def test_unseeded_tree_sampling_follows_the_target_law(params):
    assert _tree_law_pvalue(params) > 1e-4


def test_the_law_test_catches_a_residual_that_keeps_rejected_children(monkeypatch):
    """A planted defect: after a rejected child the residual is not reduced (max(0, r - q) skipped), so a
    rejected token can still be drawn. The same test must then fail."""
    from quickdraft import verify_tree

    monkeypatch.setattr(verify_tree, "_next_residual", lambda residual, proposal: residual)
    assert _tree_law_pvalue(dict(temperature=1.0)) < 1e-4


def _tree_law_pvalue(params):
    """The first four tokens of 4000 samples against the exact law of plain sampling: the prompt's step gives the
    first, one tree step of depth up to 2 (max_tokens leaves room for no more) and what follows give the rest
    (recursive rejection sampling over deterministic children). Seeds fixed; fails at p < 1e-4."""
    runner = native_runner(_tiny_vocab_llama().to(torch.bfloat16))
    n, length = N_SAMPLES, 4
    prompt = [1, 2, 3, 1]
    sp = SamplingParams(max_tokens=length, **params)
    law, probs = _exact_law(runner, prompt, sp, length)
    proposer = RandomTreeProposer(runner.vocab_size, seed=11, ranker=probs)
    engine = Engine(runner, proposer, 3, tree=TreeSettings(max_nodes=8, max_depth=3))
    gen = torch.Generator().manual_seed(2024)
    samples = Counter()
    trees = 0
    for _ in range(n // 200):  # 200 sequences a batch: each its own rows, verified with the shared generator
        seqs = [engine.new_sequence(prompt, sp, gen) for _ in range(200)]
        _run_batch(engine, seqs)
        samples.update(tuple(seq.output_ids) for seq in seqs)
        trees += sum(seq.metrics.tree_steps for seq in seqs)
    assert trees > 0
    return _chi_square_pvalue(samples, law, n)


def test_trees_refuse_relaxed_acceptance(runner):
    with pytest.raises(QuickdraftError, match="relaxed"):
        Engine(runner, RandomTreeProposer(8, 0), 4, relaxed_threshold=0.5, tree=TreeSettings())


def test_auto_trees_keep_their_chain_and_the_chosen_nodes_and_stay_exact(runner, monkeypatch):
    """"tree": "auto": the engine keeps each candidate tree's chain (its first-child path) and adds the best-first
    other nodes adaptive.choose_tree_nodes asks for (here forced to 3, then 0 on every third step: the chain
    alone); the output is still plain greedy's."""
    from quickdraft import adaptive

    calls = []

    def choose(chances, base_rows, costs, base_tokens, plain_rows):
        calls.append([len(c) for c in chances])
        return [0 if len(calls) % 3 == 0 else min(3, len(c)) for c in chances]

    monkeypatch.setattr(adaptive, "choose_tree_nodes", choose)
    monkeypatch.setattr(SpeculationPolicy, "choose_ks", lambda self, seqs, kinds: [4] * len(seqs))  # depth 4 every step
    candidates = []

    class ScoredTrees(RandomTreeProposer):
        def propose_tree_batch(self, seqs, budgets):
            out = super().propose_tree_batch(seqs, budgets)
            for p in out:  # deeper nodes score lower; among siblings the later ones
                p.scores = torch.tensor([0.9 ** int(d) - 0.01 * int(r) for d, r in zip(p.tree.depth, p.tree.sibling_rank)])
            candidates.extend(out)
            return out

    sp = SamplingParams(max_tokens=24, temperature=0)
    expected = _plain(runner, PROMPTS[0], sp)
    engine = Engine(runner, ScoredTrees(runner.vocab_size, 9, {}), 4, tree=TreeSettings(12, 4, auto=True))
    seq = engine.new_sequence(PROMPTS[0], sp)
    engine.proposer.oracle[id(seq)] = expected
    verified = []
    original = verification.verify_batch

    def spy(seqs, processed, batch, relaxed_threshold=None, target=None):
        verified.extend(tree for tree in batch.trees if tree is not None)
        return original(seqs, processed, batch, relaxed_threshold, target)

    monkeypatch.setattr(engine_module, "verify_batch", spy)
    _run_batch(engine, [seq])
    assert seq.output_ids == expected
    assert len(verified) == len(candidates) == len(calls) > 3
    assert max(max(c) for c in calls) == 7  # SHAPE's 11 nodes of depth <= 4 less the chain's 4

    def node_paths(tree, nodes):
        return {tuple(tree.path_tokens(n).tolist()) for n in nodes}

    for step, (tree, candidate) in enumerate(zip(verified, candidates), start=1):
        chain = candidate.tree.first_child_path()
        others = sorted((j for j in range(candidate.tree.num_nodes) if j not in chain),
                        key=lambda j: (-float(candidate.scores[j]), j))
        kept = chain + (others[:3] if step % 3 else [])
        assert node_paths(tree, range(tree.num_nodes)) == node_paths(candidate.tree, kept)
        assert [int(tree.tokens[n]) for n in tree.first_child_path()] == [int(candidate.tree.tokens[n]) for n in chain]


def test_auto_calibrates_a_trees_chain_and_its_branches_apart(runner, monkeypatch):
    """"tree": "auto" learns how the draft's scores compare with what is accepted for the chain (first-child path)
    and for the other nodes apart: here the chain always holds plain greedy's next tokens and the one branch never
    does, so only the chain's calibration gains accepted tokens, and the branch's falls below its prior."""
    from quickdraft import adaptive

    class RightChainWrongBranch(Proposer):
        name = "right_chain"
        proposes_trees = True

        def __init__(self, truth):
            super().__init__()
            self.truth = truth

        def propose(self, seq, k):
            return Proposal(torch.tensor(self.truth[len(seq.output_ids):][:k], dtype=torch.long))

        def propose_tree_batch(self, seqs, budgets):
            out = []
            for seq, budget in zip(seqs, budgets):
                line = self.truth[len(seq.output_ids):][:budget.max_depth]
                if not line:
                    out.append(Proposal.empty(seq.device))
                    continue
                parents = [-1] + list(range(len(line) - 1)) + [-1]  # the chain, then one sibling of its first node
                tokens = torch.tensor(line + [(line[0] + 1) % runner.vocab_size])
                tree = TokenTree.from_parents(tokens, parents, ChildSelection.DETERMINISTIC)
                scores = torch.tensor([0.9 ** (d + 1) for d in range(len(line))] + [0.5])
                out.append(Proposal(tokens, None, tree=tree, scores=scores))
            return out

    sp = SamplingParams(max_tokens=24, temperature=0)
    expected = _plain(runner, PROMPTS[0], sp)
    monkeypatch.setattr(SpeculationPolicy, "choose_ks", lambda self, seqs, kinds: [4] * len(seqs))
    engine = Engine(runner, RightChainWrongBranch(expected), 4, tree=TreeSettings(12, 4, auto=True))
    seq = engine.new_sequence(PROMPTS[0], sp)
    _run_batch(engine, [seq])
    assert seq.output_ids == expected
    parts = {part: calibration for (_, part), calibration in engine.policy.tree_calibration.items()}
    assert set(parts) == {"chain", "branch"}
    assert parts["chain"].accepted > adaptive.PRIOR_WEIGHT and parts["chain"].factor > 1.0  # 4 of 4 against 3.1
    assert parts["branch"].accepted < adaptive.PRIOR_WEIGHT and parts["branch"].factor < 1.0  # never accepted

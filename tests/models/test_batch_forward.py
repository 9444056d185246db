"""One target forward over many sequences (the decoder runners' forward_batch, HFRunner.forward_batch).

On the CPU kernels (bf16) a token's row is computed alike whatever the other rows of a call, so a batch of
sequences in prefill, decoding and verification gives bitwise the logits and cache contents of each sequence
run alone; in float32 (torch matmuls, not row-invariant) they agree to rounding."""

import pytest
import torch

from conftest import tiny_gemma16, tiny_llama, tiny_llama16, tiny_qwen2
from quickdraft.cache import SequenceCache
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import cpu_linear
from quickdraft.models.hf import HFRunner
from quickdraft.models.cuda_runner import CudaRunner
from quickdraft.models.factory import native_runner
from quickdraft.models.torch_runner import TorchRunner
from quickdraft.sampling import argmax_rows

needs_kernels = pytest.mark.skipif(cpu_linear() is None, reason="quickdraft's CPU kernels need AVX512-BF16")
BUILDS = {"llama16": tiny_llama16, "gemma16": tiny_gemma16, "qwen2": tiny_qwen2}  # gemma16: sliding window 4


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def _steps(long: int, medium: int) -> list:
    """Steps of a continuous batch of 4 sequences: (rollbacks {sequence: positions dropped before the step},
    feeds [(sequence, new tokens, num_logits)]), in the order the batch lists them."""
    return [
        ({}, [(0, long, 1), (1, 9, 9)]),  # a long prompt (prefill), a short one with every row's logits
        ({}, [(0, 1, 1), (1, 5, 5), (2, medium, 1)]),  # decoding, verifying K+1 = 5, a third prompt
        ({1: 3}, [(0, 5, 5), (1, 1, 1), (2, 1, 1), (3, 2, 0)]),  # drafts rejected; a prompt chunk without logits
        ({0: 2, 2: 4}, [(2, 5, 5), (3, 3, 2), (0, 1, 1), (1, 5, 5)]),  # not in cache order
        ({3: 1, 1: 4}, [(1, 1, 1), (3, 5, 5), (0, 5, 5)]),  # sequence 2 sits this step out
        ({}, [(i, 1, 1) for i in range(4)]),  # all decoding
        ({0: 3, 3: 2}, [(3, 5, 5), (0, 4, 4)]),
    ]


# Dense weights: prompts of 45 and 30 tokens (steps of 54 and 36 rows). int8 linear layers are row-invariant
# below 32 rows only (from 32 rows cpu_linear.cpp multiplies on AMX tiles), so int8 steps stay under 32 rows.
DENSE_STEPS, INT8_STEPS = _steps(45, 30), _steps(21, 17)


def _contents(cache):
    """Token ids, keys [layers, Hkv, len, d] and values [layers, Hkv, len, d] of the cached positions."""
    n, keys = len(cache), cache.keys
    if keys.dim() == 6:  # packed for the kernels: [layers, Hkv, cap/16, d/2, 16, 2]
        layers, heads, blocks, half, _, _ = keys.shape
        keys = keys.permute(0, 1, 2, 4, 3, 5).reshape(layers, heads, blocks * 16, half * 2)
    return cache.token_ids, keys[:, :, :n], cache.values[:, :, :n]


def _run_steps(runner, steps, compare, use_decoder=True):
    """Each step as one forward_batch on one set of caches and as forward per sequence on another (fed the
    same history); `compare` checks the logits and the caches' contents after every step."""
    count = 1 + max(i for _, feeds in steps for i, _, _ in feeds)
    batched = [runner.new_cache() for _ in range(count)]
    alone = [runner.new_cache() for _ in range(count)]
    generator = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    for rollbacks, feeds in steps:
        for i, dropped in rollbacks.items():
            length = len(alone[i]) - dropped
            batched[i].rollback(length)
            alone[i].rollback(length)
        tokens = [torch.randint(0, vocab, (n,), generator=generator) for _, n, _ in feeds]
        forwards = runner.forwards
        options = {} if use_decoder else {"use_decoder": False}  # (a CPU-kernel runner's option)
        logits = runner.forward_batch([batched[i] for i, _, _ in feeds], tokens, [k for _, _, k in feeds], **options)
        assert runner.forwards == forwards + 1  # one model call for the whole batch
        expected = torch.cat([runner.forward(alone[i], ids, k) for (i, _, k), ids in zip(feeds, tokens)])
        assert logits.shape == (sum(k for _, _, k in feeds), vocab) and logits.dtype == torch.float32
        compare(logits, expected)
        for a, b in zip(batched, alone):
            assert a.token_ids == b.token_ids
            if len(a):
                for x, y in zip(_contents(a)[1:], _contents(b)[1:]):
                    compare(x, y)


def _bitwise(a, b):
    assert torch.equal(a, b)


def _view(runner, view):
    return {"full": runner, "truncated": runner.truncated(2), "int8": runner.quantized("int8")}[view]


@needs_kernels
@pytest.mark.parametrize("view", ["full", "truncated", "int8"])
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_bf16_batch_is_bitwise_each_sequence_alone(name, view):
    runner = _view(native_runner(BUILDS[name]().to(torch.bfloat16)), view)
    assert runner.decoder() is not None  # the C++ layer loop
    steps = INT8_STEPS if view == "int8" else DENSE_STEPS
    _run_steps(runner, steps, _bitwise)
    # The same batches through the Python layer loop on the same kernels: the same bits.
    _run_steps(runner, steps, _bitwise, use_decoder=False)


@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.parametrize("backend", ["torch", "static"])
def test_float32_batch_matches_each_sequence_alone(name, backend):
    """The torch reference runner, and the CUDA runner's static path (run eagerly on the CPU: rows padded to
    buckets, masks built on the device)."""
    runner = native_runner(BUILDS[name]())
    assert isinstance(runner, TorchRunner)  # the Python loop on torch ops
    if backend == "static":
        runner = CudaRunner(runner.weights)

    def close(a, b):
        if a.dtype.is_floating_point:  # torch's matmuls round a row differently with the number of rows
            torch.testing.assert_close(a, b, atol=2e-5 * max(1.0, b.abs().max().item()), rtol=1e-5)
        else:
            assert torch.equal(a, b)

    _run_steps(runner, DENSE_STEPS, close)
    _run_steps(runner.truncated(2), DENSE_STEPS, close)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_batch_matches_each_sequence_alone(dtype):
    runner = native_runner(tiny_gemma16().to("cuda", dtype))
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2

    def close(a, b):
        if a.dtype.is_floating_point:
            scale = max(1.0, b.abs().max().item())
            torch.testing.assert_close(a.float(), b.float(), atol=tolerance * scale, rtol=tolerance)
        else:
            assert torch.equal(a, b)

    _run_steps(runner, DENSE_STEPS, close)


def test_linear_layers_take_every_row_of_the_batch_at_once():
    runner = native_runner(tiny_llama16())  # float32: the Python loop, whose calls can be watched
    seen: dict[str, list[int]] = {"qkv": [], "gate_up": [], "lm_head": []}

    class Watch:
        def __init__(self, linear, name):
            self.linear, self.name = linear, name

        def __call__(self, x, **options):  # options: the output head's float_output
            seen[self.name].append(x.shape[0])
            return self.linear(x, **options)

    layer = runner.weights.layers[1]
    layer.qkv, layer.gate_up = Watch(layer.qkv, "qkv"), Watch(layer.gate_up, "gate_up")
    runner.weights.lm_head = Watch(runner.weights.lm_head, "lm_head")
    caches = [runner.new_cache() for _ in range(3)]
    tokens = [torch.arange(n) for n in (7, 1, 5)]
    logits = runner.forward_batch(caches, tokens, [1, 1, 5])
    assert logits.shape == (7, runner.vocab_size)
    # One call per layer over all 13 rows; the output head only on the 7 rows whose logits are wanted.
    assert seen == {"qkv": [13], "gate_up": [13], "lm_head": [7]}
    assert [len(c) for c in caches] == [7, 1, 5]


def _argmax_runner(kind: str):
    if kind == "hf":
        return HFRunner(tiny_llama())
    if kind in ("torch", "static"):
        runner = native_runner(tiny_llama())
        return runner if kind == "torch" else CudaRunner(runner.weights)
    runner = native_runner(tiny_gemma16().to(torch.bfloat16))  # the CPU kernels
    return {"kernels": runner, "q4": runner.quantized("q4"), "int8": runner.quantized("int8"),
            "vocab": runner.quantized("q4").with_vocabulary(21)}[kind]


@pytest.mark.parametrize("kind", ["kernels", "q4", "int8", "vocab", "torch", "static", "hf"])
def test_argmax_only_is_the_argmax_of_the_logits_and_caches_the_same(kind):
    """forward_batch(argmax_only=True) (what a step verified greedily asks for; the CPU kernels' output layer gives
    it without writing the logits) returns argmax_rows of the logits the same call gives, and fills the caches
    alike, step after step with rollbacks."""
    if kind in ("kernels", "q4", "int8", "vocab") and cpu_linear() is None:
        pytest.skip("quickdraft's CPU kernels need AVX512-BF16")
    runner = _argmax_runner(kind)
    steps = INT8_STEPS if kind == "int8" else DENSE_STEPS
    count = 1 + max(i for _, feeds in steps for i, _, _ in feeds)
    greedy, full = [runner.new_cache() for _ in range(count)], [runner.new_cache() for _ in range(count)]
    generator = torch.Generator().manual_seed(1)
    for rollbacks, feeds in steps:
        for i, dropped in rollbacks.items():
            for caches in (greedy, full):
                caches[i].rollback(len(caches[i]) - dropped)
        tokens = [torch.randint(0, runner.vocab_size, (n,), generator=generator) for _, n, _ in feeds]
        wanted = [k for _, _, k in feeds]
        argmax = runner.forward_batch([greedy[i] for i, _, _ in feeds], tokens, wanted, argmax_only=True)
        logits = runner.forward_batch([full[i] for i, _, _ in feeds], tokens, wanted)
        assert argmax.dtype == torch.long and argmax.shape == (sum(wanted),)
        assert torch.equal(argmax, argmax_rows(logits))
        assert [c.token_ids for c in greedy] == [c.token_ids for c in full]


def test_hf_runner_batch_is_its_forward_per_sequence():
    model = tiny_llama()
    runner = HFRunner(model)
    batched, alone = [SequenceCache() for _ in range(3)], [SequenceCache() for _ in range(3)]
    generator = torch.Generator().manual_seed(0)
    steps = [([(0, 9, 1), (1, 4, 4), (2, 6, 0)], {}), ([(0, 5, 5), (1, 1, 1), (2, 3, 2)], {1: 2, 0: 1}),
             ([(2, 1, 1), (0, 5, 5)], {})]
    for feeds, rollbacks in steps:
        tokens = [torch.randint(0, 32, (n,), generator=generator) for _, n, _ in feeds]
        logits = runner.forward_batch([batched[i] for i, _, _ in feeds], tokens, [k for _, _, k in feeds])
        expected = [runner.forward(alone[i], ids, max(k, 1)) for (i, _, k), ids in zip(feeds, tokens)]
        expected = torch.cat([rows[rows.shape[0] - k:] for rows, (_, _, k) in zip(expected, feeds)])  # k = 0: none
        assert logits.shape == (sum(k for _, _, k in feeds), runner.vocab_size)
        assert torch.equal(logits, expected)
        assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
        for i, dropped in rollbacks.items():
            for caches in (batched, alone):
                caches[i].rollback(len(caches[i]) - dropped)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_bad_batches_are_refused_before_any_cache_changes(kind):
    model = tiny_llama(max_len=32)
    runner = native_runner(model) if kind == "native" else HFRunner(model)
    a, b = runner.new_cache(), runner.new_cache()
    runner.forward(a, torch.arange(4), 1)
    cases = [
        (([a, b], [torch.arange(2)], [1, 1]), "one token tensor and one num_logits per cache"),
        (([a, b], [torch.arange(2), torch.arange(2)], [1]), "one token tensor and one num_logits per cache"),
        (([], [], []), "at least one sequence"),
        (([a, b], [torch.arange(2), torch.arange(0)], [1, 0]), r"no tokens to append \(sequence 1 of the batch\)"),
        (([a, b], [torch.arange(2), torch.arange(3)], [1, 4]), r"num_logits 4 of a sequence of 3 new tokens"),
        (([a, b], [torch.arange(2), torch.arange(3)], [-1, 1]), r"num_logits -1 .* must be in \[0, 2\]"),
        (([a, a], [torch.arange(2), torch.arange(3)], [1, 1]), "the same cache twice"),
        (([b, a], [torch.arange(3), torch.arange(29)], [1, 1]),
         r"sequence of 33 tokens exceeds the context of 32 \(sequence 1 of the batch\)"),
        (([a], [torch.arange(29)], [1]), "sequence of 33 tokens exceeds the context of 32; shorten"),
    ]
    for args, message in cases:
        with pytest.raises(QuickdraftError, match=message):
            runner.forward_batch(*args)
        assert a.token_ids == [0, 1, 2, 3] and len(b) == 0  # nothing appended, to any sequence
    # And a good batch still runs after them.
    assert runner.forward_batch([a, b], [torch.arange(2), torch.arange(3)], [2, 0]).shape == (2, runner.vocab_size)

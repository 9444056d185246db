"""An output layer's argmax without its logits (kernels/cpu_quant.cpp's linear_quant_argmax, Linear.argmax): each
row's first index of its largest logit, bitwise that of the logits linear_quant writes, whatever the kernel, the
rows, the blocks of columns the kernel reduces a thread's range in and the threads; ties go to the first column,
and a row holding a NaN is left to torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft import kernels
from quickdraft.kernels import quant
from quickdraft.models.linear import BlockLinear, DenseLinear
from quickdraft.sampling import argmax_rows
from tests.models.test_quant_kernels import TYPES, kernel, random_blocks

needs_kernels = pytest.mark.skipif(kernels.cpu_linear() is None, reason="needs quickdraft's AVX512-BF16 kernels")
# the quantized kernels that run on CPUs without AMX (test_quant_kernels.py's KERNELS less the tile variants)
KERNELS = ["bf16", "int8", "int8x32", "int16"]
ROWS = (1, 2, 7, 16, 17, 33, 64)
OUTPUTS, COLS = 2085, 256  # 131 groups of 16, the last 5 outputs real; one or several blocks of every type a row


@pytest.fixture
def two_threads():
    """Two threads: each reduces its half of the columns, and the halves merge."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def tied_head(qtype: int, seed: int) -> tuple[np.ndarray, list[list[int]]]:
    """GGUF bytes of an [OUTPUTS, COLS] weight in which groups of columns share one weight row of larger scales
    (bitwise tied logits): each group a column either side of a boundary of 4 groups of 16 (where the kernel's
    blocks of columns and the threads' ranges begin), and one group far apart (the two threads' halves)."""
    raw = random_blocks(qtype, OUTPUTS, COLS, seed=seed)
    spare = random_blocks(qtype, 40, COLS, seed=seed + 1)
    # their blocks' float16 scale d is +-0.1 (the others' 0.01 N(0, 1)): a row along one has its largest logit there
    block, size = quant.LAYOUT[qtype][:2]
    d = 208 if qtype == quant.Q6_K else 0
    scales = spare.reshape(40, COLS // block, size)[..., d:d + 2]  # a view: writes go to spare
    scales[:] = (np.sign(scales.copy().view(np.float16)) * 0.1).astype(np.float16).view(np.uint8)
    ties = [[64 * j - 1, 64 * j] for j in range(1, 33)] + [[100, 1900, 2084]]
    for source, columns in zip(spare, ties):
        raw[columns] = source
    return raw, ties


def aligned_rows(w: torch.Tensor, ties: list[list[int]], m: int, seed: int) -> torch.Tensor:
    """m rows of x, row i at a right angle to every tied weight row but that of ties[i % len(ties)] (whose logit is
    then the row's largest)."""
    generator = torch.Generator().manual_seed(seed)
    sources = torch.stack([w[columns[0]] for columns in ties]).double()
    along = torch.linalg.pinv(sources).T.float()  # row i: sources @ along[i] = e_i
    rows = along[torch.arange(m) % len(ties)]
    x = rows / rows.norm(dim=1, keepdim=True) * 4 + 0.01 * torch.randn(m, w.shape[1], generator=generator)
    return x * torch.exp(torch.randn(m, 1, generator=generator))  # rows of other magnitudes


def dequantized(raw: np.ndarray, qtype: int) -> torch.Tensor:
    import gguf

    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(raw.shape[0], -1)
    return torch.from_numpy(w).float()


@needs_kernels
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16 x", "float32 x"])
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("qtype", TYPES, ids=[quant.NAMES[t] for t in TYPES])
def test_the_argmax_is_that_of_the_logits_bitwise_and_ties_go_to_the_first(qtype, name, x_dtype, two_threads):
    raw, ties = tied_head(qtype, seed=11)
    packed = quant.pack(quant.decode(raw, qtype, COLS))
    w = dequantized(raw, qtype)
    with kernel(name) as module:
        for m in ROWS:
            x = aligned_rows(w, ties, m, seed=m).to(x_dtype)
            logits = module.linear_quant(x, [packed.packed], [qtype], True)[:, :OUTPUTS].contiguous()
            expected, nan = module.rows_argmax(logits)
            assert not nan
            first = torch.tensor([ties[i % len(ties)][0] for i in range(m)])
            assert torch.equal(expected, first), m  # the planted ties are each row's maximum
            for i in range(m):
                columns = ties[i % len(ties)]
                assert (logits[i, columns] == logits[i].max()).all()
            index, nan = module.linear_quant_argmax(x, [packed.packed], [qtype], "", OUTPUTS)
            assert not nan and index.dtype == torch.int64
            assert torch.equal(index, expected), m
            # fewer valid columns: the ones past are ignored, those of the last group's padding included
            index, _ = module.linear_quant_argmax(x, [packed.packed], [qtype], "", 1000)
            assert torch.equal(index, module.rows_argmax(logits[:, :1000].contiguous())[0]), m


@needs_kernels
@pytest.mark.parametrize("name", KERNELS)
def test_random_logits_of_fused_parts_give_the_argmax_of_the_logits(name, two_threads):
    """Parts of different types side by side (a block of columns may span two) and random rows, one thread and
    two."""
    parts = [quant.pack(quant.decode(random_blocks(t, n, COLS, seed=5), t, COLS))
             for t, n in ((quant.Q6_K, 512), (quant.Q8_0, 48), (quant.Q4_K, 1040), (quant.Q5_0, 333))]
    packed, types = [p.packed for p in parts], [p.qtype for p in parts]
    outputs = sum(p.rows for p in parts)
    torch.manual_seed(4)
    with kernel(name) as module:
        for m in ROWS:
            x = torch.randn(m, COLS)
            logits = module.linear_quant(x, packed, types, True)[:, :outputs].contiguous()
            for threads in (1, 2):
                torch.set_num_threads(threads)
                index, nan = module.linear_quant_argmax(x, packed, types, "", outputs)
                assert not nan and torch.equal(index, logits.argmax(1)), (m, threads)


@needs_kernels
@pytest.mark.parametrize("name", KERNELS)
def test_a_nan_is_reported_and_the_layer_gives_torchs_answer(name, two_threads):
    """A NaN among a row's logits (from an infinite activation, or a NaN scale in the weights): the kernel says so
    and Linear.argmax falls back to the logits and torch's argmax, which takes the NaN for the maximum."""
    qtype = quant.Q8_0
    raw = random_blocks(qtype, 300, COLS, seed=9)
    torch.manual_seed(6)
    x = torch.randn(17, COLS)
    with kernel(name) as module:
        head = BlockLinear([quant.pack(quant.decode(raw, qtype, COLS))])
        x_inf = x.clone()
        x_inf[5, 3] = float("inf")
        logits = head(x_inf, float_output=True)
        assert logits[5].isnan().any() and not logits[:5].isnan().any()
        assert module.linear_quant_argmax(x_inf, head._packed, head._types, "", 300)[1]
        assert torch.equal(head.argmax(x_inf), logits.argmax(1))

        nan_scale = raw.copy()
        nan_scale[211, 34:36] = np.array([np.nan], np.float16).view(np.uint8)  # the second block's float16 scale
        head = BlockLinear([quant.pack(quant.decode(nan_scale, qtype, COLS))])
        logits = head(x, float_output=True)
        assert logits[:, 211].isnan().all()
        assert torch.equal(head.argmax(x), logits.argmax(1)) and (head.argmax(x) == 211).all()


@needs_kernels
@pytest.mark.parametrize("name", KERNELS)
def test_the_layer_and_its_leading_views_give_the_argmax_of_their_logits(name, two_threads):
    """BlockLinear.argmax (the fused kernel) equals argmax_rows of the layer's own float32 outputs, for the layer, a
    fused one, its leading(n) views (n not a multiple of 16: the last group's other outputs are ignored) and inputs
    of more dimensions; with a bias it takes the logits' way."""
    raw, ties = tied_head(quant.Q4_K, seed=3)
    head = BlockLinear([quant.pack(quant.decode(raw, quant.Q4_K, COLS))])
    fused = BlockLinear([quant.pack(quant.decode(random_blocks(t, n, COLS, seed=8), t, COLS))
                         for t, n in ((quant.Q4_0, 64), (quant.Q6_K, 997))])
    w = dequantized(raw, quant.Q4_K)
    with kernel(name):
        for m in ROWS:
            x = aligned_rows(w, ties, m, seed=m)
            for layer in (head, head.leading(1000), head.leading(64 * 20 - 1), head.leading(1), fused,
                          fused.leading(70)):
                assert torch.equal(layer.argmax(x), argmax_rows(layer(x, float_output=True))), (m, layer.out_features)
        x = aligned_rows(w, ties, 12, seed=1).reshape(3, 4, COLS)
        assert head.argmax(x).shape == (3, 4)
        assert torch.equal(head.argmax(x), head(x, float_output=True).argmax(-1))
        biased = BlockLinear(head.parts, torch.randn(OUTPUTS))
        assert torch.equal(biased.argmax(x), (head(x, float_output=True) + biased.bias).argmax(-1))


@needs_kernels
def test_a_module_without_the_fused_kernel_takes_the_logits_way():
    """AVX2's module (float32 activations) has linear_quant alone: the layer's argmax is that of its logits."""

    class LogitsOnly:
        def __init__(self, module):
            self.linear_quant = module.linear_quant

    head = BlockLinear([quant.pack(quant.decode(random_blocks(quant.Q4_1, 100, COLS, seed=2), quant.Q4_1, COLS))])
    head._quant = LogitsOnly(kernels.cpu_linear())
    x = torch.randn(9, COLS)
    assert torch.equal(head.argmax(x), head(x, float_output=True).argmax(1))


def test_a_dense_layer_gives_the_argmax_of_its_outputs():
    torch.manual_seed(7)
    layer = DenseLinear(torch.randn(37, 64).bfloat16())
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(layer.argmax(x), layer(x, float_output=True).float().argmax(1))


@needs_kernels
def test_bad_valid_columns_are_refused():
    module = kernels.cpu_linear()
    packed = quant.pack(quant.decode(random_blocks(quant.Q4_0, 20, 64), quant.Q4_0, 64))
    for bad in (0, 33):
        with pytest.raises(RuntimeError, match="valid_columns must be in 1..32"):
            module.linear_quant_argmax(torch.randn(2, 64), [packed.packed], [quant.Q4_0], "", bad)
    index, nan = module.linear_quant_argmax(torch.randn(0, 64), [packed.packed], [quant.Q4_0], "", 20)
    assert index.shape == (0,) and not nan

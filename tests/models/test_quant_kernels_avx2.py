"""The AVX2 quantized kernels (kernels/cpu_quant_avx2.cpp), on every x86 CPU with AVX2 (AVX-512 ones included, so
that CI tests them on any machine): the layout read back, each type against a float64 product of the activations
as the kernel quantizes them, bitwise row invariance, fused parts, and where the CPU also runs the AVX-512 VNNI
kernels, the same bits as their int8x32 scheme (two implementations of one computation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft import kernels
from quickdraft.kernels import quant
from tests.models.test_quant_kernels import TYPES, integer_reference, kernel, random_blocks, shapes

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(kernels.cpu_quant_avx2() is None, reason="needs an x86 CPU with AVX2, FMA, F16C")]
IDS = [quant.NAMES[t] for t in TYPES]


def dequantized(raw: np.ndarray, qtype: int, rows: int, cols: int) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_the_packed_layout_reads_back_bitwise(qtype):
    module = kernels.cpu_quant_avx2()
    for rows, cols in shapes(qtype):
        raw = random_blocks(qtype, rows, cols, seed=1)
        packed = quant.pack(quant.decode(raw, qtype, cols))
        np.testing.assert_array_equal(module.dequantize_rows(packed.packed, qtype, torch.arange(rows), cols).numpy(),
                                      dequantized(raw, qtype, rows, cols).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_linear_kernel_against_float64(qtype, dtype):
    module = kernels.cpu_quant_avx2()
    torch.manual_seed(0)
    for rows, cols in shapes(qtype):
        raw = random_blocks(qtype, rows, cols, seed=2)
        w = dequantized(raw, qtype, rows, cols)
        packed = quant.pack(quant.decode(raw, qtype, cols))
        x = torch.randn(9, cols).to(dtype)
        x[3] *= 1e-3  # a row of another magnitude (each row has its own scales)
        x[5, 7] *= 60  # an outlier: its 32 get a coarser scale, the others keep theirs
        y = module.linear_quant(x, [packed.packed], [qtype], False)
        assert y.dtype == dtype and y.shape == (9, -(-rows // 16) * 16)
        exact, magnitude = integer_reference(x, w, qtype, "int8x32")
        # float32 (bf16) output, plus float32 summation over the blocks (relative to sum |s v| |w|)
        rounding = 2.0 ** -22 if dtype == torch.float32 else 2.0 ** -8
        bound = exact.abs() * rounding + magnitude * 1e-6
        error = (y[:, :rows].double() - exact).abs()
        assert (error <= bound).all(), error.max()


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_the_largest_codes_times_the_largest_activations_do_not_overflow(qtype):
    """vpmaddubsw adds pairs in int16 with saturation and the kernel adds several of its results before widening:
    every code at its largest (Q8_0's at -128) times every activation at +-127 is the worst case of each type."""
    module = kernels.cpu_quant_avx2()
    rows, cols = 32, quant.LAYOUT[qtype][0] * 2
    raw = random_blocks(qtype, rows, cols, seed=5)
    scales = raw.copy()
    raw[:] = 0x80 if qtype == quant.Q8_0 else 0xFF
    fields = {quant.Q4_0: [(0, 2)], quant.Q5_0: [(0, 2)], quant.Q5_1: [(0, 4)], quant.Q8_0: [(0, 2)], quant.Q4_1: [(0, 4)],
              quant.Q4_K: [(0, 4)], quant.Q5_K: [(0, 4)], quant.Q6_K: [(208, 210)]}[qtype]
    block, size = quant.LAYOUT[qtype][:2]
    per_block = raw.reshape(rows, cols // block, size)
    for lo, hi in fields:  # the float16 scales (and mins) stay valid numbers
        per_block[..., lo:hi] = scales.reshape(rows, cols // block, size)[..., lo:hi]
    w = dequantized(raw, qtype, rows, cols)
    packed = quant.pack(quant.decode(raw, qtype, cols))
    x = torch.ones(2, cols)
    x[1] = -1.0
    exact, magnitude = integer_reference(x, w, qtype, "int8x32")
    y = module.linear_quant(x, [packed.packed], [qtype], True).double()
    assert ((y - exact).abs() <= exact.abs() * 2.0 ** -22 + magnitude * 1e-6).all()


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_rows_are_computed_alike_whatever_the_call(qtype):
    """A row's outputs are bitwise the same alone, among 2..64 rows (tiles of 1-4 rows), and with two threads."""
    module = kernels.cpu_quant_avx2()
    block = quant.LAYOUT[qtype][0]
    rows, cols = 80, 2 * block
    packed = quant.pack(quant.decode(random_blocks(qtype, rows, cols, seed=3), qtype, cols))
    torch.manual_seed(1)
    x = torch.randn(100, cols)
    x[::7] *= 30  # rows of other magnitudes
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        everything = module.linear_quant(x, [packed.packed], [qtype], True)
        torch.set_num_threads(1)
        alone = torch.cat([module.linear_quant(x[i:i + 1].contiguous(), [packed.packed], [qtype], True)
                           for i in range(100)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(everything, alone)
    for m in list(range(2, 10)) + [13, 23, 64]:
        assert torch.equal(module.linear_quant(x[7:7 + m].contiguous(), [packed.packed], [qtype], True), alone[7:7 + m])


def test_fused_parts_of_different_types_equal_their_separate_products():
    module = kernels.cpu_quant_avx2()
    cols = 256
    parts = [quant.pack(quant.decode(random_blocks(t, n, cols, seed=4), t, cols))
             for t, n in ((quant.Q5_0, 32), (quant.Q8_0, 48), (quant.Q4_K, 16), (quant.Q6_K, 21))]
    x = torch.randn(6, cols)
    fused = module.linear_quant(x, [p.packed for p in parts], [p.qtype for p in parts], False)
    separate = torch.cat([module.linear_quant(x, [p.packed], [p.qtype], False) for p in parts], dim=1)
    assert torch.equal(fused, separate)
    # bf16 activations give float32 logits when asked, bf16 otherwise: the same sums before their rounding
    xb = x.bfloat16()
    logits = module.linear_quant(xb, [p.packed for p in parts], [p.qtype for p in parts], True)
    assert logits.dtype == torch.float32
    assert torch.equal(module.linear_quant(xb, [p.packed for p in parts], [p.qtype for p in parts], False),
                       logits.bfloat16())


@pytest.mark.skipif(kernels.cpu_linear() is None or "avx512_vnni" not in open("/proc/cpuinfo").read(),
                    reason="needs the AVX512-VNNI kernels to compare with")
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_the_bits_of_the_vnni_int8x32_kernel(qtype):
    """Where both build, the AVX2 kernel and cpu_quant_vnni.cpp's int8x32 compute the same float32 outputs from the
    same bf16 rows: the same integer dots and the same float finish, op for op."""
    block = quant.LAYOUT[qtype][0]
    packed = quant.pack(quant.decode(random_blocks(qtype, 48, 2 * block, seed=9), qtype, 2 * block))
    torch.manual_seed(4)
    x = torch.randn(11, 2 * block).bfloat16()
    x[::3] *= 20
    avx2 = kernels.cpu_quant_avx2().linear_quant(x, [packed.packed], [qtype], True)
    with kernel("int8x32/vpdpbusd") as module:
        vnni = module.linear_quant(x, [packed.packed], [qtype], True)
    assert torch.equal(avx2, vnni)


def test_the_scheme_is_int8x32_and_bad_input_is_refused():
    module = kernels.cpu_quant_avx2()
    assert module.quant_kernel() == "int8x32" and module.set_quant_kernel("int8x32") == "int8x32"
    with pytest.raises(RuntimeError, match="needs AVX-512"):
        module.set_quant_kernel("int16")
    packed = quant.pack(quant.decode(random_blocks(quant.Q4_0, 16, 64), quant.Q4_0, 64))
    with pytest.raises(RuntimeError, match="must be"):
        module.linear_quant(torch.randn(2, 96), [packed.packed], [quant.Q4_0], False)  # K mismatch
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        module.linear_quant(torch.randn(2, 64).double(), [packed.packed], [quant.Q4_0], False)
    with pytest.raises(RuntimeError, match="unsupported quantization type"):
        module.linear_quant(torch.randn(2, 64), [packed.packed], [11], False)  # Q3_K
    with pytest.raises(RuntimeError, match="out of range"):
        module.dequantize_rows(packed.packed, quant.Q4_0, torch.tensor([16]), 64)
    assert module.linear_quant(torch.randn(0, 64), [packed.packed], [quant.Q4_0], False).shape == (0, 16)


def test_the_avx2_kernels_run_models_only_when_asked(monkeypatch):
    """quant_kernels() hands out the AVX2 module only with QUICKDRAFT_AVX2_KERNELS=1 (and never where AVX-512's
    loads, whose module takes float32 activations too): by default a float32 model on an AVX2-only CPU keeps
    torch's dense weights, its greedy speculative output as before."""
    avx512 = kernels.cpu_linear()
    monkeypatch.delenv("QUICKDRAFT_AVX2_KERNELS", raising=False)
    assert kernels.quant_kernels(torch.float32) is avx512
    monkeypatch.setenv("QUICKDRAFT_AVX2_KERNELS", "1")
    expected = avx512 if avx512 is not None else kernels.cpu_quant_avx2()
    assert kernels.quant_kernels(torch.float32) is expected
    assert kernels.quant_kernels(torch.float16) is None

"""GGUF block types on quickdraft's quantized kernels (kernels/quant.py, kernels/cpu_quant.cpp and
cpu_quant_vnni.cpp): every block type's decoding against the gguf package's reference dequantization, the packed
layout read back by the kernel's own scalar decoder, each linear kernel (bf16; int8 and int16 digits an
activation on integer dot products) against a float64 product, and bitwise row invariance."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from quickdraft import kernels
from quickdraft.kernels import quant

pytestmark = pytest.mark.usefixtures("one_thread")

TYPES = sorted(quant.SUPPORTED)
needs_kernels = pytest.mark.skipif(kernels.cpu_linear() is None, reason="needs quickdraft's AVX512-BF16 kernels")
# The quantized kernels this CPU runs: bf16 everywhere the kernels build, int8 and int16 where it has AVX512-VNNI
# (calls of many rows on AMX-INT8 tiles where it has those; "/vpdpbusd": without tiles, as on CPUs without AMX).
KERNELS = ["bf16", "int8", "int8x32", "int16", "int8/vpdpbusd", "int8x32/vpdpbusd", "int16/vpdpbusd"]


@contextlib.contextmanager
def kernel(name: str):
    module = kernels.cpu_linear()
    scheme, _, only = name.partition("/")
    try:
        before = module.set_quant_kernel(scheme)
    except RuntimeError as error:
        pytest.skip(str(error))
    amx_before = module.set_quant_amx(only != "vpdpbusd")
    try:
        yield module
    finally:
        module.set_quant_kernel(before)
        module.set_quant_amx(amx_before)



def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """GGUF bytes of a [rows, cols] tensor: random codes, scales and mins (valid float16, both signs)."""
    rng = np.random.default_rng(seed + 1000 * qtype)
    block, size, _, _ = quant.LAYOUT[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)

    def halves(offset: int, scale: float) -> None:
        values = (rng.standard_normal((rows, cols // block)) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = values[..., None].view(np.uint8)

    offsets = {quant.Q4_0: [0], quant.Q5_0: [0], quant.Q5_1: [0, 2], quant.Q8_0: [0], quant.Q4_1: [0, 2], quant.Q4_K: [0, 2],
               quant.Q5_K: [0, 2], quant.Q6_K: [208]}[qtype]
    for offset in offsets:
        halves(offset, 0.01)
    return raw.reshape(rows, -1)


def shapes(qtype: int) -> list[tuple[int, int]]:
    block = quant.LAYOUT[qtype][0]
    # odd row counts (the packer pads to 16), one and several blocks a row
    return [(37, block), (16, 3 * block), (5, 2 * block), (64, 4 * block if block == 32 else 2 * block)]


@pytest.mark.parametrize("qtype", TYPES, ids=[quant.NAMES[t] for t in TYPES])
def test_decoding_matches_the_gguf_reference(qtype):
    import gguf

    for rows, cols in shapes(qtype):
        raw = random_blocks(qtype, rows, cols)
        reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols)
        blocks = quant.decode(raw, qtype, cols)
        assert blocks.codes.shape == (rows, cols)
        np.testing.assert_array_equal(blocks.dequantize(), reference)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=[quant.NAMES[t] for t in TYPES])
def test_the_packed_layout_reads_back_bitwise(qtype):
    import gguf

    module = kernels.cpu_linear()
    for rows, cols in shapes(qtype):
        raw = random_blocks(qtype, rows, cols, seed=1)
        reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols)
        packed = quant.pack(quant.decode(raw, qtype, cols))
        assert packed.packed.shape[0] == -(-rows // 16) and packed.packed.shape[2] == quant.LAYOUT[qtype][3]
        # the packed bytes are the GGUF bytes give or take padding and Q4_K's byte-wide 6-bit scales
        assert packed.nbytes <= 1.03 * raw.nbytes * (-(-rows // 16) * 16) / rows
        rows_read = module.dequantize_rows(packed.packed, qtype, torch.arange(rows), cols).numpy()
        np.testing.assert_array_equal(rows_read, reference)
        shuffled = torch.randperm(rows)[:7]
        np.testing.assert_array_equal(module.dequantize_rows(packed.packed, qtype, shuffled, cols).numpy(),
                                      reference[shuffled.numpy()])


def activation_block(qtype: int, name: str) -> int:
    """Inputs per activation scale: the weight's block (256 for the K-quants), or 32 for every type with int8x32."""
    return 32 if name.startswith("int8x32") or quant.LAYOUT[qtype][0] != 256 else 256


def integer_reference(x: torch.Tensor, w: torch.Tensor, qtype: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of the dequantized weights w [N, K] with x as the integer kernel `name` quantizes it,
    and the float64 sum of |s v| |w| (the scale of the float32 rounding)."""
    block = activation_block(qtype, name)
    v, s = quant.quantize_activations(x, block, 2 if name.startswith("int16") else 1)
    xq = torch.from_numpy(v.astype(np.float64) * np.repeat(s.astype(np.float64), block, axis=1))
    return xq @ w.double().T, xq.abs() @ w.double().abs().T


@needs_kernels
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16 x", "float32 x"])
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("qtype", TYPES, ids=[quant.NAMES[t] for t in TYPES])
def test_linear_kernel_against_float64(qtype, name, x_dtype):
    """float32 x (a float32 residual stream's norms): the integer kernels quantize it as it is, the bf16 kernel
    reads it rounded to bf16."""
    import gguf

    torch.manual_seed(0)
    with kernel(name) as module:
        for rows, cols in shapes(qtype):
            raw = random_blocks(qtype, rows, cols, seed=2)
            w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols))
            packed = quant.pack(quant.decode(raw, qtype, cols))
            x = torch.randn(9, cols).to(x_dtype)
            x[3] *= 1e-3  # a row of another magnitude (each row has its own scales)
            y = module.linear_quant(x, [packed.packed], [qtype])[:, :rows].double()
            if name == "bf16":
                x = x.bfloat16()
                exact, magnitude = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
            else:  # the dequantized weights times the activations as the kernel takes them to integers
                exact, magnitude = integer_reference(x, w, qtype, name)
            # bf16 output (relative 2^-9) plus float32 summation over the blocks (relative to sum |x| |w|)
            bound = exact.abs() * 2.0 ** -8 + magnitude * 1e-6
            assert ((y - exact).abs() <= bound).all(), (y - exact).abs().max()


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=[quant.NAMES[t] for t in TYPES])
def test_two_digit_activations_are_within_2e_16_of_the_block_max(qtype):
    """int16 against the exact product of x itself: the activations' error is at most max|x| / 65278 a block."""
    import gguf

    block = 256 if quant.LAYOUT[qtype][0] == 256 else 32
    torch.manual_seed(5)
    with kernel("int16") as module:
        rows, cols = shapes(qtype)[1]
        raw = random_blocks(qtype, rows, cols, seed=6)
        w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols)).double()
        x = torch.randn(5, cols).bfloat16()
        y = module.linear_quant(x, [quant.pack(quant.decode(raw, qtype, cols)).packed], [qtype])[:, :rows].double()
        exact = x.double() @ w.T
        top = x.double().abs().reshape(5, -1, block).amax(-1)  # [M, blocks]
        w_blocks = w.abs().reshape(rows, -1, block).sum(-1)  # [N, blocks]
        quantization = top / 65278 @ w_blocks.T
        bound = exact.abs() * 2.0 ** -8 + quantization + (x.double().abs() @ w.abs().T) * 1e-6
        assert ((y - exact).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16 x", "float32 x"])
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("qtype", TYPES, ids=[quant.NAMES[t] for t in TYPES])
def test_rows_are_computed_alike_whatever_the_call(qtype, name, x_dtype):
    """A row's outputs are bitwise the same alone, among 2..64 rows, and inside prefill-sized calls (the kernels'
    few-row and many-row tilings: four or two groups a tile and the groups left over, several threads)."""
    block = quant.LAYOUT[qtype][0]
    rows, cols = 80, 2 * block  # 5 groups of 16 outputs: a 4-group tile and a remainder
    packed = quant.pack(quant.decode(random_blocks(qtype, rows, cols, seed=3), qtype, cols))
    torch.manual_seed(1)
    x = torch.randn(100, cols).to(x_dtype)
    x[::7] *= 30  # rows of other magnitudes
    before = torch.get_num_threads()
    with kernel(name) as module:
        try:
            torch.set_num_threads(2)
            everything = module.linear_quant(x, [packed.packed], [qtype])
            torch.set_num_threads(1)
            alone = torch.cat([module.linear_quant(x[i:i + 1].contiguous(), [packed.packed], [qtype]) for i in range(100)])
        finally:
            torch.set_num_threads(before)
        assert torch.equal(everything, alone)
        for m in list(range(2, 17)) + [23, 31, 40, 64]:
            assert torch.equal(module.linear_quant(x[:m].contiguous(), [packed.packed], [qtype]), alone[:m]), m
            assert torch.equal(module.linear_quant(x[7:7 + m].contiguous(), [packed.packed], [qtype]), alone[7:7 + m])


@needs_kernels
@pytest.mark.parametrize("name", KERNELS)
def test_fused_parts_of_different_types_equal_their_separate_products(name):
    cols = 256
    parts = [quant.pack(quant.decode(random_blocks(t, n, cols, seed=4), t, cols))
             for t, n in ((quant.Q5_0, 32), (quant.Q8_0, 48), (quant.Q4_K, 16), (quant.Q6_K, 21))]
    x = torch.randn(6, cols).bfloat16()
    with kernel(name) as module:
        fused = module.linear_quant(x, [p.packed for p in parts], [p.qtype for p in parts])
        separate = torch.cat([module.linear_quant(x, [p.packed], [p.qtype]) for p in parts], dim=1)
        logits = module.linear_quant(x, [p.packed for p in parts], [p.qtype for p in parts], float_output=True)
    assert torch.equal(fused, separate)
    # float32 outputs (the logits) are the same sums before their rounding to bf16
    assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), fused) and not torch.equal(logits, fused.float())


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=[quant.NAMES[t] for t in TYPES])
def test_int8x32_is_int8_on_blocks_of_32_and_finer_on_the_k_quants(qtype):
    """int8x32 gives each 32 activations their own scale: on blocks of 32 that is int8 itself (the same bits); on
    the K-quants it is closer to the exact product than int8's one scale per 256 where a 32 holds a large value."""
    import gguf

    block = quant.LAYOUT[qtype][0]
    cols = 2 * block if block == 256 else 4 * block
    raw = random_blocks(qtype, 48, cols, seed=8)
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(48, cols)).double()
    packed = quant.pack(quant.decode(raw, qtype, cols))
    torch.manual_seed(3)
    x = torch.randn(6, cols).bfloat16()
    x[:, 5] *= 50  # an outlier channel, as Qwen2.5's activations have
    with kernel("int8") as module:
        one_scale = module.linear_quant(x, [packed.packed], [qtype], float_output=True)[:, :48].double()
    with kernel("int8x32") as module:
        fine = module.linear_quant(x, [packed.packed], [qtype], float_output=True)[:, :48].double()
    if block == 32:
        assert torch.equal(fine, one_scale)
    else:
        exact = x.double() @ w.T
        assert (fine - exact).abs().mean() < 0.5 * (one_scale - exact).abs().mean()


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int8x32", "int16"])
@pytest.mark.parametrize("qtype", TYPES, ids=[quant.NAMES[t] for t in TYPES])
def test_amx_tiles_compute_the_bits_of_the_vpdpbusd_kernel(qtype, name):
    """Calls of many rows run on AMX-INT8 tiles where the CPU has them: the same bits as vpdpbusd, in tiles of 8 and
    16 rows (two digits: of 4 and 8 rows' digits), whatever the row count (set_quant_amx_rows(1): tiles from 1 row)."""
    module = kernels.cpu_linear()
    if not module.set_quant_amx(True) and not module.quant_amx():
        pytest.skip("this CPU has no AMX-INT8 tiles")
    block = quant.LAYOUT[qtype][0]
    packed = quant.pack(quant.decode(random_blocks(qtype, 112, 3 * block, seed=7), qtype, 3 * block))
    torch.manual_seed(2)
    x = torch.randn(37, 3 * block).bfloat16()  # 37 rows: tiles of 16, 16 and 5 (zero rows after)
    x[::5] *= 40
    with kernel(name + "/vpdpbusd"):
        vnni = module.linear_quant(x, [packed.packed], [qtype])
    before = module.set_quant_amx_rows(1)
    try:
        with kernel(name):
            for m in (1, 2, 3, 4, 5, 8, 9, 16, 37):
                assert torch.equal(module.linear_quant(x[:m].contiguous(), [packed.packed], [qtype]), vnni[:m]), m
    finally:
        module.set_quant_amx_rows(before)


@needs_kernels
def test_the_integer_kernels_run_where_the_cpu_has_vnni():
    module = kernels.cpu_linear()
    has_vnni = "avx512_vnni" in open("/proc/cpuinfo").read()
    with pytest.raises(RuntimeError, match="unknown quantized kernel"):
        module.set_quant_kernel("int4")
    if has_vnni:
        assert module.quant_kernel() in KERNELS
        with kernel("int16"):
            assert module.quant_kernel() == "int16"
    else:
        assert module.quant_kernel() == "bf16"
        with pytest.raises(RuntimeError, match="needs AVX512-VNNI"):
            module.set_quant_kernel("int8")


@needs_kernels
@pytest.mark.parametrize("name", KERNELS)
def test_float32_rows_that_are_bf16_values_give_the_bf16_rows_bits(name):
    """A float32 x is quantized from its own values: where those are bf16 values, the result is the bf16 call's."""
    cols = 256
    parts = [quant.pack(quant.decode(random_blocks(t, 32, cols, seed=7), t, cols)) for t in (quant.Q4_K, quant.Q8_0)]
    x = torch.randn(5, cols).bfloat16()
    with kernel(name) as module:
        from_bf16 = module.linear_quant(x, [p.packed for p in parts], [p.qtype for p in parts], float_output=True)
        from_float = module.linear_quant(x.float(), [p.packed for p in parts], [p.qtype for p in parts], float_output=True)
    assert torch.equal(from_bf16, from_float)


@needs_kernels
def test_bad_input_is_refused():
    module = kernels.cpu_linear()
    packed = quant.pack(quant.decode(random_blocks(quant.Q4_0, 16, 64), quant.Q4_0, 64))
    with pytest.raises(RuntimeError, match="must be"):
        module.linear_quant(torch.randn(2, 96).bfloat16(), [packed.packed], [quant.Q4_0])  # K mismatch
    with pytest.raises(RuntimeError, match="unsupported quantization type"):
        module.linear_quant(torch.randn(2, 64).bfloat16(), [packed.packed], [11])  # Q3_K
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        module.linear_quant(torch.randn(2, 64).double(), [packed.packed], [quant.Q4_0])
    with pytest.raises(RuntimeError, match="out of range"):
        module.dequantize_rows(packed.packed, quant.Q4_0, torch.tensor([16]), 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.decode(np.zeros((1, 144), np.uint8), quant.Q4_K, 128)
    with pytest.raises(ValueError, match="no quantized kernel"):
        quant.decode(np.zeros((1, 18), np.uint8), 20, 32)


def test_q4_1_quantizer_error_is_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(24, 96) * torch.rand(24, 1)
    blocks = quant.quantize_q4_1(w)
    assert blocks.codes.max() <= 15
    back = torch.from_numpy(blocks.dequantize())
    step = torch.from_numpy(blocks.fields["d"].astype(np.float32)).repeat_interleave(32, dim=1)
    # half a step, plus the float16 rounding of the scale (times the code) and of the min
    slack = 15 * step * 2.0 ** -11 + w.abs().amax() * 2.0 ** -11
    assert ((back - w).abs() <= step / 2 + slack).all()


@needs_kernels
def test_a_call_runs_its_models_kernel_unless_the_process_overrides_it():
    """linear_quant's `kernel` is the model's choice (models/families.py); set_quant_kernel (or
    QUICKDRAFT_QUANT_KERNEL) overrides every model's, and "" removes the override."""
    module = kernels.cpu_linear()
    if "avx512_vnni" not in open("/proc/cpuinfo").read():
        pytest.skip("the integer kernels need AVX512-VNNI")
    cols = 256
    parts = [quant.pack(quant.decode(random_blocks(t, 32, cols, seed=3), t, cols)) for t in (quant.Q4_K, quant.Q6_K)]
    packed, types = [p.packed for p in parts], [p.qtype for p in parts]
    x = torch.randn(5, cols)
    x[:, 7] *= 30  # an outlier channel: one digit a scale per 32 and two digits a scale per block differ
    by_override = {}
    for name in ("int8x32", "int16"):
        with kernel(name):
            by_override[name] = module.linear_quant(x, packed, types, True)
    assert not torch.equal(by_override["int8x32"], by_override["int16"])
    before = module.set_quant_kernel("")
    try:
        assert module.quant_kernel() == "int16" and module.quant_kernel("int8x32") == "int8x32"
        assert torch.equal(module.linear_quant(x, packed, types, True, "int8x32"), by_override["int8x32"])
        assert torch.equal(module.linear_quant(x, packed, types, True), by_override["int16"])  # the default
        assert module.set_quant_kernel("int16") == ""
        assert module.quant_kernel("int8x32") == "int16"
        assert torch.equal(module.linear_quant(x, packed, types, True, "int8x32"), by_override["int16"])
        assert module.set_quant_kernel("") == "int16"
        with pytest.raises(RuntimeError, match="unknown quantized kernel 'int4'"):
            module.linear_quant(x, packed, types, True, "int4")
    finally:
        module.set_quant_kernel(before)


def test_a_familys_kernel_applies_on_vnni_cpus_without_amx_tiles(monkeypatch):
    class Module:
        amx = False

        def amx_available(self):
            return self.amx

    module = Module()
    monkeypatch.setattr(kernels, "cpu_linear", lambda: module)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx512_vnni", "amx_int8"})
    assert kernels.model_quant_kernel("int8x32") == "int8x32"  # AMX in the flags, but this process may not use it
    assert kernels.model_quant_kernel(None) == ""
    module.amx = True
    assert kernels.model_quant_kernel("int8x32") == ""  # int16 on the tiles
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2"})
    module.amx = False
    assert kernels.model_quant_kernel("int8x32") == ""
    monkeypatch.setattr(kernels, "cpu_linear", lambda: None)
    assert kernels.model_quant_kernel("int8x32") == ""

"""GGUF quantized weights in the layout of quickdraft's quantized linear kernels (kernels/cpu_quant.cpp).

GGUF stores a weight [N, K] row by row in blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or 256 (Q4_K, Q5_K, Q6_K) inputs,
each block its integer codes and scales. `decode` takes the blocks apart into codes [N, K] and the scale
fields of each block (numpy, exact); `pack` lays them out for the kernel: outputs in groups of 16, each group's
blocks one contiguous stream of chunks (codes in the dot-product instruction's lane order, 4-bit codes four
steps to a vector, 5th/6th bits in planes of their own, then the group's scales; read by the bf16 kernel
and by the integer-dot-product kernel, cpu_quant_vnni.cpp). Nothing is widened: the
packed weight is within 3% of the GGUF bytes (Q4_K's and Q5_K's 6-bit scales take a byte each).

`quantize_activations` is the reference of how the integer kernels (cpu_quant_vnni.cpp) take a row of activations
to integers. `quantize_q4_1` makes the 4-bit form of a dense weight (the 4-bit self-draft of a bf16 target).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LAYOUT_VERSION = 2  # of the packed layout below (cached packed weights of another version are not read)

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K"}
# type: (inputs per GGUF block, bytes per GGUF block, inputs per packed super-block, bytes per packed chunk)
LAYOUT = {Q4_0: (32, 18, 32, 288), Q4_1: (32, 20, 32, 320), Q5_0: (32, 22, 32, 352), Q5_1: (32, 24, 32, 384),
          Q8_0: (32, 34, 32, 544),
          Q4_K: (256, 144, 256, 2368), Q5_K: (256, 176, 256, 2880), Q6_K: (256, 210, 256, 3360)}
SUPPORTED = frozenset(LAYOUT)


def type_name(qtype: int) -> str:
    return NAMES.get(qtype, f"GGML type {qtype}")


@dataclass
class QuantizedWeight:
    """A weight [rows, cols] packed for the kernels: `packed` uint8 [ceil(rows/16), cols/SB, chunk]."""

    packed: torch.Tensor
    qtype: int
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    @property
    def name(self) -> str:
        return type_name(self.qtype)


@dataclass
class Blocks:
    """A GGUF weight taken apart. codes: uint8 [N, K] (the stored unsigned code of each weight); fields: the
    per-block scale fields, each [N, K / block] (Q4_K, Q5_K, Q6_K: [N, K / 256, sub-blocks])."""

    qtype: int
    codes: np.ndarray
    fields: dict[str, np.ndarray]

    def rows(self, order: np.ndarray) -> "Blocks":
        return Blocks(self.qtype, self.codes[order], {k: v[order] for k, v in self.fields.items()})

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], computed as GGML does (the reference's order of operations)."""
        n, k = self.codes.shape
        f, c = self.fields, self.codes.astype(np.float32)
        if self.qtype in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
            c = c.reshape(n, k // 32, 32)
            d = f["d"].astype(np.float32)[..., None]
            if self.qtype == Q4_0:
                w = d * (c - 8)
            elif self.qtype in (Q4_1, Q5_1):
                w = d * c + f["m"].astype(np.float32)[..., None]
            elif self.qtype == Q5_0:
                w = d * (c - 16)
            else:
                w = d * self.codes.view(np.int8).reshape(n, k // 32, 32).astype(np.float32)
            return w.reshape(n, k)
        if self.qtype in (Q4_K, Q5_K):
            c = c.reshape(n, k // 256, 8, 32)
            d = f["d"].astype(np.float32)[..., None, None] * f["sc"].astype(np.float32)[..., None]
            m = f["dmin"].astype(np.float32)[..., None, None] * f["m"].astype(np.float32)[..., None]
            return (d * c - m).reshape(n, k)
        c = c.reshape(n, k // 256, 16, 16)
        d = f["d"].astype(np.float32)[..., None, None] * f["sc"].astype(np.float32)[..., None]
        return (d * (c - 32)).reshape(n, k)


def decode(raw: np.ndarray, qtype: int, cols: int) -> Blocks:
    """A GGUF tensor's bytes (uint8, [N, row bytes] or flat) of GGML type `qtype` with `cols` inputs a row."""
    if qtype not in LAYOUT:
        raise ValueError(f"{type_name(qtype)} has no quantized kernel (supported: "
                         f"{', '.join(NAMES[t] for t in sorted(SUPPORTED))})")
    block, size, _, _ = LAYOUT[qtype]
    if cols % block:
        raise ValueError(f"{type_name(qtype)} needs rows of a multiple of {block} inputs, got {cols}")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, cols // block, size)  # [N, blocks, bytes]
    n = b.shape[0]

    def f16(lo: int) -> np.ndarray:
        return b[..., lo:lo + 2].copy().view(np.float16)[..., 0]

    def halves(qs: np.ndarray) -> np.ndarray:  # 16 bytes -> 32 codes: low nibbles first, then high
        return np.concatenate([qs & 15, qs >> 4], axis=-1)

    if qtype == Q4_0:
        return Blocks(qtype, halves(b[..., 2:18]).reshape(n, cols), {"d": f16(0)})
    if qtype == Q4_1:
        return Blocks(qtype, halves(b[..., 4:20]).reshape(n, cols), {"d": f16(0), "m": f16(2)})
    if qtype in (Q5_0, Q5_1):  # Q5_1: d, m, then Q5_0's qh[4] and qs[16]
        at = 2 if qtype == Q5_0 else 4
        high = b[..., at:at + 4].copy().view("<u4")  # [N, blocks, 1]: bit j is the 5th bit of weight j
        bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        fields = {"d": f16(0)} if qtype == Q5_0 else {"d": f16(0), "m": f16(2)}
        return Blocks(qtype, (halves(b[..., at + 4:at + 20]) | bits << 4).reshape(n, cols), fields)
    if qtype == Q8_0:
        return Blocks(qtype, b[..., 2:34].reshape(n, cols).copy(), {"d": f16(0)})
    if qtype in (Q4_K, Q5_K):
        s = b[..., 4:16].astype(np.uint8)  # 12 bytes: 8 six-bit scales and 8 six-bit mins
        sc = np.empty(s.shape[:-1] + (8,), np.uint8)
        mn = np.empty_like(sc)
        sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
        sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
        # qs: 4 runs of 32 bytes, sub-block 2i the low nibbles, 2i+1 the high ones (Q5_K's after its qh[32])
        qs = b[..., 16:144] if qtype == Q4_K else b[..., 48:176]
        codes = np.stack([qs.reshape(n, -1, 4, 32) & 15, qs.reshape(n, -1, 4, 32) >> 4], axis=3)  # [N, blocks, 4, 2, 32]
        if qtype == Q5_K:  # bit j of qh[l] is the 5th bit of input l of sub-block j
            qh = b[..., None, 16:48]
            codes = codes | (((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4).reshape(n, -1, 4, 2, 32)
        return Blocks(qtype, codes.reshape(n, cols), {"d": f16(0), "dmin": f16(2), "sc": sc, "m": mn})
    # Q6_K: ql[128], qh[64], scales[16] (int8), d; two halves of 128 weights, each from 64 ql and 32 qh bytes.
    ql = b[..., 0:128].reshape(n, -1, 2, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 32)
    lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    hi = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=3)
    codes = (lo | hi << 4).reshape(n, cols)  # [N, blocks, half, quarter, 32]
    return Blocks(qtype, codes, {"d": f16(208), "sc": b[..., 192:208].copy().view(np.int8)})


def _q5_high_bit(p: int) -> int:
    """Where step p's 5th bit sits in its 16-bit lane (cpu_quant.h: the bytes an integer dot product reads
    together have their high bits at one position)."""
    return 8 * ((p & 3) >> 1) + 2 * (p >> 2) + (p & 1)


def _q6_high_bits(p: int) -> int:
    """Where step p's (of 8 a plane) two high bits sit in its 16-bit lane (cpu_quant.h)."""
    return 8 * ((p & 3) >> 1) + 2 * (2 * ((p >> 2) & 1) + (p & 1))


def _u16_bytes(words: np.ndarray) -> np.ndarray:
    return words.astype("<u2").view(np.uint8).reshape(*words.shape[:-2], -1)


def pack(blocks: Blocks) -> QuantizedWeight:
    """The kernel layout of `blocks` (rows padded to a multiple of 16 with zero weights)."""
    qtype, codes, fields = blocks.qtype, blocks.codes, blocks.fields
    n, k = codes.shape
    _, _, sb, chunk = LAYOUT[qtype]
    pad = -n % 16
    if pad:
        codes = np.concatenate([codes, np.zeros((pad, k), np.uint8)])
        fields = {name: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for name, v in fields.items()}
    g, nsb = (n + pad) // 16, k // sb
    # a[g, b, p, t]: step p (inputs 2p, 2p+1 of super-block b) of output lane t = 2 * (row in group) + parity.
    a = codes.reshape(g, 16, nsb, sb // 2, 2).transpose(0, 2, 3, 1, 4).reshape(g, nsb, sb // 2, 32)
    parts: list[np.ndarray] = []

    def per_group(v: np.ndarray) -> np.ndarray:  # [N, nsb, ...] -> [g, nsb, ..., 16] as bytes
        v = v.reshape(g, 16, nsb, -1).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(v).view(np.uint8).reshape(g, nsb, -1)

    if qtype == Q8_0:
        parts.append(a.reshape(g, nsb, -1))
    else:
        nib = (a & 15).astype(np.uint16).reshape(g, nsb, sb // 8, 4, 32)
        parts.append(_u16_bytes(sum(nib[..., s, :] << (4 * s) for s in range(4))))
        if qtype in (Q5_0, Q5_1, Q5_K):
            # a plane a 32 inputs, [g, nsb, sb / 32, 16, 32]: of step p, lane t at bit _q5_high_bit(p)
            bits = ((a >> 4) & 1).astype(np.uint16).reshape(g, nsb, sb // 32, 16, 32)
            parts.append(_u16_bytes(sum(bits[..., p, :] << _q5_high_bit(p) for p in range(16))))
        if qtype == Q6_K:
            two = ((a >> 4) & 3).astype(np.uint16).reshape(g, nsb, sb // 16, 8, 32)
            parts.append(_u16_bytes(sum(two[..., p, :] << _q6_high_bits(p) for p in range(8))))
    if qtype in (Q4_K, Q5_K):
        parts += [per_group(fields["d"]), per_group(fields["dmin"]), per_group(fields["sc"]), per_group(fields["m"])]
    elif qtype == Q6_K:
        parts += [per_group(fields["d"]), per_group(fields["sc"])]
    else:
        parts.append(per_group(fields["d"]))
        if qtype in (Q4_1, Q5_1):
            parts.append(per_group(fields["m"]))
    packed = np.concatenate(parts, axis=-1)
    assert packed.shape == (g, nsb, chunk), (packed.shape, chunk)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(packed)), qtype, n, k)


# Largest integer an activation becomes, by digits: one int8 digit (llama.cpp's Q8_K way), or two (v = 256 h + l).
ACTIVATION_RANGE = {1: 127, 2: 32639}


def quantize_activations(x: torch.Tensor, block: int, digits: int) -> tuple[np.ndarray, np.ndarray]:
    """What the integer kernels compute x [M, K] as: (v int32 [M, K], s float32 [M, K / block]) with x ~ s v per
    block of `block` inputs of a row: s = max|x| / R, v = round-half-even(x * (R / max|x|)) in float32, R by
    digits (ACTIVATION_RANGE). Two digits: |x - s v| <= max|x| / 65278."""
    r = np.float32(ACTIVATION_RANGE[digits])
    xf = x.float().numpy().reshape(x.shape[0], -1, block)
    top = np.abs(xf).max(axis=-1)
    inv = np.where(top > 0, r / np.where(top > 0, top, 1), 0).astype(np.float32)
    v = np.clip(np.rint(xf * inv[..., None]), -r, r).astype(np.int32)
    return v.reshape(x.shape), (top / r).astype(np.float32)


def quantize_q4_1(weight: torch.Tensor) -> Blocks:
    """4-bit codes with a float16 scale and min per 32 inputs (GGML's Q4_1 rounding): w ~ d * q + m."""
    w = weight.detach().float().cpu().reshape(weight.shape[0], -1, 32)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return Blocks(Q4_1, q.reshape(weight.shape[0], -1).numpy(), {"d": d.numpy(), "m": m.numpy()})

"""The native runner's linear layers, one class per weight format: y = x W^T (+ b).

- DenseLinear: the model's own bf16 or float weights;
- Int8Linear: weight-only int8 with per-output-channel scales (a quantized self-draft, `quantized:int8`);
- BlockLinear: GGML blocks (one or more QuantizedWeight side by side, as a fused q|k|v whose parts a GGUF file
  stores in different types): a GGUF file's own blocks kept as stored, or Q4_1 blocks of a `quantized:q4` draft.

On CPUs with AVX512-BF16, bf16 and int8 weights are packed once for quickdraft's kernels (AMX tiles where
present): they stream the weights at close to memory bandwidth for the few rows of a decoding step and compute
every row alike whatever the number of rows (see kernels/cpu_linear.cpp; int8 only below 32 rows). Blocks stay
in their format and run on kernels/cpu_quant.cpp, rows computed alike too; on x86 CPUs with AVX2 but no AVX-512
blocks run on kernels/cpu_quant_avx2.cpp with float32 activations, rows alike as well. Elsewhere torch computes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft import kernels
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import quant
from quickdraft.kernels.quant import QuantizedWeight
from quickdraft.sampling import argmax_rows


class Linear(ABC):
    """A linear layer of the native runner: what its forward, the C++ decoder loop and the derived (quantized)
    runners use of one, whatever the weight format."""

    out_features: int
    in_features: int
    dtype: torch.dtype  # that of the activations
    bias: torch.Tensor | None
    _kernels = None  # quickdraft's CPU kernels where this layer runs on them
    # Whether the layer's kernel takes float32 rows as they are (GGUF blocks: their integer digits come from x
    # itself); other layers read bf16 rows, so a float32 residual stream's norm rounds for them.
    reads_float32 = False

    @property
    def on_cpu_kernels(self) -> bool:
        """Whether this layer runs on quickdraft's CPU kernels (then the C++ decoder loop can take it)."""
        return self._kernels is not None

    @property
    @abstractmethod
    def rows_alike(self) -> bool:
        """Whether every row of a call is computed bitwise alike whatever the number of rows."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors() if t is not None)

    @abstractmethod
    def _tensors(self) -> list[torch.Tensor | None]:
        """The tensors this layer holds (for nbytes)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, float_output: bool = False) -> torch.Tensor:
        """float_output: block weights return float32 (logits; bf16 would make near-ties ties), others as x."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's index of the largest of its outputs `self(x, float_output=True)` [...] int64 (the first where
        they tie; torch's answer for a row holding a NaN): a greedy step's tokens. BlockLinear's kernels give it
        without writing the logits."""
        return argmax_rows(self(x, float_output=True).float())

    @abstractmethod
    def spec(self) -> tuple:
        """(weight, scales, bias, outputs, quantized parts, their GGML types, the model's quantized kernel or ""):
        what the C++ decoder loop needs of a kernel-packed layer."""

    @abstractmethod
    def dense(self) -> torch.Tensor:
        """The [N, K] weight (unpacked; dequantised in float32 when int8 or blocks)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the [N, K] weight in float32."""
        return self.dense()[ids].float()

    def leading(self, n: int) -> "Linear":
        """This layer's first n outputs (0 < n <= out_features) as a Linear sharing its weight: the packed groups
        of 16 outputs that hold them, a prefix of the weight in memory, so a call reads only those. Each output is
        computed as in the whole layer (the same kernel and order: bitwise where the layer's rows are alike)."""
        if not 0 < n <= self.out_features:
            raise QuickdraftError(f"leading({n}) of a layer of {self.out_features} outputs: give 1..{self.out_features}")
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.out_features = n
        view.bias = None if self.bias is None else self.bias[:n]
        view._narrow()
        return view

    def _stored_rows(self) -> int:
        """Rows of the stored weight that hold the first out_features outputs: groups of 16 where packed."""
        return -(-self.out_features // 16) if self._kernels is not None else self.out_features

    @abstractmethod
    def _narrow(self) -> None:
        """Keep only what the first out_features outputs need of the stored weight (leading())."""

    def int8(self) -> "Int8Linear":
        """Symmetric per-output int8 of this weight (a new Linear; this one is unchanged)."""
        w = self.dense().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return Int8Linear(q, scales, self.bias, self.dtype)

    def q4(self) -> "Linear":
        """4-bit codes with a float16 scale and min per 32 inputs (GGML's Q4_1) of this weight (a new Linear)."""
        if self.in_features % 32 or kernels.quant_kernels(self.dtype) is None:
            return self.int8()  # the 4-bit kernels need K % 32 == 0 and AVX512-BF16 or AVX2; int8 elsewhere
        return BlockLinear([quant.pack(quant.quantize_q4_1(self.dense()))], self.bias, self.dtype)

    def _trim(self, y: torch.Tensor) -> torch.Tensor:
        """The kernels compute outputs in groups of 16: drop the padding columns."""
        return y[:, : self.out_features] if y.shape[1] != self.out_features else y

    def _unpacked(self) -> torch.Tensor:
        """The weight as stored: kernel-packed [N/16, K/2, 16, 2] back to [N, K], or the row-major one as is."""
        w = self.weight
        if self._kernels is not None:
            w = w.permute(0, 2, 1, 3).reshape(-1, self.in_features)[: self.out_features]
        return w


def _kernels_for(weight: torch.Tensor, dtype: torch.dtype):
    """quickdraft's CPU kernels for a weight used with `dtype` activations, or None where torch computes it."""
    if weight.device.type == "cpu" and dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
        return kernels.cpu_linear()
    return None


class DenseLinear(Linear):
    """The model's own weight [N, K] (bf16 or float), with an optional bias [N]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        self.bias, self.scales = bias, None
        self.dtype = dtype or weight.dtype
        self.out_features, self.in_features = weight.shape
        self._kernels = _kernels_for(weight, self.dtype)
        # The packed copy replaces the row-major one.
        self.weight = kernels.pack(weight) if self._kernels is not None else weight

    @property
    def rows_alike(self) -> bool:
        return self._kernels is not None

    def _tensors(self) -> list[torch.Tensor | None]:
        return [self.weight, self.bias]

    def __call__(self, x: torch.Tensor, float_output: bool = False) -> torch.Tensor:
        if self._kernels is not None and x.dtype == torch.bfloat16:
            y = self._trim(self._kernels.linear_bf16(x.contiguous(), self.weight, True))
        else:
            y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias

    def spec(self) -> tuple:
        return self.weight, None, self.bias, self.out_features, [], [], ""

    def dense(self) -> torch.Tensor:
        return self._unpacked()

    def _narrow(self) -> None:
        self.weight = self.weight[: self._stored_rows()]


class Int8Linear(Linear):
    """Symmetric weight-only int8 [N, K] with float32 per-output scales [N]; activations in `dtype`."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.bias, self.dtype = bias, dtype
        self.out_features, self.in_features = weight.shape
        self._kernels = _kernels_for(weight, dtype)
        if self._kernels is not None:
            self.weight = kernels.pack(weight)  # the packed copy replaces the row-major one
            self.scales = F.pad(scales.float(), (0, -self.out_features % 16))
        else:
            self.weight = weight
            self.scales = scales.to(dtype)  # torch's int8 matmul takes scales in the activations' dtype

    @property
    def rows_alike(self) -> bool:
        return False  # the int8 kernel widens its accumulation differently from 32 rows on

    def _tensors(self) -> list[torch.Tensor | None]:
        return [self.weight, self.bias, self.scales]

    def __call__(self, x: torch.Tensor, float_output: bool = False) -> torch.Tensor:
        if self._kernels is not None and x.dtype == torch.bfloat16:
            y = self._trim(self._kernels.linear_int8(x.contiguous(), self.weight, self.scales))
        else:
            shape = x.shape
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scales)
            y = y.reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def spec(self) -> tuple:
        return self.weight, self.scales, self.bias, self.out_features, [], [], ""

    def dense(self) -> torch.Tensor:
        return self._unpacked().float() * self.scales[: self.out_features, None].float()

    def _narrow(self) -> None:
        rows = self._stored_rows()
        self.weight = self.weight[:rows]
        self.scales = self.scales[: rows * 16 if self._kernels is not None else rows]  # padded to groups of 16


FOUR_BIT = frozenset({quant.Q4_0, quant.Q4_1, quant.Q4_K})  # what Linear.q4 keeps of a GGUF file's blocks


class BlockLinear(Linear):
    """GGML-quantized blocks: `parts` side by side make the [N, K] weight (every part but the last a multiple
    of 16 rows), run on the quantized kernels: AVX-512's with bf16 activations (then the C++ decoder loop can take
    the layer too), or AVX2's with the model's float32 ones. quant_kernel: the model's choice of integer
    activations (kernels.model_quant_kernel; "" for the kernels' default)."""

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None, quant_kernel: str = ""):
        self.bias, self.scales, self.parts, self.quant_kernel = bias, None, parts, quant_kernel
        self.weight = None
        self.dtype = dtype or torch.bfloat16
        self.out_features, self.in_features = sum(p.rows for p in parts), parts[0].cols
        if any(p.rows % 16 for p in parts[:-1]):
            raise QuickdraftError("quantized parts of a fused weight need multiples of 16 rows")
        self._quant = kernels.quant_kernels(self.dtype)
        if self._quant is None:
            raise QuickdraftError(f"no quantized kernel runs {self.dtype} activations on this CPU (AVX512-BF16 for "
                                  "bf16, AVX2 for float32): load the model with dtype='auto'")
        self._kernels = self._quant if self._quant is kernels.cpu_linear() else None
        self._types = [p.qtype for p in parts]
        self._packed = [p.packed for p in parts]

    @property
    def rows_alike(self) -> bool:
        return True  # both kernels compute every row alike

    def _tensors(self) -> list[torch.Tensor | None]:
        return [self.bias] + self._packed

    reads_float32 = True

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        """x [..., K] as the kernels read it: contiguous rows [M, K], bf16 or float32."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype not in (torch.float32, torch.bfloat16):
            rows = rows.to(torch.float32)  # what both kernels read
        return rows.contiguous()

    def __call__(self, x: torch.Tensor, float_output: bool = False) -> torch.Tensor:
        """x: bf16 or float32 rows (the AVX-512 kernels quantize either as it is; AVX2's read float32); y in the
        activations' dtype, or float32 if float_output."""
        shape = x.shape
        y = self._quant.linear_quant(self._rows(x), self._packed, self._types, float_output, self.quant_kernel)
        y = self._trim(y).reshape(*shape[:-1], -1)
        y = y if float_output else y.to(self.dtype)
        return y if self.bias is None else y + self.bias

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """On the AVX-512 kernels without a bias, their linear_quant_argmax: the logits computed a block of columns
        at a time into a scratch that stays in cache, never written whole (at 64 rows SmolLM2's are 12.6 MB, which
        the head's streamed weights evict before an argmax reads them), the same bits. Elsewhere, and where a row
        holds a NaN, the logits and their argmax."""
        fused = getattr(self._quant, "linear_quant_argmax", None)  # AVX2's module has none
        if fused is None or self.bias is not None:
            return super().argmax(x)
        shape = x.shape
        index, has_nan = fused(self._rows(x), self._packed, self._types, self.quant_kernel, self.out_features)
        return super().argmax(x) if has_nan else index.reshape(shape[:-1])

    def spec(self) -> tuple:
        return torch.empty(0), None, self.bias, self.out_features, self._packed, self._types, self.quant_kernel

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Only the rows `ids` are dequantised (one part; a fused weight's rows come from its dense form)."""
        if len(self.parts) == 1:
            p = self.parts[0]
            return self._quant.dequantize_rows(p.packed, p.qtype, ids.cpu(), p.cols).float()
        return super().rows(ids)

    def dense(self) -> torch.Tensor:
        return torch.cat([self._quant.dequantize_rows(p.packed, p.qtype, torch.arange(p.rows), p.cols)
                          for p in self.parts])

    def q4(self) -> "BlockLinear":
        """Parts stored in 4-bit blocks (Q4_0, Q4_1, Q4_K: 4.5-5 bits a weight) kept as they are, the others
        (Q5_*, Q6_K, Q8_0) requantized to Q4_1: requantizing a 4-bit part would round it twice, and from Q4_K's
        4.5 bits it would grow. A GGUF draft's wide head and Q5_0 layers then stream 5 bits a weight."""
        parts = [p if p.qtype in FOUR_BIT else quant.pack(quant.quantize_q4_1(
            self._quant.dequantize_rows(p.packed, p.qtype, torch.arange(p.rows), p.cols))) for p in self.parts]
        if all(new is old for new, old in zip(parts, self.parts)):
            return self
        return BlockLinear(parts, self.bias, self.dtype, self.quant_kernel)

    def _narrow(self) -> None:  # the parts in order, the last cut to its groups of 16 outputs
        parts, left = [], self.out_features
        for p in self.parts:
            if left <= 0:
                break
            rows = min(p.rows, left)
            parts.append(QuantizedWeight(p.packed[: -(-rows // 16)], p.qtype, rows, p.cols))
            left -= rows
        self.parts, self._packed, self._types = parts, [p.packed for p in parts], [p.qtype for p in parts]


# --- from a transformers model's layers ----------------------------------------------------------------------

def dense_linear(modules: tuple[nn.Linear, ...] | list[nn.Linear]) -> DenseLinear:
    """The DenseLinear of transformers linear layers side by side (q|k|v, gate|up: one matrix, one call), or
    of one layer (its weight as it is, no copy)."""
    if len(modules) == 1:
        (module,) = modules
        return DenseLinear(module.weight.detach(), None if module.bias is None else module.bias.detach())
    return DenseLinear(torch.cat([m.weight.detach() for m in modules]).contiguous(), fused_bias(modules))


def fused_bias(modules: tuple[nn.Linear, ...] | list[nn.Linear]) -> torch.Tensor | None:
    """The biases of linears fused side by side (zeros for those without one), or None when none has one."""
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype,
                                                                   device=m.weight.device)
                      for m, b in zip(modules, biases)])


def blocks_fit(parts: list[QuantizedWeight | None], modules: tuple[nn.Linear, ...] | list[nn.Linear]) -> bool:
    """Whether a GGUF file's blocks `parts` can stand for the layers `modules` side by side in a BlockLinear:
    one part per layer of its shape, every part but the last a multiple of 16 rows."""
    return bool(parts) and all(p is not None for p in parts) and all(p.rows % 16 == 0 for p in parts[:-1]) and \
        all(p.cols == parts[0].cols == m.weight.shape[1] and p.rows == m.weight.shape[0]
            for p, m in zip(parts, modules))

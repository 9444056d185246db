"""A GGUF file's quantized matrices, kept in their block format for the native runner's quantized kernels.

transformers loads a GGUF model by dequantizing every tensor; the native runner then takes the model's
norms, rotary tables and configuration from that model, and its linear layers and embedding from here: the
file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), repacked for kernels/cpu_quant.cpp, so a decoding
step streams the stored 4.5-8.5 bits a weight instead of 16. Matrices of other types (F16, IQ*, ...) are
absent here, and the runner keeps those layers dense.

Rows are put in transformers' order: where transformers reorders a tensor's rows on load (Llama's q and k
projections, which llama.cpp's converter permutes for its rotary layout), the same row permutation is applied
to the blocks, found by running transformers' own tensor processor on the row indices.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quickdraft.kernels import quant
from quickdraft.kernels.quant import QuantizedWeight

log = logging.getLogger(__name__)

# GGUF tensor name -> the native runner's role of the matrix in its layer.
ROLES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
         "ffn_down": "down"}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


@dataclass
class QuantizedWeights:
    """The quantized matrices of one GGUF file: per layer and role, the embedding, the output head."""

    path: str
    layers: dict[tuple[int, str], QuantizedWeight] = field(default_factory=dict)
    embedding: QuantizedWeight | None = None
    output: QuantizedWeight | None = None  # None: tied to the embedding (or not quantized)
    tied: bool = True
    skipped: dict[str, str] = field(default_factory=dict)  # tensor name -> its type, kept dense

    def get(self, layer: int, role: str) -> QuantizedWeight | None:
        return self.layers.get((layer, role))

    def named(self) -> dict[str, QuantizedWeight]:
        """Every matrix by a name: layers.I.ROLE, embedding, output (the names the cache file uses)."""
        named = {f"layers.{i}.{role}": w for (i, role), w in self.layers.items()}
        named.update({name: w for name, w in (("embedding", self.embedding), ("output", self.output)) if w})
        return named

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.named().values())

    def types(self) -> dict[str, int]:
        """How many matrices of each type (for reports)."""
        return dict(Counter(w.name for w in self.named().values()))


def save(weights: QuantizedWeights, path: Path) -> None:
    """Write the packed matrices (safetensors; the next load of the same GGUF file skips parsing it)."""
    from safetensors.torch import save_file

    tensors, meta = {}, {"path": weights.path, "tied": str(weights.tied), "skipped": ",".join(
        f"{k}={v}" for k, v in weights.skipped.items())}
    for name, w in weights.named().items():
        tensors[name] = w.packed
        meta[name] = f"{w.qtype},{w.rows},{w.cols}"
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.rename(path)


def load(path: Path) -> QuantizedWeights:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        weights = QuantizedWeights(meta["path"], tied=meta["tied"] == "True")
        weights.skipped = dict(item.split("=", 1) for item in meta["skipped"].split(",") if item)
        for name in f.keys():
            qtype, rows, cols = (int(v) for v in meta[name].split(","))
            w = QuantizedWeight(f.get_tensor(name), qtype, rows, cols)
            if name.startswith("layers."):
                _, index, role = name.split(".")
                weights.layers[(int(index), role)] = w
            else:
                setattr(weights, name, w)
    return weights


def _row_orders(architecture: str, config) -> "object":
    """transformers' tensor processor for this architecture (it reorders q/k rows for Llama)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    heads = config.num_attention_heads
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    return processor(config={"num_attention_heads": heads,
                             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads})


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """The permutation transformers applies to the rows of tensor `name` (None: none), or raises if its
    processor changes the tensor otherwise."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    out = np.asarray(processor.process(weights=index, name=name).weights).reshape(rows, -1)[:, 0]
    order = out.astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(rows)) or not np.array_equal(out, order):
        raise ValueError(f"transformers changes {name} in a way other than a row permutation")
    return None if np.array_equal(order, np.arange(rows)) else order


def read(path: str | Path, config) -> QuantizedWeights:
    """The quantized matrices of the GGUF file at `path` for a model of `config` (its text config)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    architecture = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
    processor = _row_orders(architecture, config)
    weights = QuantizedWeights(str(path))
    names = {t.name for t in reader.tensors}
    weights.tied = "output.weight" not in names
    for tensor in reader.tensors:
        name, qtype = tensor.name, int(tensor.tensor_type)
        match = _LAYER.match(name)
        role = ROLES.get(match.group(2)) if match else None
        if role is None and name not in ("token_embd.weight", "output.weight"):
            continue  # norms, biases and whatever the runner takes from the transformers model
        if qtype not in quant.SUPPORTED:
            weights.skipped[name] = tensor.tensor_type.name
            continue
        cols = int(tensor.shape[0])  # GGUF lists dimensions innermost first: [K, N]
        rows = int(np.prod(tensor.shape[1:]))
        blocks = quant.decode(np.asarray(tensor.data), qtype, cols)
        order = _row_order(processor, name, rows)
        if order is not None:
            blocks = blocks.rows(order)
        packed = quant.pack(blocks)
        if match:
            weights.layers[(int(match.group(1)), role)] = packed
        elif name == "token_embd.weight":
            weights.embedding = packed
        else:
            weights.output = packed
    if weights.skipped:
        log.info("GGUF %s: %d matrices of types without a quantized kernel stay dense (%s)", path,
                 len(weights.skipped), ", ".join(sorted(set(weights.skipped.values()))))
    return weights

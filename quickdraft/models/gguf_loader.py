"""A GGUF model for the native runner, read straight from the file's blocks: no dequantized model on the way.

The transformers path (loader.load) dequantizes every tensor into a float32 model before the runner packs the
file's blocks again: loading the 1.04 GiB Qwen2.5-Coder-1.5B file peaked at 9.0 GB resident. Here:
- the transformers config comes from the file's metadata, read by transformers' quick reader (a memory-mapped
  walk over the header) and mapped as transformers' legacy reader maps it (fast_gguf_config: that reader,
  gguf.GGUFReader, makes a numpy object of every vocabulary entry, 20-75 s for the packaged models on a busy
  2-core machine, and the config and the tokenizer each ran it); the model skeleton is built on the meta device
  (buffers such as the rotary tables real, computed from the config as transformers computes them);
- the small dense tensors (norms, biases, and any matrix of a type without a quantized kernel) are
  dequantized from the file, through transformers' own tensor processor (Gemma's norm offset, Llama's q/k row
  order), and put into the skeleton in the model's dtype;
- every matrix the kernels take (models/gguf_weights.ROLES, the embedding, the output head) is read with
  pread and packed a slab of rows at a time (quant.decode, quant.pack: the same calls gguf_weights.read makes),
  so the only whole-matrix copy alive is the packed one; those matrices stay on the meta device in the
  skeleton (the runner reads only their shapes);
- the packed matrices are cached beside the conversion cache (quantized-vN.safetensors, as loader.quantized_weights
  writes them) and memory-mapped on later loads; the tokenizer, converted from the file's vocabulary once,
  is cached there too.
Resident memory then peaks near the packed bytes (within 3% of the file's tensors) plus one slab's
temporaries. Architectures without a native runner return None and go through the transformers path.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from quickdraft import progress
from quickdraft.kernels import quant
from quickdraft.kernels.quant import QuantizedWeight
from quickdraft.models import gguf_weights
from quickdraft.models.config import get_text_config
from quickdraft.models.gguf_weights import QuantizedWeights

log = logging.getLogger(__name__)

# Rows decoded and packed at a time: decode and pack hold ~8 bytes a weight of temporaries (codes, nibble
# planes, transposes), so a slab of 4M weights costs ~32 MB however large the matrix (the 1.5B's 233M-weight
# output head whole would take ~2 GB).
SLAB_WEIGHTS = 4 << 20


def read_config(path: Path):
    """The transformers config of the GGUF file at `path` (from its metadata, as from_pretrained reads it)."""
    from transformers import AutoConfig

    fast_gguf_config()
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


# GGUF architectures (those of quickdraft's native runners) whose transformers config config_from_metadata builds.
FAST_CONFIG_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


def fast_gguf_config() -> None:
    """Have transformers build the config of a GGUF file of FAST_CONFIG_ARCHITECTURES from its quick metadata
    reader (config_from_metadata), as it does for the architectures it lists in GGUF_CONFIG_ARCHS itself, instead
    of running gguf.GGUFReader over the whole header. AutoConfig and AutoTokenizer (which reads the config to pick
    the tokenizer's class) both consult that table; an architecture transformers builds its own way is left to
    it. The config is the same dict (tests/models/test_gguf_loader.py)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

    for architecture in FAST_CONFIG_ARCHITECTURES:
        GGUF_CONFIG_ARCHS.setdefault(architecture, config_from_metadata)


def config_from_metadata(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """The config dict transformers' legacy GGUF reader (modeling_gguf_pytorch_utils.load_gguf_checkpoint) makes
    for a file of FAST_CONFIG_ARCHITECTURES, from its quick reader's metadata (transformers.integrations.gguf
    .read_gguf_metadata: numbers and strings as they are, arrays of numbers as lists, arrays of strings as their
    length): the same mapping (GGUF_CONFIG_MAPPING), defaults and renames, without the legacy reader's branches
    for other architectures."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = metadata["general.architecture"]
    if architecture not in FAST_CONFIG_ARCHITECTURES:
        raise ValueError(f"quickdraft builds no config for GGUF architecture {architecture!r}")
    # transformers asks whether "mistral" is among general.name's values: a file named exactly "mistral"
    renamed = "mistral" if "llama" in architecture and metadata.get("general.name") == "mistral" else architecture
    config: dict = {"tie_word_embeddings": "output.weight" not in tensor_names}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(renamed, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, name = key.replace(architecture, renamed).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # the legacy reader gives a one-element array as its element
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, renamed)
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(name, -1)
        if target not in (None, -1):
            config[target] = value
    if config["model_type"] == "gemma3":
        config["model_type"] = "gemma3_text"  # the file holds the text model only
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and tokens is not None:
        config["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return config


def skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of `config` with every parameter on the meta device and its buffers real, in `dtype`
    (buffers cast as the transformers path's final `.to(dtype)` casts them)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(dtype=dtype).eval()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: "object"  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: innermost (the row's inputs) first
    data_offset: int  # absolute, in the file
    n_bytes: int


# GGUF metadata value types (gguf.GGUFValueType) of fixed size: type -> bytes. 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _File:
    """A GGUF file's tensor list and positioned reads of tensor bytes (pread: the bytes pass through the page
    cache, not this process's resident memory).

    The header is parsed here, not by gguf.GGUFReader: the reader makes a numpy object of every element of
    every metadata array, and a 152k-token vocabulary (tokens, merges) costs it ~10 s and ~500 MB; here the
    metadata is skipped over except general.architecture and general.alignment."""

    def __init__(self, path: Path):
        import gguf

        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        with open(path, "rb") as f:
            header = f.read(24)
            if len(header) < 24 or header[:4] != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file")
            version, n_tensors, n_kv = struct.unpack("<IQQ", header[4:])
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 and later are)")
            meta: dict[str, object] = {}
            for _ in range(n_kv):
                key = _string(f)
                (kind,) = struct.unpack("<I", f.read(4))
                meta[key] = _value(f, kind, keep=key in ("general.architecture", "general.alignment"))
            infos = []
            for _ in range(n_tensors):
                name = _string(f)
                (n_dims,) = struct.unpack("<I", f.read(4))
                shape = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
                kind, offset = struct.unpack("<IQ", f.read(12))
                infos.append((name, gguf.GGMLQuantizationType(kind), tuple(int(d) for d in shape), offset))
            alignment = int(meta.get("general.alignment") or 32)
            start = -(-f.tell() // alignment) * alignment
        self.architecture = str(meta.get("general.architecture") or "")
        self.tensors = []
        for name, kind, shape, offset in infos:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            self.tensors.append(TensorInfo(name, kind, shape, start + offset, int(np.prod(shape)) // block * size))

    def close(self) -> None:
        os.close(self.fd)

    def read(self, offset: int, size: int) -> np.ndarray:
        data = os.pread(self.fd, size, offset)
        if len(data) != size:
            raise ValueError(f"{self.path}: short read at {offset}: {len(data)} of {size} bytes (a truncated "
                             "GGUF file?)")
        return np.frombuffer(data, dtype=np.uint8)

    def tensor_bytes(self, tensor: TensorInfo, rows: slice | None = None) -> np.ndarray:
        """The stored bytes of `tensor` [rows, bytes a row] (rows: a slice of them)."""
        n_rows = int(np.prod(tensor.shape[1:]))
        row_bytes = tensor.n_bytes // n_rows
        lo, hi = (0, n_rows) if rows is None else (rows.start, rows.stop)
        return self.read(tensor.data_offset + lo * row_bytes, (hi - lo) * row_bytes).reshape(hi - lo, row_bytes)


def _string(f) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _value(f, kind: int, keep: bool):
    """Read (keep) or skip one metadata value of GGUF value type `kind` at f's position."""
    if kind in _SCALAR_BYTES:
        raw = f.read(_SCALAR_BYTES[kind])
        return int.from_bytes(raw, "little") if keep and kind not in (6, 12) else None
    if kind == 8:
        if keep:
            return _string(f)
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, 1)
        return None
    if kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALAR_BYTES:
            f.seek(count * _SCALAR_BYTES[item], 1)
        else:
            for _ in range(count):
                _value(f, item, keep=False)
        return None
    raise ValueError(f"unknown GGUF metadata value type {kind}")


def _pack_streamed(file: _File, tensor, processor, name: str) -> QuantizedWeight:
    """quant.pack(quant.decode(...)) of a whole matrix, done a slab of rows at a time into one packed tensor:
    packing works per group of 16 rows, so slabs of whole groups concatenated are the whole matrix packed."""
    qtype, cols = int(tensor.tensor_type), tensor.shape[0]  # GGUF lists dimensions innermost first
    rows = int(np.prod(tensor.shape[1:]))
    order = gguf_weights._row_order(processor, name, rows)
    slab = max(16, SLAB_WEIGHTS // cols // 16 * 16)
    whole = file.tensor_bytes(tensor) if order is not None else None  # permuted: q/k rows, small matrices
    out: torch.Tensor | None = None
    for lo in range(0, rows, slab):
        hi = min(rows, lo + slab)
        raw = whole[order[lo:hi]] if whole is not None else file.tensor_bytes(tensor, slice(lo, hi))
        part = quant.pack(quant.decode(raw, qtype, cols)).packed
        if out is None:
            out = torch.empty((-(-rows // 16),) + tuple(part.shape[1:]), dtype=part.dtype)
        out[lo // 16: lo // 16 + part.shape[0]] = part
    return QuantizedWeight(out, qtype, rows, cols)


def _dense(file: _File, tensor, processor, name: str) -> torch.Tensor:
    """A tensor dequantized to float32 as transformers' GGUF loader does it (its processor applied)."""
    from gguf import dequantize

    raw = file.read(tensor.data_offset, tensor.n_bytes)
    weights = dequantize(raw, tensor.tensor_type).reshape(tuple(reversed(tensor.shape)))
    return torch.from_numpy(np.array(processor.process(weights=weights, name=name).weights, dtype=np.float32))


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, attr)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"GGUF tensor for {name} has shape {tuple(value.shape)}, the model expects {tuple(old.shape)}")
    setattr(module, attr, nn.Parameter(value.to(old.dtype).contiguous(), requires_grad=False))


def fill(model: nn.Module, path: Path, packed: QuantizedWeights | None = None) -> QuantizedWeights:
    """Put the dense tensors of the GGUF file at `path` into the skeleton `model` (in its dtype), and return
    the file's packed matrices (read and packed here unless `packed`, e.g. from the cache, is given)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    text = get_text_config(model.config)
    file = _File(path)
    try:
        heads = text.num_attention_heads
        processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(
            config={"num_attention_heads": heads, "num_key_value_heads": getattr(text, "num_key_value_heads", heads)})
        hf_names = get_gguf_hf_weights_map(model, processor)
        row_orders = gguf_weights._row_orders(file.architecture, text)
        weights = QuantizedWeights(str(path)) if packed is None else packed
        names = {t.name for t in file.tensors}
        weights.tied = "output.weight" not in names
        step = (f"reading {path.name}: packing its tensors for the kernels (once; kept in the cache)"
                if packed is None else f"reading {path.name}")
        with progress.task(step, total=len(file.tensors),
                           done=f"packed {path.name}'s tensors" if packed is None else None) as advance:
            for tensor in file.tensors:
                _read_tensor(model, file, tensor, hf_names, processor, row_orders, weights, packed)
                advance()
    finally:
        file.close()
    _tie(model)
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta" and not _covered(n, model, weights)]
    if missing:
        raise ValueError(f"{path}: no tensor in the file for {', '.join(missing[:5])}")
    return weights


def _read_tensor(model: nn.Module, file: _File, tensor: TensorInfo, hf_names: dict, processor, row_orders,
                 weights: QuantizedWeights, packed: QuantizedWeights | None) -> None:
    """One tensor of the file: packed into `weights` (unless `packed` holds it already) or put into `model`."""
    name = tensor.name
    if name not in hf_names:
        return  # what transformers' loader skips too (e.g. rope_freqs)
    if _packs(name, int(tensor.tensor_type)):
        if packed is None:
            _store(weights, name, _pack_streamed(file, tensor, row_orders, name))
        return
    if _packable_role(name):
        weights.skipped[name] = tensor.tensor_type.name
    _set_parameter(model, hf_names[name], _dense(file, tensor, processor, name))


def _packable_role(name: str) -> bool:
    match = gguf_weights._LAYER.match(name)
    return (match is not None and match.group(2) in gguf_weights.ROLES) or name in ("token_embd.weight",
                                                                                    "output.weight")


def _packs(name: str, qtype: int) -> bool:
    return _packable_role(name) and qtype in quant.SUPPORTED


def _store(weights: QuantizedWeights, name: str, packed: QuantizedWeight) -> None:
    match = gguf_weights._LAYER.match(name)
    if match:
        weights.layers[(int(match.group(1)), gguf_weights.ROLES[match.group(2)])] = packed
    elif name == "token_embd.weight":
        weights.embedding = packed
    else:
        weights.output = packed


def _tie(model: nn.Module) -> None:
    """A tied output head shares the embedding's parameter (real if the embedding was read dense)."""
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(get_text_config(model.config), "tie_word_embeddings", False) and output is not None:
        output.weight = embedding.weight


_HF_LAYER = re.compile(r"layers\.(\d+)\.\w+\.(q|k|v|o|gate|up|down)_proj\.weight$")
_HF_ROLES = {"q": "q", "k": "k", "v": "v", "o": "o", "gate": "gate", "up": "up", "down": "down"}


def _covered(name: str, model: nn.Module, weights: QuantizedWeights) -> bool:
    """Whether meta parameter `name` is a matrix the packed weights hold (the runner takes it from there)."""
    inner_prefix = getattr(model, "base_model_prefix", "model") + "."
    if name == "lm_head.weight":
        return weights.output is not None or (weights.tied and weights.embedding is not None)
    if name == inner_prefix + "embed_tokens.weight":
        return weights.embedding is not None
    match = _HF_LAYER.search(name)
    return match is not None and weights.get(int(match.group(1)), _HF_ROLES[match.group(2)]) is not None

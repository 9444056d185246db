"""Resolving and loading models: packaged aliases, GGUF files, local directories and hub ids.

Where a model string points (aliases, part packages and their hashes, files, hub ids) is models/sources.py.

Where the native runner keeps a GGUF file's blocks (load_for_runner), the model is read straight from the file
(models/gguf_loader.py). Elsewhere GGUF files are dequantised by transformers at load (tens of seconds on a small
CPU). Either way what was made is kept in a local conversion cache (safetensors) keyed by the file's path, size
and mtime, so the second load of the same file takes about a second. Set QUICKDRAFT_NO_CONVERSION_CACHE=1 to
always convert. The long first steps show their progress (quickdraft/progress.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from quickdraft import progress
from quickdraft.errors import ModelNotFoundError, QuickdraftError
from quickdraft.kernels import cpu_has_bf16
from quickdraft.models import huge_pages
from quickdraft.models.config import get_text_config
from quickdraft.models.sources import (  # noqa: F401 (re-exported: where users and tests have looked)
    ALIASES, DEFAULT_MODEL, QWEN_CODER_0_5B, QWEN_CODER_1_5B, Alias, ModelSource, PartedGGUF, cache_root, check_gguf,
    resolve)

log = logging.getLogger(__name__)


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
    return cache_root() / "converted" / f"{source.gguf_path.stem}-{key}"


def _load_tokenizer(path, gguf_file: str | None, trust_remote_code: bool, local_files_only: bool = False):
    from transformers import AutoTokenizer

    if gguf_file is not None:
        from quickdraft.models.gguf_loader import fast_gguf_config

        fast_gguf_config()  # AutoTokenizer reads the file's config first, to pick the tokenizer's class
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
            converting = contextlib.nullcontext()
            if source.gguf_file is not None:
                from quickdraft.models.gguf_loader import fast_gguf_config

                fast_gguf_config()
                kept = "once; kept in the cache" if converted is not None else "QUICKDRAFT_NO_CONVERSION_CACHE is set"
                converting = progress.task(f"converting {source.gguf_file} with transformers (dequantizing every "
                                           f"tensor; {kept})", done=f"converted {source.gguf_file}")
            with converting:
                model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                             **load_kwargs)
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


def load_for_runner(source: ModelSource, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
                    keep_quantized: bool = True):
    """(model, tokenizer, quantized weights or None) for a runner. Where the native runner keeps a GGUF
    file's blocks (keep_quantized, the CPU, a quantized kernel for dtype: see kernels.quant_kernels; an
    architecture it has), the model is read straight from the file (models/gguf_loader: a skeleton whose
    packed matrices stay on the meta device, resident memory near the file's size); elsewhere the
    transformers path (load, then quantized_weights). Either way the packed matrices go into huge pages where
    QUICKDRAFT_HUGE_PAGES=1 asks (models/huge_pages)."""
    loaded = _load_direct(source, dtype) if keep_quantized and _keeps_blocks(source, dtype, device) else None
    if loaded is None:
        model, tokenizer = load(source, dtype, device, trust_remote_code)
        loaded = model, tokenizer, quantized_weights(source, model, dtype, device) if keep_quantized else None
    model, tokenizer, blocks = loaded
    if blocks is not None:  # after any cache is written: the bytes stay the same
        huge_pages.move_into_huge_pages(blocks)
    return model, tokenizer, blocks


def _keeps_blocks(source: ModelSource, dtype: torch.dtype, device: torch.device) -> bool:
    from quickdraft import kernels

    return source.gguf_path is not None and device.type == "cpu" and kernels.quant_kernels(dtype) is not None


def _packed_cache(source: ModelSource) -> Path | None:
    from quickdraft.kernels import quant

    converted = _conversion_dir(source)
    # The file name carries the packed layout's version: a cache written by another layout is not read.
    return converted / f"quantized-v{quant.LAYOUT_VERSION}.safetensors" if converted is not None else None


def _read_packed_cache(cached: Path | None):
    from quickdraft.models import gguf_weights

    if cached is None or not cached.is_file():
        return None
    try:
        weights = gguf_weights.load(cached)  # memory-mapped (safetensors): pages read as the forwards touch them
    except Exception as exc:  # a damaged cache only costs the time to read the file again
        log.warning("could not read the cached quantized weights %s (%s); reading the GGUF file", cached, exc)
        return None
    from quickdraft.kernels import quant

    now_packed = sorted({kind for kind in weights.skipped.values() if kind in quant.NAMES.values()})
    if now_packed:  # written before these types had kernels: the file's matrices of them would stay dense
        log.info("the cached quantized weights %s predate the %s kernels; reading the GGUF file", cached,
                 ", ".join(now_packed))
        return None
    return weights


def _write_packed_cache(weights, cached: Path | None) -> None:
    from quickdraft.models import gguf_weights

    if cached is None:
        return
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        gguf_weights.save(weights, cached)
    except OSError as exc:
        log.warning("could not cache the quantized weights in %s: %s", cached, exc)


def _load_direct(source: ModelSource, dtype: torch.dtype):
    """(skeleton, tokenizer, packed weights) read straight from the GGUF file, or None where the architecture
    has no native runner (the caller takes the transformers path)."""
    from quickdraft.models import gguf_loader
    from quickdraft.models.weights import supports

    path = source.gguf_path
    try:
        config = _cached(source, "gguf-config", lambda: gguf_loader.read_config(path), _read_saved_config)
        model = gguf_loader.skeleton(config, dtype)
    except (ValueError, KeyError) as exc:  # an architecture transformers reads only its own way
        log.info("%s: no direct GGUF load (%s); loading through transformers", path, exc)
        return None
    reason = supports(model)
    if reason is not None:
        log.info("%s: %s; loading through transformers", path, reason)
        return None
    # The tokenizer before the weights: converting a 152k vocabulary peaks ~0.5 GB above what it keeps, and
    # that peak should not sit on top of the packed matrices.
    tokenizer = _cached(source, "tokenizer", lambda: _load_tokenizer(source.path, source.gguf_file, False),
                        _read_saved_tokenizer)
    cached = _packed_cache(source)
    packed = _read_packed_cache(cached)
    weights = gguf_loader.fill(model, path, packed)
    if packed is None:
        # Kept as made (swapping them for the file just written would hold both until the allocator returns
        # the freed pages: 1.7x the file's size at the peak, measured); the next load maps the file.
        _write_packed_cache(weights, cached)
    return model, tokenizer, weights


def _read_saved_config(saved: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(saved)


def _read_saved_tokenizer(saved: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(saved)


def _cached(source: ModelSource, name: str, make: Callable, read: Callable):
    """make() once, kept in the conversion cache's folder `name` (save_pretrained) and read() from there later
    (a GGUF file's config and tokenizer: parsing its metadata takes seconds for a 152k vocabulary)."""
    converted = _conversion_dir(source)
    saved = converted / name if converted is not None else None
    if saved is not None and saved.is_dir():
        try:
            return read(saved)
        except (OSError, ValueError) as exc:
            log.warning("could not read the cached %s (%s); making it again", saved, exc)
    made = make()
    if made is not None and saved is not None:
        tmp = saved.with_name(f"{name}.tmp{os.getpid()}")
        try:
            made.save_pretrained(tmp)
            if saved.exists():
                shutil.rmtree(saved)
            tmp.rename(saved)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("could not cache %s in %s: %s", name, saved, exc)
    return made


def quantized_weights(source: ModelSource, model, dtype: torch.dtype, device: torch.device):
    """A GGUF model's quantized matrices in their stored format (models/gguf_weights.py), or None where the
    runner cannot use them: not a GGUF file, not the CPU, not bf16 activations, no AVX512-BF16 kernels."""
    from quickdraft.models import gguf_weights

    if not _keeps_blocks(source, dtype, device):
        return None
    cached = _packed_cache(source)
    weights = _read_packed_cache(cached)
    if weights is not None:
        return weights
    weights = gguf_weights.read(source.gguf_path, get_text_config(model.config))
    _write_packed_cache(weights, cached)
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
        if target.is_dir():  # holding the packed blocks or the tokenizer of a direct load: move the files in
            for entry in sorted(tmp.iterdir(), key=lambda e: e.name == "config.json"):  # config.json last: it
                os.replace(entry, target / entry.name)  # marks the conversion complete
            tmp.rmdir()
        else:
            tmp.rename(target)
    except OSError as exc:  # a read-only or full disk only costs speed
        log.warning("could not cache the converted model in %s: %s", target, exc)

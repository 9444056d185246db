"""Compiled kernels, built on first use by the machine's C++ compiler (torch.utils.cpp_extension).

`cpu_linear()` returns the module built from cpu_linear.cpp (weight-streaming bf16 and int8 linear layers
for x86 CPUs with AVX512-BF16, on AMX tiles where present) and cpu_attention.cpp (a decoding step's attention
and RMSNorm), or None where it cannot run: another CPU, no compiler, or QUICKDRAFT_NO_KERNELS=1.
Callers then use torch's own matmul. The build is cached under ~/.cache/quickdraft/kernels (QUICKDRAFT_CACHE
moves it), one directory per torch version and per variant: the AMX tile kernels are compiled only on CPUs with
AMX (variant avx512-amx), not where they would never run (avx512). `python -m quickdraft.kernels` builds them
ahead of use (scripts/setup.sh does); BUILD_TIME says what a build takes.

`cpu_quant_avx2()` returns the module built from cpu_quant_avx2.cpp alone (GGUF-quantized linear layers on AVX2
integer dot products) for x86 CPUs without AVX-512, or None. `quant_kernels(dtype)` is the module that runs a
GGUF file's blocks with `dtype` activations on this CPU: the AVX-512 one for bf16 where it loads, else the AVX2 one
when QUICKDRAFT_AVX2_KERNELS=1 (opt-in: with it, greedy speculative output can differ from plain greedy output,
because torch's float32 attention rounds a row by the call's shape and the int8 activations magnify that).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from quickdraft import progress

log = logging.getLogger(__name__)

_SOURCES = [str(Path(__file__).with_name(name)) for name in (
    "cpu_linear.cpp", "cpu_attention.cpp", "cpu_decoder.cpp", "cpu_quant.cpp", "cpu_quant_vnni.cpp",
    "cpu_rows.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("cpu_quant.h", "cpu_quant_scalar.h")]
# What the first build takes, said before it starts. Measured on a 2-core AMD EPYC without AMX (variant avx512):
# 206 CPU-seconds (368 when every source included torch/extension.h and the AMX kernels were compiled everywhere,
# then 163 s on the machine alone); ninja compiles a source per core, so more cores take less.
BUILD_TIME = "1.5-2 minutes on 2 cores"
AVX2_BUILD_TIME = "about half a minute"  # its one source
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    root = Path(os.environ.get("QUICKDRAFT_CACHE", Path.home() / ".cache" / "quickdraft"))
    return root / "kernels" / f"torch-{torch.__version__}"


def _variant() -> tuple[str, list[str]]:
    """(name, compiler flags) of the AVX-512 module this CPU runs: with the AMX tile kernels where it has AMX,
    else without them (their templates, instantiated for every GGUF type, are a large part of the build)."""
    amx = "amx_tile" in _cpu_flags() or bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return ("avx512-amx", ["-DQUICKDRAFT_AMX=1"]) if amx else ("avx512", [])


def _build_dir() -> Path:
    """Where the AVX-512 module of this CPU's variant is built and cached."""
    return _cache_dir() / _variant()[0]


@contextlib.contextmanager
def _build_lock(build: Path):
    """Held while a process builds or loads the kernels in `build`. torch's own `lock` file there is created and
    deleted by the building process, so a build killed midway (Ctrl-C, a test run's timeout) leaves it behind and
    every later load waits on it forever. An fcntl lock is released by the kernel when its holder dies; holding it,
    no other quickdraft process is building, so a `lock` file found then is stale and is removed."""
    with open(build / "quickdraft.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                log.warning("quickdraft: removing a stale kernel build lock left by an interrupted build (%s)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _needs_build(name: str, sources: list[str], build: Path) -> bool:
    """Whether loading module `name` from `build` compiles first: no module yet, or a source newer than it."""
    module = build / f"{name}.so"
    if not module.is_file():
        return True
    built = module.stat().st_mtime
    return any(Path(path).stat().st_mtime > built for path in [*sources, *_HEADERS] if Path(path).exists())


def _load(name: str, sources: list[str], build: Path, cflags: list[str], what: str, takes: str = BUILD_TIME):
    """The module `name` built from `sources` in `build` (compiled first where needed: a warning saying what it
    `takes`, or a progress line counting the compiled sources where progress is shown)."""
    from torch.utils import cpp_extension

    with _build_lock(build):
        if not _needs_build(name, sources, build):
            return cpp_extension.load(name=name, sources=sources, build_directory=str(build), extra_cflags=cflags,
                                      extra_ldflags=["-fopenmp"], verbose=False)
        if not progress.shown():
            log.warning("quickdraft: compiling its %s (once per machine and torch version; %s, less on more cores)",
                        what, takes)
        description = f"compiling quickdraft's {what}, once ({takes})"
        with progress.task(description, total=len(sources) + 1, done=f"compiled quickdraft's {what}") as advance:
            stop = threading.Event()
            watcher = threading.Thread(target=_count_objects, args=(build, len(sources), advance, stop), daemon=True)
            watcher.start()
            try:
                module = cpp_extension.load(name=name, sources=sources, build_directory=str(build),
                                            extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)
            finally:
                stop.set()
                watcher.join()
            advance(len(sources) + 1, absolute=True)
        return module


def _count_objects(build: Path, count: int, advance, stop: threading.Event) -> None:
    """Report the object files compiled in `build` since this build began (ninja writes one per source)."""
    existing = {path: path.stat().st_mtime for path in build.glob("*.o")}
    while not stop.wait(0.5):
        fresh = [path for path in build.glob("*.o") if existing.get(path) != _mtime(path)]
        advance(min(len(fresh), count), absolute=True)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:  # ninja replacing it
        return None


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check is not None and check() for check in checks)


def cpu_linear():
    if "cpu_linear" in _state:
        return _state["cpu_linear"]
    module = None

    if os.environ.get("QUICKDRAFT_NO_KERNELS"):
        reason = "QUICKDRAFT_NO_KERNELS is set"
    elif not cpu_has_bf16():
        reason = "this CPU lacks AVX512-BF16"
    else:
        reason = None
        try:
            build = _build_dir()
            build.mkdir(parents=True, exist_ok=True)
            module = _load("quickdraft_cpu_linear", _SOURCES, build,
                           ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp",
                            *_variant()[1]], "CPU kernels")
        except Exception as error:  # no compiler, no ninja, a compile error: fall back, say why once
            reason = f"the build failed ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})"
    if reason and cpu_has_bf16() and not os.environ.get("QUICKDRAFT_NO_KERNELS"):
        # This CPU should have had them: say so visibly, once, with what it costs.
        log.warning("quickdraft: CPU kernels unavailable, using torch matmuls: %s. bf16 runs slower, and torch "
                    "rounds a row differently depending on how many rows a call has, so in bf16 greedy speculative "
                    "output may differ from plain greedy output at near-ties (float32 is unaffected in practice)",
                    reason)
    elif reason:
        log.info("quickdraft: CPU kernels unavailable, using torch matmuls: %s", reason)
    _state["cpu_linear"] = module
    _state["cpu_linear_reason"] = reason
    return module


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_description() -> str:
    """The CPU's model name and the flags that choose quickdraft's kernels (for reports: figures say which
    machine they came from)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), name)
    except OSError:
        pass
    flags = _cpu_flags()
    present = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "AVX512-VNNI"),
                                         ("amx_int8", "AMX-INT8"), ("avx2", "AVX2")) if flag in flags]
    return f"{name} ({', '.join(present) or 'none of AVX2, AVX512-BF16/VNNI, AMX'}; {os.cpu_count()} CPUs)"


def model_quant_kernel(preferred: str | None) -> str:
    """The quantized kernel a model whose family prefers `preferred` (models/families.py) asks its GGUF blocks
    for: `preferred` on CPUs whose AVX-512 kernels load and have VNNI but no usable AMX tiles, "" (the kernels'
    default, int16) elsewhere. Where AMX tiles run, calls of 8 rows or more take them with int16 only, and one-digit
    schemes were measured on CPUs without them (benchmarks/RESULTS.md, session 27). QUICKDRAFT_QUANT_KERNEL
    overrides every model's choice (kernels/cpu_quant.cpp)."""
    module, flags = cpu_linear(), _cpu_flags()
    if not preferred or module is None or "avx512_vnni" not in flags:
        return ""
    return "" if "amx_int8" in flags and module.amx_available() else preferred


def cpu_quant_avx2():
    """The AVX2 quantized-linear module, or None (another CPU, no compiler, QUICKDRAFT_NO_KERNELS=1)."""
    if "cpu_quant_avx2" in _state:
        return _state["cpu_quant_avx2"]
    module = None
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", or "DEFAULT" / another ISA
    if os.environ.get("QUICKDRAFT_NO_KERNELS"):
        reason = "QUICKDRAFT_NO_KERNELS is set"
    elif capability not in ("AVX2", "AVX512") or not {"fma", "f16c"} <= _cpu_flags():
        reason = f"this CPU lacks AVX2, FMA or F16C (torch reports {capability})"
    else:
        reason = None
        try:
            build = _cache_dir() / "avx2"
            build.mkdir(parents=True, exist_ok=True)
            module = _load("quickdraft_cpu_quant_avx2", [str(Path(__file__).with_name("cpu_quant_avx2.cpp"))], build,
                           ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], "AVX2 quantized kernels", AVX2_BUILD_TIME)
        except Exception as error:  # as cpu_linear(): fall back to float32 weights, say why
            reason = f"the build failed ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})"
            log.warning("quickdraft: AVX2 quantized kernels unavailable, GGUF weights widened to float32: %s", reason)
    if reason and module is None:
        log.info("quickdraft: AVX2 quantized kernels unavailable: %s", reason)
    _state["cpu_quant_avx2"] = module
    return module


def quant_kernels(dtype: torch.dtype):
    """The module whose linear_quant runs GGUF blocks with `dtype` activations on this CPU, or None: cpu_linear()
    for bf16 or float32 ones (AVX512-BF16 CPUs; its integer kernels quantize either as it is), else, with
    QUICKDRAFT_AVX2_KERNELS=1, the AVX2 module where AVX-512's does not
    load (its activations float32 or bf16). Both take the same packed chunks (kernels.quant.pack) and compute
    every row alike. Why AVX2's is opt-in: the rest of that forward is torch's float32 (attention included), whose
    rows are not computed alike whatever the call, and a tiny difference moves an activation's int8 rounding:
    measured on SmolLM2 Q4_1, greedy ngram/suffix speculative output differed from plain output after 7 tokens."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    if cpu_linear() is not None:
        return cpu_linear()
    return cpu_quant_avx2() if os.environ.get("QUICKDRAFT_AVX2_KERNELS") == "1" else None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (K even) -> [ceil(N/16), K/2, 16, 2], the layout cpu_linear reads; padded outputs are zero."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack needs an even input size, got {k}")
    padded = -n % 16
    if padded:
        weight = torch.cat([weight, weight.new_zeros(padded, k)])
    return weight.reshape(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()

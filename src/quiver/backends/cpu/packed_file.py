"""ORT's packed weights in a file, made once per machine and mapped by every process that opens the graph.

ORT repacks MatMul weights into its own layout when it makes a session: about the graph's weight bytes
again, private to the process. Replicas of a server on one machine (Ray Serve's, one process each) would
each hold that copy. ORT can write the packed weights into an optimized model's external data
(`session.save_external_prepacked_constant_initializers`), and a session made from that model maps them
from the file instead of packing again: one copy in the page cache for every process (measured on
SmolLM2-135M's batched graph: 431 MB private per added process instead of 1102, the same logits and step).

A form is kept in `<folder>/<key>/` (`model.onnx`, `weights.bin`, `manifest.json`), the key a digest of
what the packing depends on: the ORT build, the processor, the session model, the weights (the context
file's identity) and the session settings. It is made under a lock, in a staging folder renamed into
place, so a process sees a whole form or none; its manifest's CRC-32 of each file is checked, and a
damaged form is made again. A full check leaves a stamp of the files' identities (`CHECKED`), and a later
open whose files still have them skips the read (a 1B float form is ~5 GB to read at each replica's start):
any write to a file after the check changes its change time, any replacement its inode. A folder may be
deleted whenever: sessions that map it keep their pages, later ones make it again.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from quiver import portable
from quiver.backends.cpu.settings import machine_fingerprint
from quiver.errors import BackendError
from quiver.formats.checksums import crc32
from quiver.formats.files import OFF_VALUES, cache_folder_setting
from quiver.ort_package import onnxruntime as ort

FOLDER_ENV = "QUIVER_PACKED_WEIGHTS"
MODEL, WEIGHTS, MANIFEST, CHECKED = "model.onnx", "weights.bin", "manifest.json", "checked.json"
_FORMAT = 1
# A stamp is written only for files last changed this long before their check began: a change within one
# tick of the file system's coarse clock may keep a file's change time (git's "racily clean" entries).
RACY_CHANGE_S = 2.0


class FormNotMadeError(BackendError):
    """ORT would not write this graph's packed form: the graph packs in each process instead."""


def default_folder() -> Path | None:
    """Where packed forms are kept by default: `$QUIVER_PACKED_WEIGHTS`, else `~/.cache/quiver/packed-weights`
    (None when that variable says `off`)."""
    return cache_folder_setting(FOLDER_ENV, "packed-weights")


def save_entries() -> dict[str, str]:
    """The session options, besides `optimized_model_filepath` (the form's MODEL), that make ORT write a form:
    every weight in WEIGHTS beside it (named relative to the model), the packed ones included."""
    return {
        "session.optimized_model_external_initializers_file_name": WEIGHTS,
        "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
        "session.save_external_prepacked_constant_initializers": "1",
    }


def folder_from(value: str | Path | None) -> Path | None:
    """A folder option's meaning: None, '' or 'off' for none, 'default' for `default_folder()`, else itself."""
    if value is None or str(value).strip().lower() in OFF_VALUES | {""}:
        return None
    if str(value) == "default":
        return default_folder()
    return Path(value)


def form_key(session_model: bytes, weights_identity: str, config: Mapping[str, str], level: int) -> str:
    """What a packed form depends on: this ORT build and processor, the model, its weights, the settings."""
    digest = hashlib.sha256()
    for part in (
        f"format {_FORMAT}",
        f"onnxruntime {ort.__version__}",
        json.dumps(machine_fingerprint(), sort_keys=True),
        weights_identity,
        json.dumps(dict(config), sort_keys=True),
        f"level {level}",
    ):
        digest.update(part.encode() + b"\0")
    digest.update(session_model)
    return digest.hexdigest()[:40]


@dataclass(frozen=True)
class PackedForm:
    """A checked form: its folder (the weights file's) and its model's bytes."""

    folder: Path
    model: bytes


def open_or_make(root: Path, key: str, make: Callable[[Path], None]) -> PackedForm:
    """The form under `root` with this key; made by `make(staging folder)` (which writes MODEL and WEIGHTS
    there) when there is none, or the one there is damaged. One process makes it, the others wait."""
    target = root / key
    form = _checked(target)
    if form is not None:
        return form
    written: dict[str, list[int]] | None = None  # the identities of the files this process wrote
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with _locked(root / f".{key}.lock"):
            form = _checked(target)  # made while this process waited
            if form is not None:
                return form
            for stale in root.glob(f".making-{key}-*"):  # left by a maker that died: nobody else makes this key
                shutil.rmtree(stale, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=f".making-{key}-", dir=root))
            try:
                make(staging)  # FormNotMadeError goes to the caller, the staging folder removed
                _write_manifest(staging)
                written = _identity(staging)  # a rename of their folder keeps them
                if target.exists():  # damaged: out of the way first (processes mapping it keep their pages)
                    aside = Path(tempfile.mkdtemp(prefix=f".damaged-{key}-", dir=root))
                    os.rename(target, aside / key)
                    shutil.rmtree(aside, ignore_errors=True)
                os.rename(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise BackendError(
            f"cannot keep packed weights in {root}: {exc}; choose a writable folder ({FOLDER_ENV}), or turn them off"
        ) from None
    form = _checked(target, written)
    if form is None:
        raise BackendError(f"the packed weights just written to {target} do not read back whole; is the disk full?")
    return form


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (released by the kernel if the process dies)."""
    with open(path, "a+b") as handle:
        portable.lock_file(handle.fileno())
        try:
            yield
        finally:
            portable.unlock_file(handle.fileno())


def _file_crc(path: Path) -> int:
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return crc32(b"")
        with mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ) as view:
            return crc32(view)


def _write_manifest(folder: Path) -> None:
    files = {n: {"size": (folder / n).stat().st_size, "crc32": _file_crc(folder / n)} for n in (MODEL, WEIGHTS)}
    (folder / MANIFEST).write_text(json.dumps({"format": _FORMAT, "onnxruntime": ort.__version__, "files": files}))
    for name in (MODEL, WEIGHTS, MANIFEST):  # on disk before the folder is renamed into place
        with open(folder / name, "rb") as handle:
            os.fsync(handle.fileno())


def _identity(folder: Path) -> dict[str, list[int]]:
    """What changes when a form's file is written to or replaced: device, inode, size, modification and
    change times (the change time cannot be set back by a program)."""
    identity = {}
    for name in (MODEL, WEIGHTS, MANIFEST):
        stat = (folder / name).stat()
        identity[name] = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
    return identity


def _stamped(folder: Path, identity: dict[str, list[int]]) -> bool:
    """Whether the form's stamp records these very files as checked whole."""
    try:
        return bool(json.loads((folder / CHECKED).read_text()) == {"format": _FORMAT, "files": identity})
    except (OSError, ValueError):
        return False


def _stamp(folder: Path, identity: dict[str, list[int]], check_began_ns: int) -> None:
    """Records that the files with `identity` were checked whole, unless one changed too close to the check
    (`RACY_CHANGE_S`); replaced, never written in place. Best effort: without it the next open checks again."""
    if any(ctime > check_began_ns - int(RACY_CHANGE_S * 1e9) for *_, ctime in identity.values()):
        return
    try:
        descriptor, name = tempfile.mkstemp(dir=folder, prefix=f".{CHECKED}-")
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "w") as handle:
            json.dump({"format": _FORMAT, "files": identity}, handle)
        os.replace(name, folder / CHECKED)
    except OSError:
        with suppress(OSError):
            os.unlink(name)


def _checked(folder: Path, written: dict[str, list[int]] | None = None) -> PackedForm | None:
    """The form in `folder` if it is whole: its manifest well formed, every file of the size and CRC-32
    it names; else None. The CRC-32s are not read again where its stamp records these files as checked, or
    where they are the files `written` names, whose CRC-32s this process computed as it wrote them (a second
    read would come from the page cache and prove nothing: 9.9 GB for a 1B float graph)."""
    try:
        identity = _identity(folder)
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"] if isinstance(manifest, dict) and manifest.get("format") == _FORMAT else None
        if not isinstance(files, dict) or set(files) != {MODEL, WEIGHTS}:
            return None
        for name, expected in files.items():
            if not isinstance(expected, dict) or identity[name][2] != expected.get("size"):
                return None
        if identity != written and not _stamped(folder, identity):
            began = time.time_ns()
            if any(_file_crc(folder / name) != expected.get("crc32") for name, expected in files.items()):
                return None
            _stamp(folder, identity, began)
        return PackedForm(folder, (folder / MODEL).read_bytes())
    except (OSError, ValueError, KeyError, TypeError):
        return None

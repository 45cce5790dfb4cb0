"""A model folder a node lacks, copied from where the config says and checked before use (Ray replicas).

`ensure_model_folder(config, source)` returns `config` when the file exists. Otherwise it copies the
folder from `source` (a folder on a shared mount, or a `file://`, `http://` or `https://` URL of one): the
dialog config first, then every file it names (its context, tokenizer, adapters' sections) and the chat
template files when the source has them. Each context and section is checked against its own SHA-256
checksums (`quiver verify`'s check) before the folder appears: the copy is made in a staging folder beside
it and renamed into place, so a reader sees the whole checked folder or none, and a damaged copy is
refused and removed. Two processes racing on one node: the first rename wins, the other's copy is dropped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Protocol

from quiver.errors import CorruptFileError, FileAccessError, QuiverError
from quiver.formats.files import open_regular
from quiver.formats.layout import SECTION_MAGIC
from quiver.formats.reader import ContextFile
from quiver.formats.section import SectionFile
from quiver.t2t.config import read_dialog_config

OPTIONAL_FILES = ("tokenizer_config.json", "chat_template.jinja")  # what `quiver serve` reads when present
_CHUNK = 1 << 20
_LARGEST_FILE = 1 << 40  # no single model file is larger; a source that says otherwise is refused


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


class ModelSourceError(QuiverError):
    """A model folder could not be copied from its source, or the copy was damaged (and was removed)."""


def ensure_model_folder(config: str | Path, source: str | None, timeout: float = 60.0) -> Path:
    """`config` if it exists; else its folder copied from `source` and checked (the module docstring)."""
    config = Path(config)
    if config.is_file():
        return config
    if not source:
        raise ModelSourceError(f"{config} does not exist on this machine, and no source to copy it from is given")
    folder = config.parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        _copy(source, config.name, staging, timeout)
        names = _named_files(staging / config.name, staging)
        for name in names:
            _copy(source, name, staging, timeout)
        for name in OPTIONAL_FILES:
            if name not in names:
                _copy(source, name, staging, timeout, optional=True)
        for name in names:
            _check(staging / name, source)
        try:
            os.rename(staging, folder)  # atomic: the whole checked folder, or none
        except OSError:
            if not config.is_file():  # not another process's copy that won the race
                raise
    except OSError as exc:
        raise ModelSourceError(f"cannot place the copy of {source} at {folder}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return config


def _named_files(config: Path, root: Path) -> list[str]:
    """The files a dialog config names, as paths inside its folder (one outside it is refused)."""
    try:
        dialog = read_dialog_config(config, files_present=False)  # they are copied next
    except QuiverError as exc:
        raise ModelSourceError(f"the source's dialog config is not one Quiver can serve: {exc}") from None
    paths = [*dialog.ctx_bins, dialog.tokenizer, *(p for a in dialog.adapters.values() for p in a.bin_sections)]
    names = []
    for path in paths:
        try:
            names.append(path.relative_to(root.resolve()).as_posix())
        except ValueError:
            raise ModelSourceError(f"the source's dialog config names {path}, outside its folder: refused") from None
    return sorted(set(names))


def _copy(source: str, name: str, staging: Path, timeout: float, optional: bool = False) -> None:
    """`name` from `source` into `staging`, read in chunks up to the length it announces (when it does)."""
    target = staging / name
    target.parent.mkdir(parents=True, exist_ok=True)
    url = urllib.parse.urlsplit(source)
    try:
        if url.scheme in ("http", "https", "file"):
            with urllib.request.urlopen(f"{source.rstrip('/')}/{urllib.parse.quote(name)}", timeout=timeout) as reply:
                announced = reply.headers.get("Content-Length") if url.scheme != "file" else None
                _stream(reply, target, int(announced) if announced and announced.isdigit() else None, source, name)
        elif url.scheme:
            raise ModelSourceError(f"source {source!r}: give a folder or a file://, http:// or https:// URL")
        else:
            with open_regular(Path(source) / name) as file:
                _stream(file, target, None, source, name)
    except (urllib.error.HTTPError, FileAccessError, FileNotFoundError) as exc:
        if optional and (not isinstance(exc, urllib.error.HTTPError) or exc.code == 404):
            return
        raise ModelSourceError(f"cannot copy {name} from {source}: {exc}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ModelSourceError(f"cannot copy {name} from {source}: {exc}") from None


def _stream(reader: _Readable, target: Path, announced: int | None, source: str, name: str) -> None:
    if announced is not None and announced > _LARGEST_FILE:
        raise ModelSourceError(f"{source}: {name} announces {announced} bytes, more than any model file: refused")
    read = reader.read
    written = 0
    with open(target, "wb") as out:
        while chunk := read(_CHUNK):
            written += len(chunk)
            if written > (announced if announced is not None else _LARGEST_FILE):
                raise ModelSourceError(f"{source}: {name} is longer than announced: refused")
            out.write(chunk)
    if announced is not None and written != announced:
        raise ModelSourceError(f"{source}: {name} ended after {written} of {announced} bytes: copy it again")


def _check(path: Path, source: str) -> None:
    """A context or a section, checked against its own checksums; other files are left to their readers."""
    with open_regular(path) as file:
        head = file.read(8)
    kind = (
        SectionFile if head.startswith(SECTION_MAGIC) else ContextFile if head.startswith(ContextFile.MAGIC) else None
    )
    if kind is None:
        return
    try:
        opened = kind.open(path)
    except CorruptFileError as exc:
        raise ModelSourceError(f"the copy of {path.name} from {source} is damaged ({exc}); it was removed") from None
    try:
        problems = opened.verify()
    finally:
        opened.close()
    if problems:
        raise ModelSourceError(f"the copy of {path.name} from {source} is damaged ({'; '.join(problems[:3])}); "
                               "it was removed: fix the source")  # fmt: skip

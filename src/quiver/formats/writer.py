"""Streaming, deduplicating, atomic writer of `.qctx` files: WEIGHTS -> DONE | ABORTED."""

from __future__ import annotations

import bisect
import enum
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

from quiver import portable
from quiver.errors import ContextStateError, DuplicateGraphError, FileAccessError
from quiver.formats import compression
from quiver.formats.checksums import crc32
from quiver.formats.layout import (
    ALIGNMENT,
    DATA_START,
    DEFLATED_SKELETONS,
    MAGIC,
    MAJOR,
    MINOR,
    PAGE_ALIGN_FROM,
    PAGE_ALIGNMENT,
    SECTION_MAGIC,
    Preamble,
    align_for,
    align_up,
)
from quiver.ir import dtypes
from quiver.version import __version__

_W = TypeVar("_W", bound="TensorFileWriter")
# (dtype, shape, sha256 of bytes, sha256 of the encoding the bytes are read with; "" for plain tensors)
ContentKey = tuple[str, tuple[int, ...], str, str]


class StreamedTensor(Protocol):
    """A tensor whose bytes come in chunks (`passes.load.TensorSource`)."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    def chunks(self) -> Iterable[bytes | memoryview]: ...


class _State(enum.Enum):
    WEIGHTS = "weights"
    DONE = "done"
    ABORTED = "aborted"


@dataclass(frozen=True)
class WeightRecord:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    sha256: str
    encoding: Mapping[str, Any] | None = None
    crc32: int = 0


class TensorFileWriter:
    """Writes weights as they come, each distinct content once, into a temporary file.

    Memory stays bounded by one chunk plus the graph skeletons. `finish()` makes the file whole and
    moves it into place; until then the temporary file has no valid preamble.
    """

    MAGIC = MAGIC
    FORMAT = "qctx"

    def __init__(self, directory: str | Path | None = None) -> None:
        fd, tmp = temporary_file(self.FORMAT, directory)
        self._pid = os.getpid()  # a forked child must not remove its parent's file
        self._path = Path(tmp)
        self._file: BinaryIO = os.fdopen(fd, "w+b")
        self._file.write(b"\0" * DATA_START)
        self._end = DATA_START
        self._state = _State.WEIGHTS
        self._weights: list[WeightRecord] = []
        self._by_key: dict[ContentKey, int] = {}
        # deferred tensors stored already (by identity, the object kept): a graph sharing one reuses its
        # index without making it again (its bytes are made when stored: a quantizer's work)
        self._by_source: dict[tuple[int, str], tuple[object, int]] = {}

    @property
    def weights(self) -> list[WeightRecord]:
        return list(self._weights)

    def _require(self, state: _State) -> None:
        if self._state is not state:
            raise ContextStateError(f"context writer is {self._state.value}; expected {state.value}")

    def add_weight(
        self,
        dtype: str,
        shape: Iterable[int],
        chunks: Iterable[bytes | memoryview],
        encoding: Mapping[str, Any] | None = None,
    ) -> int:
        """Stores one tensor's bytes (streamed as chunks) unless identical content is stored; returns its index.

        A quantized weight carries its `encoding` (a descriptor with a `sha256`): it is shared only with
        a stored tensor of the same bytes *and* encoding.
        """
        self._require(_State.WEIGHTS)
        shape = tuple(int(d) for d in shape)
        expected = dtypes.byte_length(dtype, shape)
        start = align_up(self._end, align_for(expected))
        self._file.seek(self._end)
        self._file.write(b"\0" * (start - self._end))
        digest, crc = hashlib.sha256(), 0
        written = 0
        for chunk in chunks:
            digest.update(chunk)
            crc = crc32(chunk, crc)
            self._file.write(chunk)
            written += len(chunk)
        if written != expected:
            self._file.truncate(self._end)
            raise ContextStateError(f"tensor of {dtype}{list(shape)} needs {expected} bytes, got {written}")
        key: ContentKey = (dtype, shape, digest.hexdigest(), str(encoding["sha256"]) if encoding else "")
        if key in self._by_key:
            # Identical content is already stored: drop the bytes just written.
            self._file.truncate(self._end)
            return self._by_key[key]
        self._end = start + written
        self._weights.append(WeightRecord(dtype, shape, start, written, key[2], encoding, crc))
        self._by_key[key] = len(self._weights) - 1
        return len(self._weights) - 1

    def add_weights(
        self,
        tensors: Mapping[str, StreamedTensor],
        encodings: Mapping[str, Mapping[str, Any]],
        on_weight: Callable[[str], object] = lambda _: None,
    ) -> dict[str, int]:
        """Stores a graph's tensors (as `add_weight`), small ones placed in the slack that page alignment
        leaves before a large one rather than in a padding of zeros; returns each tensor's index.
        `on_weight(name)` before each deferred tensor is made and stored (a streaming export's progress).

        A page-aligned tensor (rule 4) ends mid-page unless its length is whole pages: written in the
        graph's order, a 4-bit MiniLM's scales and biases left 54 KB of zeros between its weights.
        """
        lengths = {name: dtypes.byte_length(t.dtype, t.shape) for name, t in tensors.items()}
        # the small tensors not stored yet, by length: the largest that fits a slack is found by bisection
        small = sorted((lengths[n], position, n) for position, n in enumerate(tensors) if lengths[n] < PAGE_ALIGN_FROM)
        indices: dict[str, int] = {}

        def add(name: str) -> None:
            tensor, encoding = tensors[name], encodings.get(name)
            source = getattr(tensor, "deferred", None)
            known = (id(source), str(encoding["sha256"]) if encoding else "")
            if source is not None and known in self._by_source:
                indices[name] = self._by_source[known][1]
                return
            if source is not None:
                on_weight(name)
            indices[name] = self.add_weight(tensor.dtype, tensor.shape, tensor.chunks(), encoding)
            if source is not None:
                self._by_source[known] = (source, indices[name])

        def fill_to_page() -> None:
            while small:
                room = align_up(self._end, PAGE_ALIGNMENT) - align_up(self._end, ALIGNMENT)
                fitting = bisect.bisect_right(small, (room, len(tensors))) - 1
                if fitting < 0:
                    return
                add(small.pop(fitting)[2])

        for name in tensors:
            if lengths[name] >= PAGE_ALIGN_FROM:
                fill_to_page()
                add(name)
        for name in tensors:  # the rest in the graph's order
            if name not in indices:
                add(name)
        return {name: indices[name] for name in tensors}

    def flushed_path(self) -> Path:
        """The temporary file, everything written so far flushed: for reading weights back before the
        file is finished (a backend preparing graphs ahead hands it to its runtime)."""
        self._require(_State.WEIGHTS)
        self._file.flush()
        return self._path

    def _check_indices(self, graph: str, weights: Mapping[str, int]) -> None:
        for index in weights.values():
            if not 0 <= index < len(self._weights):
                raise ContextStateError(f"graph {graph!r} refers to weight {index}, which was never added")

    def _write_graphs(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        """Writes the subclass's regions from `offset`; returns their header entries and the new end."""
        raise NotImplementedError

    def _header_fields(self) -> dict[str, Any]:
        return {}

    def _flags(self) -> int:
        """The preamble's flags: features a reader must know to read the file."""
        return 0

    def _write_tail(self, durable: bool) -> None:
        self._file.seek(self._end)
        graph_entries, offset = self._write_graphs(self._end)
        header = json.dumps(
            {
                "format": self.FORMAT,
                "producer": {"name": "quiver", "version": __version__},
                **self._header_fields(),
                "weights": [
                    {
                        "dtype": w.dtype,
                        "shape": list(w.shape),
                        "offset": w.offset,
                        "length": w.length,
                        "sha256": w.sha256,
                        "crc32": w.crc32,
                        **({"encoding": dict(w.encoding)} if w.encoding else {}),
                    }
                    for w in self._weights
                ],
                "graphs": graph_entries,
            },
            separators=(",", ":"),
        ).encode()
        header_offset = max(offset, DATA_START)
        self._file.write(header)
        preamble = Preamble(
            MAJOR,
            MINOR,
            self._flags(),
            header_offset,
            len(header),
            header_offset + len(header),
            hashlib.sha256(header).digest(),
        )
        self._file.flush()
        if durable:
            os.fsync(self._file.fileno())
        # The preamble goes last: until it is written the file cannot be mistaken for a whole one.
        self._file.seek(0)
        self._file.write(preamble.pack(self.MAGIC))
        self._file.flush()
        if durable:
            os.fsync(self._file.fileno())

    def finish(self, destination: str | Path | None = None) -> Path:
        """Completes the file; moves it to `destination` (atomically) or returns the temporary path.

        A temporary file stays open, and locked, until `release()` or `discard()`: its lock tells other
        processes' clean-up that its writer still lives. It is not forced to disk (it is scratch, gone at
        exit): `sync()` does that before it is published under another name.
        """
        self._require(_State.WEIGHTS)
        try:
            self._write_tail(durable=destination is not None)
            if destination is not None:
                portable.cache_afresh(self._file.fileno())  # synced by `_write_tail`
                publish(self._path, Path(destination))  # renamed while still locked
                self._path = Path(destination)
                self._file.close()
        except BaseException:
            self.abort()
            raise
        self._state = _State.DONE
        return self._path

    def sync(self) -> None:
        """Forces a finished temporary file to disk, before it is published under a lasting name, and has the
        page cache read it afresh (`portable.cache_afresh`: mapped in huge pages after)."""
        os.fsync(self._file.fileno())
        portable.cache_afresh(self._file.fileno())

    def release(self) -> None:
        """Closes a finished file (after it was published elsewhere)."""
        self._file.close()

    def discard(self) -> None:
        """Removes a finished temporary file that was never published (only in the process that wrote it)."""
        if self._state is _State.DONE and not self._file.closed:
            unlink_if_owner(self._path, self._pid)
            self._file.close()

    def abort(self) -> None:
        """Drops the partial file; safe to call in any state."""
        if self._state is _State.WEIGHTS and os.getpid() == self._pid:
            self._file.close()
            self._path.unlink(missing_ok=True)
            self._state = _State.ABORTED

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.abort()


@dataclass(frozen=True)
class PreparedRecord:
    """A graph in a backend's own form (format 1.6): what made it, from what, and its weights."""

    runtime: str
    source: str
    skeleton: bytes
    weights: Mapping[str, int]


class ContextWriter(TensorFileWriter):
    """Writes a `.qctx`: the weights, then one ONNX skeleton per graph (each followed by its prepared forms)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        super().__init__(directory)
        self._graphs: dict[str, tuple[bytes, dict[str, int], list[str]]] = {}
        self._prepared: dict[str, list[PreparedRecord]] = {}
        self._deflated = False  # a skeleton region was written deflated

    @property
    def graphs(self) -> dict[str, tuple[bytes, dict[str, int], list[str]]]:
        """Each graph added so far: its skeleton, weight map and updateable tensors."""
        return dict(self._graphs)

    def add_prepared(self, name: str, prepared: PreparedRecord) -> None:
        """Stores a backend's prepared form of graph `name`, next to its skeleton."""
        self._require(_State.WEIGHTS)
        if name not in self._graphs:
            raise ContextStateError(f"graph {name!r} is not in the context; add it before its prepared form")
        self._check_indices(name, prepared.weights)
        self._prepared.setdefault(name, []).append(prepared)

    def add_graph(self, name: str, skeleton: bytes, weights: Mapping[str, int], updateable: Iterable[str] = ()) -> None:
        self._require(_State.WEIGHTS)
        if name in self._graphs:
            raise DuplicateGraphError(f"graph {name!r} is already in the context; give each graph a unique name")
        self._check_indices(name, weights)
        missing = sorted(set(updateable) - set(weights))
        if missing:
            raise ContextStateError(f"graph {name!r}: updateable tensors {missing} are not among its weights")
        self._graphs[name] = (skeleton, dict(weights), sorted(set(updateable)))

    def _write_region(self, data: bytes, offset: int) -> tuple[dict[str, Any], int]:
        """A skeleton region, deflated where that makes it smaller (format 1.7): its header fields."""
        start = align_up(offset, ALIGNMENT)
        packed = compression.deflated(data)
        stored = data if packed is None else packed
        self._file.write(b"\0" * (start - offset))
        self._file.write(stored)
        region: dict[str, Any] = {"offset": start, "length": len(stored), "sha256": hashlib.sha256(stored).hexdigest()}
        if packed is not None:
            region.update(compression=compression.ZLIB, inflated_length=len(data))
            self._deflated = True
        return region, start + len(stored)

    def _flags(self) -> int:
        return DEFLATED_SKELETONS if self._deflated else 0

    def _write_graphs(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        entries = []
        for name, (skeleton, weights, updateable) in self._graphs.items():
            region, offset = self._write_region(skeleton, offset)
            entry = {
                "name": name,
                **region,
                "weights": dict(sorted(weights.items())),
                **({"updateable": updateable} if updateable else {}),
            }
            prepared = []
            for record in self._prepared.get(name, []):
                region, offset = self._write_region(record.skeleton, offset)
                weights_map = dict(sorted(record.weights.items()))
                prepared.append({"runtime": record.runtime, "source": record.source, **region, "weights": weights_map})
            if prepared:
                entry["prepared"] = prepared
            entries.append(entry)
        return entries, offset


class SectionWriter(TensorFileWriter):
    """Writes a `.qsec` for the context whose identity (header SHA-256) is `context_id`."""

    MAGIC = SECTION_MAGIC
    FORMAT = "qsec"

    def __init__(
        self, context_id: str, metadata: Mapping[str, Any] | None = None, directory: str | Path | None = None
    ) -> None:
        super().__init__(directory)
        self._context_id = context_id
        self._metadata = dict(metadata or {})
        self._graphs: dict[str, dict[str, int]] = {}

    def add_graph(self, name: str, tensors: Mapping[str, int]) -> None:
        self._require(_State.WEIGHTS)
        if name in self._graphs:
            raise DuplicateGraphError(f"graph {name!r} is already in the section")
        self._check_indices(name, tensors)
        self._graphs[name] = dict(sorted(tensors.items()))

    def _header_fields(self) -> dict[str, Any]:
        return {"context": self._context_id, "metadata": self._metadata}

    def _write_graphs(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        return [{"name": name, "weights": tensors} for name, tensors in self._graphs.items()], offset


def _umask() -> int:
    """The process's umask, read without changing it where the OS tells (Linux); else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


TEMPORARY_PREFIX = ".quiver-tmp-"
TEMPORARY_SUFFIX = ".partial"
_STALE_AFTER_S = 1.0  # a file this young may be one a writer has created but not locked yet


def temporary_file(label: str, directory: str | Path | None) -> tuple[int, str]:
    """A `.quiver-tmp-<label>-*.partial` file for an atomic write, locked while its writer lives, with
    the mode a plain `open()` would give (mkstemp: 0600), in `directory`, made first if missing. Files
    left by writers that were killed (their lock died with them) are removed first."""
    folder = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    try:
        folder.mkdir(parents=True, exist_ok=True)  # every output option may name a folder not made yet
        remove_stale_temporaries(folder)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMPORARY_PREFIX}{label}-", suffix=TEMPORARY_SUFFIX, dir=folder)
    except OSError as exc:
        raise FileAccessError(
            f"cannot write into {folder}: {exc.strerror or exc}; name an output in a folder you can write to"
        ) from None
    try:
        portable.lock_file(fd, blocking=False)  # released by the OS however the process ends
    except OSError:
        pass  # a file system without locks: the file is still removed on every exit Python sees
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except OSError:
        pass  # a file system without modes: keep mkstemp's
    return fd, tmp


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Removes temporary files whose writer is gone (killed: nothing else could clean them up). Where the
    OS has no file locks, no writer can be told gone from living: nothing is removed."""
    removed: list[Path] = []
    if not portable.CAN_LOCK:
        return removed
    try:
        candidates = list(folder.glob(f"{TEMPORARY_PREFIX}*{TEMPORARY_SUFFIX}"))
    except OSError:
        return removed
    for path in candidates:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < _STALE_AFTER_S:
                continue
            portable.lock_file(fd, blocking=False)  # fails while a living writer holds it
            path.unlink(missing_ok=True)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def unlink_if_owner(path: Path, pid: int) -> None:
    """Removes `path` when called by the process that made it (finalizers also run in forked children)."""
    if os.getpid() == pid:
        path.unlink(missing_ok=True)


def publish(source: Path, destination: Path) -> None:
    """Moves `source` onto `destination` atomically: a reader sees the old file or the new one."""
    try:
        os.replace(source, destination)
    except OSError:  # another file system: copy next to the destination, then rename
        copy_atomically(source, destination)
        source.unlink(missing_ok=True)


def _replace_atomically(destination: Path, fill: Callable[[BinaryIO], object]) -> None:
    """Writes a temporary file in the destination folder with `fill`, syncs it, then renames it into place."""
    destination = Path(destination).resolve()
    fd, tmp = temporary_file(destination.name, destination.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            fill(out)
            out.flush()
            os.fsync(out.fileno())
            os.replace(tmp, destination)  # while still open: its lock keeps other clean-ups off it
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_atomically(source: Path, destination: Path) -> None:
    def fill(out: BinaryIO) -> None:
        with open(source, "rb") as src:
            shutil.copyfileobj(src, out, 16 * 1024 * 1024)

    _replace_atomically(destination, fill)


def write_atomically(destination: Path, data: bytes | memoryview) -> None:
    _replace_atomically(destination, lambda out: out.write(data))


def write_text_atomically(destination: Path, text: str) -> None:
    write_atomically(destination, text.encode("utf-8"))

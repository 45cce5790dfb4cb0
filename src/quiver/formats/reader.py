"""Validating reader of `.qctx` files: every offset and length is checked before a byte is used."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from quiver.errors import (
    BadMagicError,
    ChecksumMismatchError,
    FileAccessError,
    FileChangedError,
    HeaderTooLargeError,
    InvalidHeaderError,
    MisalignedTensorError,
    OutOfBoundsError,
    OverlappingRegionsError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from quiver.formats import compression
from quiver.formats.checksums import crc32
from quiver.formats.file_guard import WATCHER
from quiver.formats.files import open_regular
from quiver.formats.layout import (
    DATA_START,
    DEFLATED_SKELETONS,
    MAGIC,
    MAJOR,
    MAX_HEADER,
    MAX_RANK,
    PAGE_ALIGNMENT,
    PREAMBLE_SIZE,
    Preamble,
    align_for,
)
from quiver.formats.private_copy import read_private
from quiver.formats.tuned import parse_identity, parse_tuning
from quiver.ir import dtypes


@dataclass(frozen=True)
class WeightEntry:
    index: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    sha256: str
    encoding: dict[str, Any] | None = None  # format 1.2: how a quantized weight is read
    crc32: int | None = None  # format 1.5: a quick check of the bytes (the SHA-256 is the content key)

    @property
    def key(self) -> tuple[str, tuple[int, ...], str, str]:
        """The content key: bytes, and for a quantized weight the encoding too."""
        return (self.dtype, self.shape, self.sha256, self.encoding["sha256"] if self.encoding else "")


@dataclass(frozen=True)
class PreparedEntry:
    """A graph in a backend's own form (format 1.6): a skeleton region of its own and its weight map."""

    runtime: str
    source: str
    offset: int
    length: int
    sha256: str
    weights: dict[str, int]
    inflated_length: int | None = None  # stored deflated (format 1.7): its length inflated


@dataclass(frozen=True)
class GraphEntry:
    name: str
    offset: int
    length: int
    sha256: str
    weights: dict[str, int]
    updateable: tuple[str, ...] = ()  # weights a binary section may replace (format 1.1)
    prepared: tuple[PreparedEntry, ...] = ()  # forms prepared ahead for a runtime (format 1.6)
    inflated_length: int | None = None  # stored deflated (format 1.7): its length inflated

    @property
    def weight_indices(self) -> set[int]:
        """Every weight this graph uses: its skeleton's and its prepared forms' (a fusion's new tensors)."""
        return set(self.weights.values()).union(*(form.weights.values() for form in self.prepared))


_SHA256_HEX = re.compile("[0-9a-f]{64}")


def _on_huge_pages(mapping: mmap.mmap) -> None:
    """Asks the kernel for 2 MB pages of the file where it can (the page cache's large folios mapped whole):
    a decode step reads every weight once, and with 4 KB pages a 1B model's step walks ~190k of them."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # a kernel without transparent huge pages for files: 4 KB pages, as before


def _fail(message: str) -> InvalidHeaderError:
    return InvalidHeaderError(f"{message}; the context binary is damaged: rebuild it with `quiver build`")


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _fail(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _fail(f"{what} must be a string, got {type(value).__name__}")
    return value


def _sha(value: Any, what: str) -> str:
    text = _str(value, what)
    if not _SHA256_HEX.fullmatch(text):
        raise _fail(f"{what} must be 64 lowercase hex digits")
    return text


def _region(offset: int, length: int, limit: int, what: str) -> None:
    if offset < DATA_START or offset + length > limit:
        raise OutOfBoundsError(
            f"{what} spans bytes {offset}..{offset + length}, outside the data region {DATA_START}..{limit}; "
            "the file is damaged: rebuild it"
        )


def _parse_weight(index: int, raw: Any, limit: int) -> WeightEntry:
    what = f"weight {index}"
    if not isinstance(raw, dict):
        raise _fail(f"{what} must be an object")
    dtype = _str(raw.get("dtype"), f"{what}.dtype")
    if dtype not in dtypes.DTYPE_NAMES:
        raise _fail(f"{what}.dtype {dtype!r} is not one of {sorted(dtypes.DTYPE_NAMES)}")
    shape_raw = raw.get("shape")
    if not isinstance(shape_raw, list) or len(shape_raw) > MAX_RANK:
        raise _fail(f"{what}.shape must be a list of at most {MAX_RANK} dims")
    shape = tuple(_int(d, f"{what}.shape") for d in shape_raw)
    offset = _int(raw.get("offset"), f"{what}.offset")
    length = _int(raw.get("length"), f"{what}.length")
    expected = dtypes.byte_length(dtype, shape)  # length is bounded by the file size below
    if expected != length:
        raise _fail(f"{what} is {dtype}{list(shape)} ({expected} bytes) but records {length} bytes")
    _region(offset, length, limit, what)
    if offset % align_for(length):
        raise MisalignedTensorError(
            f"{what} starts at {offset}, not a multiple of {align_for(length)}; the file is damaged: rebuild it"
        )
    encoding = raw.get("encoding")
    if encoding is not None:
        if not isinstance(encoding, dict):
            raise _fail(f"{what}.encoding must be an object")
        _sha(encoding.get("sha256"), f"{what}.encoding.sha256")
    crc = raw.get("crc32")
    if crc is not None and (type(crc) is not int or not 0 <= crc < 1 << 32):
        raise _fail(f"{what}.crc32 must be an integer in [0, 2**32), got {crc!r}")
    sha256 = _sha(raw.get("sha256"), f"{what}.sha256")
    return WeightEntry(index, dtype, shape, offset, length, sha256, encoding, crc)


def _parse_weight_map(raw: Any, weight_count: int, what: str) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise _fail(f"{what} weights must be an object")
    for tensor, index in raw.items():
        if type(index) is not int or not 0 <= index < weight_count:  # the message only when it is needed
            _int(index, f"{what} weight {tensor!r}")
            raise _fail(f"{what} maps {tensor!r} to weight {index}, but there are {weight_count}")
    return dict(raw)


def _parse_prepared(raw: Any, limit: int, weight_count: int, graph: str) -> tuple[PreparedEntry, ...]:
    if not isinstance(raw, list):
        raise _fail(f"graph {graph!r} prepared must be a list")
    entries = []
    for number, item in enumerate(raw):
        what = f"graph {graph!r} prepared form {number}"
        if not isinstance(item, dict):
            raise _fail(f"{what} must be an object")
        offset, length = _int(item.get("offset"), f"{what} offset"), _int(item.get("length"), f"{what} length")
        _region(offset, length, limit, what)
        entries.append(
            PreparedEntry(
                _str(item.get("runtime"), f"{what} runtime"),
                _sha(item.get("source"), f"{what} source"),
                offset,
                length,
                _sha(item.get("sha256"), f"{what} sha256"),
                _parse_weight_map(item.get("weights"), weight_count, what),
                _parse_compression(item, length, what),
            )
        )
    return tuple(entries)


def _parse_compression(raw: dict[str, Any], length: int, what: str) -> int | None:
    """A skeleton region's inflated length where it is stored deflated (format 1.7), else None."""
    method = raw.get("compression")
    if method is None:
        if "inflated_length" in raw:
            raise _fail(f"{what} records an inflated_length but no compression")
        return None
    if method != compression.ZLIB:
        raise _fail(f"{what} compression {method!r} is not one this Quiver reads ({compression.ZLIB!r})")
    inflated = _int(raw.get("inflated_length"), f"{what} inflated_length")
    compression.check_inflated_length(inflated, length, what)
    return inflated


def _parse_graph(raw: Any, limit: int, weight_count: int) -> GraphEntry:
    if not isinstance(raw, dict):
        raise _fail("each graph must be an object")
    name = _str(raw.get("name"), "graph name")
    if not name:
        raise _fail("graph names must not be empty")
    offset = _int(raw.get("offset"), f"graph {name!r} offset")
    length = _int(raw.get("length"), f"graph {name!r} length")
    _region(offset, length, limit, f"graph {name!r}")
    weights = _parse_weight_map(raw.get("weights"), weight_count, f"graph {name!r}")
    updateable = raw.get("updateable", [])
    if not isinstance(updateable, list) or any(not isinstance(t, str) or t not in weights for t in updateable):
        raise _fail(f"graph {name!r} updateable must list names of its weights")
    prepared = _parse_prepared(raw.get("prepared", []), limit, weight_count, name)
    return GraphEntry(
        name,
        offset,
        length,
        _sha(raw.get("sha256"), f"graph {name!r} sha256"),
        weights,
        tuple(updateable),
        prepared,
        _parse_compression(raw, length, f"graph {name!r}"),
    )


def _check_order(regions: list[tuple[int, int, str]]) -> None:
    """Regions in ascending order, each after the previous one's end and no further than a page from it:
    writers only pad for alignment, so a file's size is bounded by what its header declares (a sparse
    file with a huge hole is refused before a byte of the hole is read)."""
    previous_end, previous = DATA_START, "the preamble"
    for offset, length, what in regions:
        if offset < previous_end:
            raise OverlappingRegionsError(
                f"{what} starts at {offset}, before the end of {previous} ({previous_end}); "
                "the file is damaged: rebuild it"
            )
        if offset - previous_end >= PAGE_ALIGNMENT:
            raise OutOfBoundsError(
                f"{what} starts {offset - previous_end} bytes after the end of {previous}, more than alignment "
                "allows; the file is damaged: rebuild it"
            )
        previous_end, previous = offset + length, what


_T = TypeVar("_T", bound="TensorFile")
_PARALLEL_HASH_FROM = 1 << 20  # SHA-256 bytes below which starting threads costs more than it saves
_CRC_SPEEDUP = 16  # CRC-32 (zlib-ng's) against SHA-256, per byte (measured: 0.07 against 2 ms for 3.5 MB)
_Check = tuple[str, int, int, str, int | None]  # what, offset, length, SHA-256, CRC-32 (1.5) if recorded


def _digest(data: memoryview, crc: bool) -> str:
    return format(crc32(data), "08x") if crc else hashlib.sha256(data).hexdigest()


def _digests_of(buffer: memoryview, spans: list[tuple[int, int, bool]]) -> list[str]:
    """The digest of each (offset, length, crc) span: its CRC-32 (8 hex digits) or its SHA-256, on as many
    threads as there are cores, up to 4 (hashlib and zlib let go of the GIL)."""
    digests = [""] * len(spans)

    def hash_some(indices: list[int]) -> None:
        for i in indices:
            offset, length, crc = spans[i]
            digests[i] = _digest(buffer[offset : offset + length], crc)

    workers = min(os.cpu_count() or 1, 4)
    if workers <= 1 or sum(length // (_CRC_SPEEDUP if crc else 1) for _, length, crc in spans) < _PARALLEL_HASH_FROM:
        hash_some(list(range(len(spans))))
        return digests
    shares: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for i in sorted(range(len(spans)), key=lambda i: -spans[i][1]):  # largest first, to the least loaded
        least = loads.index(min(loads))
        shares[least].append(i)
        loads[least] += spans[i][1]
    threads = [threading.Thread(target=hash_some, args=(share,)) for share in shares[1:] if share]
    for thread in threads:
        thread.start()
    hash_some(shares[0])
    for thread in threads:
        thread.join()
    return digests


def _marker(file: TensorFile) -> Callable[[], None]:
    """What the file guard calls when another program begins to change the file: marks it changed, without
    keeping it alive (an unclosed file is still collected)."""
    mark = weakref.WeakMethod(file._mark_changed)

    def on_change() -> None:
        method = mark()
        if method is not None:
            method()

    return on_change


class TensorFile:
    """A validated Quiver tensor file (preamble, content-keyed tensors, JSON header) over a read-only buffer.

    Subclasses name their magic and format and parse their own header fields (`_parse_rest`).
    """

    MAGIC = MAGIC
    FORMAT = "qctx"
    WHAT = "context binary"
    REMEDY = "rebuild it with `quiver build`"
    KNOWN_FLAGS = 0  # preamble flags this file kind may carry; any other makes it unreadable here

    def __init__(self, buffer: mmap.mmap | bytes | bytearray | memoryview, source: str = "<bytes>") -> None:
        self.source = source
        self._mmap = buffer if isinstance(buffer, mmap.mmap) else None
        self._fd: int | None = None  # the mapped file, kept open to notice changes made in place
        self._guard: int | None = None  # its guard against truncation (formats.file_guard), where it has one
        self._changed = False  # set by the guard: another program began to change the file
        self._identity: tuple[int, ...] = ()
        self._private: mmap.mmap | None = None  # a private copy mapped from a memfd (closed with the file)
        self._buffer = memoryview(buffer).cast("B")
        size = len(self._buffer)
        if size < PREAMBLE_SIZE:
            raise TruncatedFileError(f"{source}: {size} bytes is too short for a {self.WHAT}; the file is truncated")
        magic, pre = Preamble.unpack(bytes(self._buffer[:PREAMBLE_SIZE]))
        if magic != self.MAGIC:
            raise BadMagicError(f"{source} is not a Quiver {self.WHAT} (wrong magic); {self.REMEDY}")
        if pre.major != MAJOR or pre.flags & ~self.KNOWN_FLAGS:
            raise UnsupportedVersionError(
                f"{source} uses format {pre.major}.{pre.minor} (flags {pre.flags:#x}); this Quiver reads format "
                f"{MAJOR}.x: upgrade Quiver or {self.REMEDY} with this version"
            )
        if pre.file_length != size:
            raise TruncatedFileError(
                f"{source} records {pre.file_length} bytes but has {size}; the file is truncated or was "
                f"extended: copy it again or {self.REMEDY}"
            )
        if pre.header_length > MAX_HEADER:
            raise HeaderTooLargeError(
                f"{source}: header of {pre.header_length} bytes exceeds {MAX_HEADER}; the file is damaged"
            )
        if pre.header_offset < DATA_START or pre.header_offset + pre.header_length != size or pre.header_length < 2:
            raise OutOfBoundsError(
                f"{source}: header at {pre.header_offset}+{pre.header_length} is not the tail of the "
                f"{size}-byte file; the file is damaged: {self.REMEDY}"
            )
        if pre.reserved != 0:
            raise _fail(f"{source}: reserved preamble field is not zero")
        header_bytes = bytes(self._buffer[pre.header_offset : size])
        if hashlib.sha256(header_bytes).digest() != pre.header_sha256:
            raise ChecksumMismatchError(f"{source}: header checksum mismatch; the file is damaged: copy it again")
        self.minor_version = pre.minor
        self.flags = pre.flags
        self.header_offset = pre.header_offset
        self.header_sha256 = pre.header_sha256.hex()  # the file's identity: covers every region's checksum
        self._parse_header(header_bytes)

    def _parse_header(self, header_bytes: bytes) -> None:
        try:
            header = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON, or a huge integer
            raise _fail(f"header is not UTF-8 JSON Quiver can read ({exc})") from None
        if not isinstance(header, dict) or header.get("format") != self.FORMAT:
            raise _fail(f'header must be an object with "format": "{self.FORMAT}"')
        producer = header.get("producer")
        if not isinstance(producer, dict):
            raise _fail("header.producer must be an object")
        self.producer = (
            f"{_str(producer.get('name'), 'producer.name')} {_str(producer.get('version'), 'producer.version')}"
        )
        weights_raw, graphs_raw = header.get("weights"), header.get("graphs")
        if not isinstance(weights_raw, list) or not isinstance(graphs_raw, list):
            raise _fail("header.weights and header.graphs must be lists")
        limit = self.header_offset
        self.weights = [_parse_weight(i, raw, limit) for i, raw in enumerate(weights_raw)]
        keys = {w.key for w in self.weights}
        if len(keys) != len(self.weights):
            raise _fail("two weights have the same content key; each distinct tensor must be stored once")
        regions = self._parse_rest(header, graphs_raw, limit)
        tail = [(self.header_offset, 0, "the header")]
        _check_order([(w.offset, w.length, f"weight {w.index}") for w in self.weights] + regions + tail)

    def _parse_rest(self, header: dict[str, Any], graphs_raw: list[Any], limit: int) -> list[tuple[int, int, str]]:
        """Parses the subclass's fields; returns the regions they own, for the ordering check."""
        raise NotImplementedError

    def _regions(self) -> list[tuple[int, int]]:
        return [(w.offset, w.length) for w in self.weights]

    @classmethod
    def open(cls: type[_T], path: str | Path, persistent: bool = True) -> _T:
        """Maps `path` read-only (persistent) or copies it into private memory.

        Only regular files are opened. The file is validated on the mapping first, so a private copy
        reads no more than its header declares; that copy is then what was checked, whatever later
        happens to the file: `verify()` and `damage()` check the copy itself.
        (Starting the copy before the validation was slower, measured side by side.)
        """
        path = Path(path)
        with open_regular(path) as f:
            info = os.fstat(f.fileno())
            if info.st_size < PREAMBLE_SIZE:
                return cls(f.read(), str(path))  # too short to map: the constructor says why
            try:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                raise FileAccessError(f"cannot map {path}: {exc}; check the path") from None
            _on_huge_pages(mapping)
            file = cls(mapping, str(path))
            if not persistent:
                try:
                    data, done = read_private(f.fileno(), file.size)
                except OSError as exc:
                    raise FileAccessError(f"cannot read {path}: {exc}; check the file") from None
                file._take_private_copy(data, done)
                return file
            file._fd = os.dup(f.fileno())
            file._identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
            file._guard = WATCHER.guard(file._fd, _marker(file))
            return file

    def _mark_changed(self) -> None:
        self._changed = True

    def _take_private_copy(self, data: memoryview | mmap.mmap, done: int) -> None:
        """Swaps the mapping for the copy `data` (`done` bytes read), refused if the file changed meanwhile
        (its header was parsed from the mapping, so the copy's preamble and header, which hold every
        checksum, must be the same)."""
        assert self._mmap is not None
        view = memoryview(data).cast("B").toreadonly()  # arrays over it are read-only, as over a mapped file
        size = len(self._buffer)
        unchanged = (
            done == size
            and view[:PREAMBLE_SIZE] == self._buffer[:PREAMBLE_SIZE]
            and hashlib.sha256(view[self.header_offset : size]).hexdigest() == self.header_sha256
        )
        self._buffer.release()
        self._mmap.close()
        self._mmap, self._buffer, self._private = None, view, data if isinstance(data, mmap.mmap) else None
        if not unchanged:
            raise FileChangedError(f"{self.source} changed while it was read; files in use must be replaced: try again")

    def check_unchanged(self) -> None:
        """Raises if the mapped file was truncated or rewritten in place since it was opened.

        Reading a mapping past a truncated end kills the process (SIGBUS); Quiver's files are replaced,
        never rewritten, so a change in place is someone else's doing: refuse rather than compute with it.
        """
        if self._fd is None:
            return
        try:
            info = os.fstat(self._fd)
        except OSError:
            return  # closed meanwhile: nothing maps it any more
        if self._changed or (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) != self._identity:
            raise FileChangedError(
                f"{self.source} was truncated or rewritten in place while it was loaded; files in use must be "
                "replaced (write a new file, then rename it over the old one): load it again"
            )

    def is_file_at(self, path: str | Path) -> bool:
        """Whether `path` names the very file this one maps, unchanged."""
        try:
            info = os.stat(path)
        except OSError:
            return False
        return bool(self._identity) and (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) == self._identity

    @property
    def buffer(self) -> memoryview:
        """The file's bytes (the mapping itself for a mapped file)."""
        return self._buffer

    def mapped_file(self) -> tuple[str, int, int] | None:
        """The mapped file's real path, the address of its mapping in this process and its size; None for
        a file held in private memory."""
        if self._mmap is None or self._fd is None:
            return None
        address = np.frombuffer(self._buffer, np.uint8, count=1).ctypes.data if len(self._buffer) else 0
        return os.path.realpath(self.source), int(address), len(self._buffer)

    @property
    def file_backed(self) -> bool:
        """Whether the buffer is a read-only mapping of a file (rather than private memory)."""
        return self._mmap is not None

    @property
    def size(self) -> int:
        return len(self._buffer)

    def weight_array(self, index: int) -> np.ndarray:
        """A read-only view of one weight, without copying."""
        w = self.weights[index]
        array = np.frombuffer(
            self._buffer,
            dtype=dtypes.numpy_of(w.dtype),
            count=w.length // dtypes.itemsize(w.dtype) if w.length else 0,
            offset=w.offset,
        )
        return array.reshape(w.shape)

    def verify(self) -> list[str]:
        """Every problem found by re-hashing all regions (SHA-256) and checking the gaps; empty when whole."""
        return self._problems(quick=False)

    def damage(self) -> list[str]:
        """`verify()` with each weight that records a CRC-32 (format 1.5) checked by it instead: any
        accidental damage is found, ~30 times faster (zlib-ng). SHA-256 is the content key, which
        `verify()` checks."""
        return self._problems(quick=True)

    def _problems(self, quick: bool) -> list[str]:
        self.check_unchanged()
        checked = self._checksummed()
        spans = [(offset, length, quick and crc is not None) for _, offset, length, _, crc in checked]
        digests = _digests_of(self._buffer, spans)
        problems = [
            f"{what} checksum mismatch"
            for (what, _, _, sha, crc), (*_, by_crc), digest in zip(checked, spans, digests)
            if digest != (f"{crc:08x}" if by_crc else sha)
        ]
        regions = sorted([(0, PREAMBLE_SIZE), *self._regions(), (self.header_offset, 0)])
        for (start, length), (next_start, _) in zip(regions, regions[1:]):
            gap = self._buffer[start + length : next_start]  # under a page (rule 5): a copy costs less than numpy
            if gap.tobytes().count(0) != len(gap):
                problems.append(f"non-zero padding between bytes {start + length} and {next_start}")
        return problems

    def _checksummed(self) -> list[_Check]:
        """(what, offset, length, sha256, crc32 or None) of every region with a checksum."""
        return [
            (f"weight {w.index} ({w.dtype}{list(w.shape)})", w.offset, w.length, w.sha256, w.crc32)
            for w in self.weights
        ]

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._guard is not None:
            WATCHER.release(self._guard)
            self._guard = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self._buffer.release()
            for mapping in (self._mmap, self._private):
                if mapping is not None:
                    mapping.close()
        except BufferError:
            pass  # arrays still view the buffer; it is released when they are gone


class ContextFile(TensorFile):
    """A validated `.qctx` file: content-keyed weights plus one ONNX skeleton per graph."""

    KNOWN_FLAGS = DEFLATED_SKELETONS

    def _parse_rest(self, header: dict[str, Any], graphs_raw: list[Any], limit: int) -> list[tuple[int, int, str]]:
        self.graphs: dict[str, GraphEntry] = {}
        for raw in graphs_raw:
            entry = _parse_graph(raw, limit, len(self.weights))
            if entry.name in self.graphs:
                raise _fail(f"graph name {entry.name!r} appears twice")
            self.graphs[entry.name] = entry
        # 1.4: a tuned copy keeps the identity of the context it was tuned from (sections name it)
        self.identity = parse_identity(header.get("identity"), self.header_sha256)
        self.tuning = parse_tuning(header.get("tuning"), list(self.graphs))
        deflated = any(g.inflated_length is not None or any(p.inflated_length is not None for p in g.prepared)
                       for g in self.graphs.values())  # fmt: skip
        if deflated and not self.flags & DEFLATED_SKELETONS:
            raise _fail("skeletons are stored deflated but the preamble does not flag it")
        return [(offset, length, what) for what, offset, length, _ in self._skeleton_regions()]

    def _skeleton_regions(self) -> list[tuple[str, int, int, str]]:
        """Every skeleton region in file order: (what, offset, length, sha256)."""
        regions = []
        for g in self.graphs.values():
            regions.append((f"graph {g.name!r}", g.offset, g.length, g.sha256))
            regions += [
                (f"graph {g.name!r} prepared form {i}", p.offset, p.length, p.sha256) for i, p in enumerate(g.prepared)
            ]
        return regions

    def _regions(self) -> list[tuple[int, int]]:
        return super()._regions() + [(offset, length) for _, offset, length, _ in self._skeleton_regions()]

    def _checked_region(self, offset: int, length: int, sha256: str, what: str) -> bytes:
        data = bytes(self._buffer[offset : offset + length])
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ChecksumMismatchError(f"{self.source}: {what} checksum mismatch; the file is damaged: copy it again")
        return data

    def skeleton(self, name: str) -> bytes:
        """The graph's ONNX structure, its checksum verified (inflated where stored deflated)."""
        g = self.graphs[name]
        return self._skeleton_at(g.offset, g.length, g.sha256, g.inflated_length, f"graph {name!r}")

    def prepared_skeleton(self, name: str, number: int) -> bytes:
        """A prepared form's ONNX structure (format 1.6), its checksum verified (inflated where stored deflated)."""
        p = self.graphs[name].prepared[number]
        what = f"graph {name!r} prepared form {number}"
        return self._skeleton_at(p.offset, p.length, p.sha256, p.inflated_length, what)

    def _skeleton_at(self, offset: int, length: int, sha256: str, inflated: int | None, what: str) -> bytes:
        data = self._checked_region(offset, length, sha256, what)
        return data if inflated is None else compression.inflated(data, inflated, f"{self.source}: {what}")

    def _checksummed(self) -> list[_Check]:
        graphs: list[_Check] = [
            (what, offset, length, sha, None) for what, offset, length, sha in self._skeleton_regions()
        ]
        return super()._checksummed() + graphs

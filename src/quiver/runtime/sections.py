"""Updateable tensors and binary sections: stage, finalize, extract, check and bind new tensor values."""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quiver import fork
from quiver.errors import ChecksumMismatchError, SectionMismatchError, TensorUpdateError
from quiver.formats.reader import ContextFile
from quiver.formats.section import SectionFile

Values = dict[str, np.ndarray]


def checked_update(file: ContextFile, graph: str, values: Mapping[str, Any]) -> Values:
    """New values for a graph's updateable tensors, checked and copied (staging must not alias caller memory)."""
    entry = file.graphs[graph]
    checked = {}
    for name, value in values.items():
        if name not in entry.updateable:
            raise TensorUpdateError(
                f"graph {graph!r} has no updateable tensor {name!r}; its updateable tensors are "
                f"{list(entry.updateable) or 'none (mark them with add_graph(..., updateable=[...]))'}"
            )
        weight = file.weights[entry.weights[name]]
        array = np.asarray(value)
        if array.dtype.name != weight.dtype or tuple(array.shape) != weight.shape:
            raise TensorUpdateError(
                f"graph {graph!r} tensor {name!r} is {weight.dtype}{list(weight.shape)}; "
                f"the update is {array.dtype}{list(array.shape)}"
            )
        checked[name] = np.array(array, order="C", copy=True)
        checked[name].flags.writeable = False
    return checked


def trailing_zeros_trimmed(array: np.ndarray) -> np.ndarray:
    """The smallest leading box of a float tensor that holds all its non-zeros (at least 1 along each axis).

    A LoRA adapter of rank 8 in a context whose branches have rank 16 fills the first 8 columns of A and
    rows of B: its section stores those, and applying it zero-extends them (format 1.3). Integer tensors
    are kept whole: for quantized ones 0 is not the real zero.
    """
    if array.dtype.kind != "f" or array.ndim == 0 or array.size == 0:
        return array
    box = []
    for axis in range(array.ndim):
        others = tuple(i for i in range(array.ndim) if i != axis)
        used = np.flatnonzero(np.any(array != 0, axis=others)) if others else np.flatnonzero(array != 0)
        box.append(slice(0, int(used[-1]) + 1 if used.size else 1))
    return array[tuple(box)]


def write_section(
    file: ContextFile,
    current: Mapping[str, Mapping[str, np.ndarray]],
    graphs: Iterable[str],
    metadata: Mapping[str, Any] | None = None,
) -> bytes:
    """A section holding the current values of the graphs' updateable tensors, each distinct tensor once."""
    from quiver.formats.writer import SectionWriter  # writing is not needed to apply sections

    writer = SectionWriter(file.identity, metadata)
    try:
        for graph in graphs:
            mapping = {}
            for name, array in sorted(current[graph].items()):
                stored = trailing_zeros_trimmed(array)
                mapping[name] = writer.add_weight(
                    stored.dtype.name, stored.shape, [np.ascontiguousarray(stored).tobytes()]
                )
            writer.add_graph(graph, mapping)
        path = writer.finish()
    except BaseException:
        writer.abort()
        raise
    try:
        return path.read_bytes()
    finally:
        writer.discard()


def load_section(source: str | Path | bytes | bytearray | memoryview | SectionFile) -> SectionFile:
    """A section, every checksum verified (a damaged section is refused); bytes given are not copied.

    Each tensor is checked by its CRC-32 where the section records one (format 1.5), else its SHA-256.
    A section from a path is copied into memory, not mapped: it is small, and what was checked is then
    what is used, whatever later happens to the file (rewritten or truncated in place).
    """
    if isinstance(source, SectionFile):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _verified(SectionFile(source))
    return _FROM_PATHS.get(Path(source))


def _verified(section: SectionFile) -> SectionFile:
    problems = section.damage()
    if problems:
        raise ChecksumMismatchError(
            f"{section.source}: {'; '.join(problems[:3])}; the section is damaged: make it again"
        )
    return section


SECTION_CACHE_BYTES = 256 * 1024 * 1024  # sections read from paths kept verified in memory, at most


class _VerifiedSections:
    """Sections read from paths and verified, by file identity: switching back to a file applied before
    costs a stat, not a copy and a checksum of every tensor. A file replaced or written
    to since has another identity (inode, size, mtime, ctime) and is read and verified again."""

    def __init__(self, limit_bytes: int = SECTION_CACHE_BYTES) -> None:
        self._limit = limit_bytes
        self._sections: OrderedDict[tuple[int, ...], SectionFile] = OrderedDict()
        self._lock = threading.Lock()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # never one that a thread the child does not have was holding

    def get(self, path: Path) -> SectionFile:
        identity: tuple[int, ...] = ()
        try:
            info = os.stat(path)
            identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        except OSError:
            pass  # opening it below says why
        with self._lock:
            cached = self._sections.get(identity) if identity else None
            if cached is not None:
                self._sections.move_to_end(identity)
                return cached
        section = _verified(SectionFile.open(path, persistent=False))  # the reader says why it cannot
        if identity:
            with self._lock:
                self._sections[identity] = section
                while len(self._sections) > 1 and sum(s.size for s in self._sections.values()) > self._limit:
                    self._sections.popitem(last=False)
        return section

    def forget(self, path: Path) -> None:
        """Drops what was kept of the file at `path` (an adapter unloaded: its memory goes back)."""
        with self._lock:
            for identity, section in list(self._sections.items()):
                if os.path.abspath(section.source) == os.path.abspath(path):
                    del self._sections[identity]


_FROM_PATHS = _VerifiedSections()
fork.reset_after_fork(_FROM_PATHS)


class _BoundSections:
    """What binding a section to a context's graph gave, kept with the section: switching back to an
    adapter applied before then costs no checks and no zero-extension (a copy) of its tensors, and
    the backend sees the same arrays again (it keeps what it wrapped them in)."""

    def __init__(self) -> None:
        self._bound: weakref.WeakKeyDictionary[SectionFile, dict[tuple[str, str], Values]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def get(self, file: ContextFile, section: SectionFile, graph: str) -> Values | None:
        with self._lock:
            return self._bound.get(section, {}).get((file.identity, graph))

    def put(self, file: ContextFile, section: SectionFile, graph: str, values: Values) -> None:
        with self._lock:
            self._bound.setdefault(section, {})[(file.identity, graph)] = values


def forget_section(path: str | Path) -> None:
    """What `load_section` kept of a section file read from `path`, dropped."""
    _FROM_PATHS.forget(Path(path))


_BOUND = _BoundSections()
fork.reset_after_fork(_BOUND)


def bind_section(file: ContextFile, section: SectionFile, graphs: Iterable[str]) -> dict[str, Values]:
    """Views of the section's tensors per graph, after checking they fit; nothing changes if they do not."""
    targets = list(graphs)
    known = {graph: _BOUND.get(file, section, graph) for graph in targets}
    if all(values is not None for values in known.values()):
        return {graph: values for graph, values in known.items() if values is not None}
    if section.context_id != file.identity:
        raise SectionMismatchError(
            f"{section.source} was made for another context ({section.context_id[:12]}…), not this one "
            f"({file.identity[:12]}…); apply it to the context it was made from"
        )
    bound: dict[str, Values] = {}
    for graph in targets:
        if graph not in section.graphs:
            raise SectionMismatchError(
                f"{section.source} has no values for graph {graph!r}; it covers {list(section.graphs)}"
            )
        if graph not in file.graphs:
            raise SectionMismatchError(f"{section.source} is for graph {graph!r}, which this context does not hold")
        entry = file.graphs[graph]
        bound[graph] = {}
        for name, index in section.graphs[graph].tensors.items():
            stored = section.weights[index]
            if name not in entry.updateable:
                raise SectionMismatchError(f"{section.source}: graph {graph!r} has no updateable tensor {name!r}")
            weight = file.weights[entry.weights[name]]
            if not fits_weight(stored.dtype, stored.shape, weight):
                raise SectionMismatchError(
                    f"{section.source}: tensor {name!r} is {stored.dtype}{list(stored.shape)}, graph {graph!r} "
                    f"needs {weight.dtype}{list(weight.shape)}"
                )
            bound[graph][name] = _zero_extended(section.weight_array(index), weight.shape)
    for graph, values in bound.items():
        _BOUND.put(file, section, graph, values)
    return bound


def fits_weight(dtype: Any, shape: Sequence[int], weight: Any) -> bool:
    """Whether a section's tensor can stand for a context weight: same dtype and rank, no dimension larger
    (a smaller one, a lower LoRA rank, is zero-extended)."""
    same_rank = len(shape) == len(weight.shape)
    return dtype == weight.dtype and same_rank and all(a <= b for a, b in zip(shape, weight.shape))


def _zero_extended(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The section's tensor at the context's shape: itself when it is whole, else zero-extended (a copy)."""
    if tuple(array.shape) == tuple(shape):
        return array
    whole = np.zeros(shape, array.dtype)
    whole[tuple(slice(0, n) for n in array.shape)] = array
    whole.flags.writeable = False
    return whole

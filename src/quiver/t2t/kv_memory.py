"""KV caches whose memory grows with the tokens in them, and shrinks when a sequence ends.

Every cache tensor is [rows, heads, positions, head size]: a row is one sequence, and within a row each
head's entries run along the positions. The tensors are views of memory given on demand
(`portable.zeros_on_demand`): a page exists once a step writes an entry into it, so a row holds about the
bytes of the tokens it caches (whole 4 KiB pages per head), not the context's; `drop_rows` gives a row's
pages back when its sequence ends. ORT's attention kernels read and write the same buffers as before:
nothing is copied or reallocated as sequences grow. (vLLM pages its cache into blocks for the same end;
here the OS's pages are the blocks.)
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping

import numpy as np

from quiver import portable


class CacheMemory:
    """Float32 tensors of `shapes` (name -> [rows, ...]: a cache's [rows, heads, positions, head size]) over
    memory given on demand, a row's pages given back by `drop_rows`."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        page = mmap.PAGESIZE
        offsets, end = {}, 0
        for name, shape in shapes.items():  # each tensor on a page of its own: rows drop page by page
            offsets[name] = end
            end += -(-int(np.prod(shape, dtype=np.int64)) * 4 // page) * page
        self._memory = portable.zeros_on_demand(end)
        self._regions = {name: (offsets[name], shapes[name]) for name in shapes}
        self.arrays: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            count = int(np.prod(shape, dtype=np.int64))
            self.arrays[name] = np.frombuffer(self._memory, np.float32, count, offsets[name]).reshape(shape)

    def drop_rows(self, rows: Iterable[int]) -> None:
        """Gives the pages of these rows back (they read as zeros after): their sequences ended."""
        for row in rows:
            for offset, shape in self._regions.values():
                row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * 4
                portable.drop_pages(self._memory, offset + row * row_bytes, row_bytes)

    def drop_all(self) -> None:
        for offset, shape in self._regions.values():
            portable.drop_pages(self._memory, offset, int(np.prod(shape, dtype=np.int64)) * 4)


def zeros(shape: tuple[int, ...]) -> np.ndarray:
    """One float32 array of zeros over memory given on demand (pages made as they are written)."""
    return CacheMemory({"": shape}).arrays[""]

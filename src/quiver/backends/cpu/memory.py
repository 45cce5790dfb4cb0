"""What the cpu backend hands back to the system: mapped pages ORT no longer reads (the heap's free pages go
back through `portable.return_freed_memory`)."""

from __future__ import annotations

import numpy as np

from quiver import portable

MADV_RANDOM, MADV_DONTNEED = 1, 4


def drop_resident_pages(arrays: list[np.ndarray]) -> None:
    """Tells the kernel the mapped pages of packed weights are not needed now (MADV_DONTNEED).

    ORT computes with the packed copies, so the mapped originals only inflate RSS. The mapping is a
    read-only shared file mapping: a later read faults the pages back in from the page cache. Such
    reads are sparse (an embedding table that is also a tied LM head: Gather reads a row per token),
    so they fault in just their pages (MADV_RANDOM), not the 64 KB around each that the kernel would
    map ahead: over a conversation that made the whole table resident again.
    """
    advise(arrays, MADV_DONTNEED, MADV_RANDOM)


def advise(arrays: list[np.ndarray], *advice: int) -> None:
    """madvise() on the whole pages of each array (neighbours may share the edge pages)."""
    for array in arrays:
        portable.advise_pages(array.__array_interface__["data"][0], array.nbytes, *advice)

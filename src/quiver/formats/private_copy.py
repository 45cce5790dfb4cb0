"""Private copies of files (sections loaded from a path): into huge pages, or a memfd, where the OS has them.

A section loaded from a path is copied, so that what was checked is what is used whatever later happens
to the file. Most of a copy's cost is making fresh pages, not moving bytes (3.5 MB, measured: 1.6 ms
read into fresh 4 KiB pages, 1.25 ms through a memfd, where the kernel copies page-cache pages into it,
0.2 ms into pages that already exist). Whole 2 MiB huge pages (transparent huge pages, asked for with
`MADV_HUGEPAGE`) take 0.55 ms: two page faults instead of ~870. Where free huge pages are short, the
kernel may compact memory first (its THP "defrag" setting); no run here stalled so. Keeping pages
ready on a background thread was measured and left out: in a process whose ONNX Runtime threads keep
the cores busy, that thread's turns at the GIL and at the memory map's lock cost the next load up to
10 ms.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from pathlib import Path

_HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) transparent huge page


def read_private(fd: int, size: int) -> tuple[memoryview | mmap.mmap, int]:
    """The file's first `size` bytes in private memory, and how many there were: into huge pages where
    the copy fills at least one and the OS gives them, else through a memfd (mapped read-only), else
    one read into fresh memory."""
    if size >= _HUGE_PAGE and _huge_pages_on_request():
        return _read_into_huge_pages(fd, size)
    copied = _copy_into_memfd(fd, size)
    if copied is not None:
        return copied
    return _read_into(fd, memoryview(bytearray(size)))


def _read_into(fd: int, view: memoryview) -> tuple[memoryview, int]:
    done, size = 0, len(view)
    while done < size:
        count = os.preadv(fd, [view[done:]], done)
        if count <= 0:
            break
        done += count
    return view, done


@functools.cache
def _huge_pages_on_request() -> bool:
    """Whether `MADV_HUGEPAGE` gets transparent huge pages here (Linux, THP mode "always" or "madvise")."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def _read_into_huge_pages(fd: int, size: int) -> tuple[memoryview, int]:
    """One read into anonymous memory made of huge pages where they are not mostly empty.

    The mapping is over-sized by two huge pages, so that a 2 MiB-aligned start lies inside it whatever
    the kernel's placement; what lies before that start or after the copy is never touched and costs
    no memory. The copy's last, partial huge page is a huge page too when that wastes at most a
    quarter of the copy's size (3.5 MB: 0.5 MB), else it stays in 4 KiB pages.
    """
    mapping = mmap.mmap(-1, size + 2 * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % _HUGE_PAGE
    whole = size - size % _HUGE_PAGE
    rounded_up = whole + _HUGE_PAGE if size % _HUGE_PAGE else whole
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, rounded_up if 4 * (rounded_up - size) <= size else whole)
    except OSError:
        pass  # refused (a kernel without THP for anonymous memory): 4 KiB pages, as without the request
    return _read_into(fd, memoryview(mapping)[start : start + size])


def _copy_into_memfd(fd: int, size: int) -> tuple[mmap.mmap, int] | None:
    if not (hasattr(os, "memfd_create") and hasattr(os, "sendfile")):
        return None
    try:
        memfd = os.memfd_create("quiver-section", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        done = 0
        while done < size:
            count = os.sendfile(memfd, fd, done, size - done)
            if count <= 0:
                break
            done += count
        return (mmap.mmap(memfd, size, access=mmap.ACCESS_READ), done) if done == size else None
    except OSError:
        return None  # a file system without sendfile: read it
    finally:
        os.close(memfd)

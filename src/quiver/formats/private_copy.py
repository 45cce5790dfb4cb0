"""Private copies of files (sections loaded from a path): made by the kernel into a memfd where it can.

A section loaded from a path is copied, so that what was checked is what is used whatever later happens
to the file. Most of a copy's cost is making fresh pages, not moving bytes: through a memfd the kernel
copies page-cache pages into it, faster than reading into fresh memory. Keeping such pages ready on a
background thread was measured and left out: in a process whose ONNX Runtime threads keep the cores
busy, that thread's turns at the GIL and at the memory map's lock slowed the next load. Neither were
transparent huge pages kept (`MADV_HUGEPAGE`): copies slowed once the kernel handed out huge pages the
host had not backed yet. (The measurements: docs/worklog.md.)
"""

from __future__ import annotations

import mmap
import os


def read_private(fd: int, size: int) -> tuple[memoryview | mmap.mmap, int]:
    """The file's first `size` bytes in private memory, and how many there were: through a memfd where
    the OS has one (mapped read-only), else one read."""
    copied = _copy_into_memfd(fd, size)
    if copied is not None:
        return copied
    view, done = memoryview(bytearray(size)), 0
    while done < size:
        count = os.preadv(fd, [view[done:]], done)
        if count <= 0:
            break
        done += count
    return view, done


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

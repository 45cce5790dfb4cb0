"""What differs between operating systems, in one place: file locks, fork hooks, the machine's memory,
memory given on demand and huge pages, and every call into the C library (Windows has neither `fcntl` nor
`fork` nor `sysconf`; huge pages on request, `madvise`, `malloc_trim` and `mallopt` are Linux's and
glibc's), each a portable equivalent or nothing to do where the OS lacks it."""

from __future__ import annotations

import ctypes
import importlib
import mmap
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

_LOCK_RETRY_S = 0.05  # how often a blocking lock is tried again where the OS cannot wait for it (Windows)


def _optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


fcntl: Any = _optional("fcntl")  # POSIX: flock, and Linux's leases (formats.file_guard)
_msvcrt: Any = _optional("msvcrt")  # Windows: byte-range locks
CAN_LOCK = fcntl is not None or _msvcrt is not None  # whether `lock_file` keeps processes apart here
_VOID, _SIZE, _INT = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
# the C library's calls Quiver makes, their result and argument types (set once, on the one handle)
_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "madvise": (_INT, [_VOID, _SIZE, _INT]),
    "malloc_trim": (_INT, [_SIZE]),
    "mallopt": (_INT, [_INT, _INT]),
    "fflush": (_INT, [_VOID]),
    "mmap": (_VOID, [_VOID, _SIZE, _INT, _INT, _INT, ctypes.c_long]),
    "mremap": (_VOID, [_VOID, _SIZE, _SIZE, _INT, _VOID]),
    "mprotect": (_INT, [_VOID, _SIZE, _INT]),
    "munmap": (_INT, [_VOID, _SIZE]),
    "process_vm_readv": (ctypes.c_ssize_t, [_INT, _VOID, ctypes.c_ulong, _VOID, ctypes.c_ulong, ctypes.c_ulong]),
}
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _c_library() -> ctypes.CDLL | None:
    """The process's C library (Linux), with `_PROTOTYPES` set on the calls it has; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        library = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    for name, (result, arguments) in _PROTOTYPES.items():
        call = getattr(library, name, None)  # musl has no malloc_trim nor mallopt
        if call is not None:
            call.restype, call.argtypes = result, arguments
    return library


C_LIBRARY = _c_library()  # the one handle on the C library (formats.file_guard maps and reads memory with it)


def c_call(name: str) -> Any:
    """The C library's `name` with its prototype (`_PROTOTYPES`), or None where the OS or library lacks it."""
    return getattr(C_LIBRARY, name, None) if C_LIBRARY is not None else None


def return_freed_memory() -> None:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim): memory a large allocation freed
    may stay in the process's RSS without it. Nothing to do elsewhere."""
    trim = c_call("malloc_trim")
    if trim is not None:
        trim(0)


def map_large_blocks_alone(threshold: int = 256 * 1024) -> None:
    """Makes the allocator map every block of `threshold` bytes or more on its own and unmap it when freed
    (glibc's `mallopt(M_MMAP_THRESHOLD)`; a fixed threshold also turns its dynamic one off). Nothing where
    the C library has no `mallopt` (musl, other OSes): its own policy stands."""
    mallopt = c_call("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, threshold)


def flush_c_streams() -> None:
    """Writes out the C library's stdio buffers (`fflush(NULL)`): `os._exit` would drop them."""
    flush = c_call("fflush")
    if flush is not None:
        flush(None)


def advise_pages(start: int, length: int, *advice: int) -> None:
    """`madvise` with each of `advice` (mmap.MADV_* values) on the whole pages within `[start, start +
    length)` of this process's memory (neighbours may share the edge pages: those are left); nothing where
    the OS has no madvise."""
    madvise = c_call("madvise")
    first, last = _whole_pages(start, length)
    if madvise is None or last <= first:
        return
    for each in advice:
        madvise(first, last - first, each)


def _whole_pages(start: int, length: int) -> tuple[int, int]:
    """The first and the end of the whole pages within `[start, start + length)`."""
    page = mmap.PAGESIZE
    return -(-start // page) * page, (start + length) // page * page


def cache_afresh(fd: int) -> None:
    """Drops a file just written and synced from the page cache and asks for it back (readahead, in the
    background): written, its pages sit in the small folios of its writes, read back in large ones, which
    a mapping that asks for huge pages (`formats.reader`) maps 2 MB at a time. A 3B int4 context's decode
    step took 86-92 ms mapped from the export's own pages (72 % of them in 2 MB mappings), 81-85 ms read
    back (98 %). Nothing where the OS has no `posix_fadvise`; pages another mapping uses stay."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # a file system that takes no advice: its pages as they are


def physical_memory() -> int | None:
    """The machine's memory in bytes, where the OS says (POSIX `sysconf`); None elsewhere."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def available_memory() -> int | None:
    """The memory the OS can give without swapping (Linux's MemAvailable), in bytes; None where it does not
    say."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def zeros_on_demand(nbytes: int) -> mmap.mmap:
    """Private zeroed memory whose pages exist only once written (a KV cache: memory grows with the tokens
    in it), in small pages: huge ones would make a few written tokens cost 2 MB each. Freed pages
    (`drop_pages`) read as zeros again. Private: a forked child writing to it never changes the parent's."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    memory = mmap.mmap(-1, max(nbytes, 1), flags=flags) if flags else mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return memory


def drop_pages(memory: mmap.mmap, start: int, length: int) -> None:
    """Gives the whole pages of `memory[start : start + length]` back to the OS (Linux's and the BSDs'
    MADV_DONTNEED on private memory: they read as zeros after); partial pages at the ends are kept (a
    neighbour's data may share them). Nothing where the OS cannot."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    first, end = _whole_pages(start, length)
    if end > first:
        memory.madvise(mmap.MADV_DONTNEED, first, end - first)


def lock_file(fd: int, blocking: bool = True) -> None:
    """An exclusive lock on the open file `fd`, held until it is closed (the OS drops it however the
    process ends). Not `blocking`: raises `BlockingIOError` while another process holds it. Where the OS
    has no such lock, nothing happens: processes are not kept apart."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return
    if _msvcrt is None:
        return
    os.lseek(fd, 0, os.SEEK_SET)  # msvcrt locks bytes from the position: the first byte of the file
    while True:
        try:
            _msvcrt.locking(fd, _msvcrt.LK_NBLCK, 1)
            return
        except OSError:
            if not blocking:
                raise BlockingIOError(f"file {fd} is locked by another process") from None
            time.sleep(_LOCK_RETRY_S)


def unlock_file(fd: int) -> None:
    """Lets the lock of `lock_file` go before the file is closed."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    elif _msvcrt is not None:
        os.lseek(fd, 0, os.SEEK_SET)
        _msvcrt.locking(fd, _msvcrt.LK_UNLCK, 1)


def at_fork(
    before: Callable[[], object] | None = None,
    after_in_parent: Callable[[], object] | None = None,
    after_in_child: Callable[[], object] | None = None,
) -> None:
    """`os.register_at_fork` where the OS forks; elsewhere no process is ever forked: nothing to do."""
    register = getattr(os, "register_at_fork", None)
    if register is None:
        return
    hooks = {"before": before, "after_in_parent": after_in_parent, "after_in_child": after_in_child}
    register(**{when: hook for when, hook in hooks.items() if hook is not None})


# --- huge pages ----------------------------------------------------------------------------------------
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MALLOC_HUGE_PAGES = "glibc.malloc.hugetlb"  # glibc 2.35+: malloc asks the kernel for transparent huge pages
HUGE_PAGES_CHOSEN = "QUIVER_HUGE_PAGES"  # 0: leave malloc as it is; 1: asked already (a restart never loops)


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`); None where it has none."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _libc() -> tuple[str, str]:
    """The C library's name and version (`confstr`, where glibc answers it); empty where unknown."""
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    except (AttributeError, ValueError, OSError):
        return "", ""
    return name, version


def huge_page_environment(
    environ: Mapping[str, str],
    mode: Callable[[], str | None] | None = None,
    libc: Callable[[], tuple[str, str]] | None = None,
) -> dict[str, str] | None:
    """`environ` with glibc's malloc set to back its memory with transparent huge pages, for a process that
    reads hundreds of MB of weights every step (ORT's packed copies of them live in malloc's memory: with
    4 KB pages a step walks page tables for many of their pages; decode runs faster with 2 MB ones:
    docs/BENCHMARKS.md). Only where the kernel gives huge pages on request alone (`madvise` mode: `always`
    gives them anyway, `never` not at all) and the C library is glibc 2.35 or later; None where nothing
    would change, or where it was chosen already (the tunable set either way, or QUIVER_HUGE_PAGES set:
    0 by the user, 1 by an earlier call). glibc reads it when a process starts: it serves a process started
    with it (`os.execve`)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if HUGE_PAGES_CHOSEN in environ or _MALLOC_HUGE_PAGES in tunables:
        return None
    if (mode or transparent_huge_pages)() != "madvise":  # `mode`, `libc`: what this machine says, unless given
        return None
    name, version = (libc or _libc)()
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or (major, minor) < (2, 35):
        return None
    tunables = ":".join(filter(None, [tunables, f"{_MALLOC_HUGE_PAGES}=1"]))
    return dict(environ) | {"GLIBC_TUNABLES": tunables, HUGE_PAGES_CHOSEN: "1"}


def huge_page_tunables(environ: Mapping[str, str]) -> str | None:
    """The GLIBC_TUNABLES a process started elsewhere on this one's behalf (a Ray replica, which does not
    inherit its environment) should start with: this process's own choice of huge pages carried over (the
    tunable set, by the user or by a restart), else what `huge_page_environment` would ask for; None for
    none (QUIVER_HUGE_PAGES=0, or nothing to ask here)."""
    if environ.get(HUGE_PAGES_CHOSEN) == "0":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if _MALLOC_HUGE_PAGES in tunables:
        return tunables
    asked = huge_page_environment(environ)
    return asked["GLIBC_TUNABLES"] if asked is not None else None

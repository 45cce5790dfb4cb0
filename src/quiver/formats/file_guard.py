"""Mapped files guarded against truncation: no change to a file by another program can kill this process.

Reading a mapped page of a file another program has truncated raises SIGBUS, which no Python code can
catch, in whatever thread touches it: Quiver's, or ONNX Runtime's, which maps weights from the same
file. So each mapped context file carries a read lease (`fcntl(F_SETLEASE)`). Before another process
can truncate the file or open it for writing, the kernel tells the lease holder and holds that process
back (up to `/proc/sys/fs/lease-break-time`, 45 s by default). A watcher thread, which polls the leases
every `POLL_S`, then swaps every mapping of the file in this process, Quiver's and ORT's alike (found in
/proc/self/maps), for a copy in memory at the same address (`mremap`, so no thread ever sees a missing
page), marks the file changed (its context then refuses new runs with `FileChangedError`) and lets the
lease go. Runs in flight finish on the copy.

The copy is a shared memfd mapping, not anonymous memory: the cpu backend lets go of mapped pages it
has packed (MADV_DONTNEED), which would zero anonymous pages but only drops the copy's, as the file's.

Linux only (elsewhere nothing is leased and `guard` returns None), for files this user owns on file
systems with leases (not NFS); elsewhere, and where the lease is refused, files are only checked before
each run (`TensorFile.check_unchanged`) and a truncation during a run can still end the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from quiver import fork, portable
from quiver.portable import fcntl

POLL_S = 0.02  # how often the watcher looks at the leases: the delay another process's truncate waits

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", 1025)
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)
_PROT_READ, _PROT_WRITE = 1, 2
_MAP_SHARED = 1
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


@dataclass
class _Guarded:
    fd: int
    device: tuple[int, int]
    inode: int
    on_change: Callable[[], None]


def _libc() -> ctypes.CDLL | None:
    """The C library, where a file's pages can be swapped for a private copy (Linux: memfd, leases)."""
    if not hasattr(os, "memfd_create") or fcntl is None:
        return None
    return portable.C_LIBRARY if all(portable.c_call(n) for n in ("mmap", "mremap", "mprotect", "munmap",
                                                                   "process_vm_readv")) else None  # fmt: skip


_LIBC = _libc()
# The lease-break notice goes to a signal whose default action is to ignore it (SIGIO's would end the
# process): the watcher polls, it needs no handler, and the file may be opened from any thread.
_NOTICE = signal.SIGURG


class _Watcher:
    """The guarded files of this process and the thread that rescues them."""

    def __init__(self) -> None:
        # Reentrant: the garbage collector may run a context's finalizer (which releases its guard) in
        # whichever thread allocates, this one's included while it holds the lock; a plain lock deadlocked
        # the watcher there (a CI run hung).
        self._lock = threading.RLock()
        self._files: dict[int, _Guarded] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def guard(self, fd: int, on_change: Callable[[], None]) -> int | None:
        """Takes a read lease on the file open as `fd`, through an open file of its own; returns the
        guard's handle (for `release`), or None where the file cannot be guarded."""
        if _LIBC is None or signal.getsignal(_NOTICE) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            return None  # a handler of the application's own would be called: no lease, no guard
        leased = _leased(fd)
        if leased is None:
            return None
        info = os.fstat(leased)
        with self._lock:
            device = (os.major(info.st_dev), os.minor(info.st_dev))
            self._files[leased] = _Guarded(leased, device, info.st_ino, on_change)
            self._start()
        return leased

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="quiver-file-guard", daemon=True)
            self._thread.start()

    def release(self, handle: int) -> None:
        """Lets the lease go and closes the guard's file."""
        with self._lock:
            if self._files.pop(handle, None) is None:
                return
        with contextlib.suppress(OSError):
            fcntl.fcntl(handle, _F_SETLEASE, fcntl.F_UNLCK)
        with contextlib.suppress(OSError):
            os.close(handle)

    def _watch(self) -> None:
        while True:
            with self._lock:
                if not self._files:
                    self._thread = None
                    return
                files = list(self._files.copy().values())  # a release from a finalizer may pop meanwhile
            for guarded in files:
                try:
                    breaking = fcntl.fcntl(guarded.fd, _F_GETLEASE) != fcntl.F_RDLCK
                except OSError:
                    breaking = False  # released meanwhile
                if breaking:
                    self._rescue(guarded)
            self._wake.wait(POLL_S)

    def _rescue(self, guarded: _Guarded) -> None:
        """Every mapping of the file becomes a copy in memory, the file is marked changed, the lease goes."""
        try:
            for start, end in _mappings_of(guarded.device, guarded.inode):
                _replace_with_copy(start, end - start)
        except Exception:  # noqa: BLE001  a thread that must not die: the file is still marked changed
            pass
        finally:
            with contextlib.suppress(Exception):
                guarded.on_change()
            self.release(guarded.fd)

    def _after_fork_in_child(self) -> None:
        """A forked child has no watcher thread, and the leases it inherited are the parent's (a lease
        belongs to an open file, which both share): the parent's watcher rescues the parent only. So the
        child opens each file again, takes a lease of its own, and watches it with a thread of its own."""
        self._lock = threading.RLock()
        self._thread = None
        inherited, self._files = self._files, {}
        for guarded in inherited.values():
            leased = _leased(guarded.fd)
            with contextlib.suppress(OSError):
                os.close(guarded.fd)  # the parent's open file stays open in the parent, its lease too
            if leased is not None:
                self._files[leased] = _Guarded(leased, guarded.device, guarded.inode, guarded.on_change)
        if self._files:
            self._start()


def _leased(fd: int) -> int | None:
    """A new open file of the file open as `fd`, read-leased; None where the lease is refused (not the
    owner, a file system without leases, the file open for writing somewhere)."""
    try:
        leased = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.fcntl(leased, _F_SETSIG, int(_NOTICE))
        fcntl.fcntl(leased, _F_SETLEASE, fcntl.F_RDLCK)
    except OSError:
        os.close(leased)
        return None
    return leased


def _mappings_of(device: tuple[int, int], inode: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each of this process's mappings of the file."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or int(fields[4]) != inode:
                continue
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            if (major, minor) == device:
                start, end = (int(part, 16) for part in fields[0].split("-"))
                yield start, end


def _replace_with_copy(start: int, length: int) -> bool:
    """Copies [start, start + length) into a memfd mapping and moves that over the range, atomically; False
    (nothing changed) where the range went away meanwhile. Another thread may unmap it at any time (ONNX
    Runtime maps a context file while it makes a session and lets it go after), so it is read with
    `process_vm_readv`, which fails where memory is gone instead of faulting."""
    assert _LIBC is not None
    fd = os.memfd_create("quiver-guarded-copy", getattr(os, "MFD_CLOEXEC", 1))
    try:
        os.ftruncate(fd, length)
        copy = _LIBC.mmap(None, length, _PROT_READ | _PROT_WRITE, _MAP_SHARED, fd, 0)
    finally:
        os.close(fd)  # the mapping keeps the memfd
    if copy in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap failed")
    # the file is whole: its truncation waits for the lease. A copy placed over the range means the range
    # was gone (its address free again) before the copy was made.
    overlaps = copy < start + length and start < copy + length
    if overlaps or not _copied(copy, start, length):
        _LIBC.munmap(copy, length)
        return False
    _LIBC.mprotect(copy, length, _PROT_READ)
    moved = _LIBC.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, start)
    if moved != start:
        _LIBC.munmap(copy, length)
        raise OSError(ctypes.get_errno(), "mremap failed")
    return True


def _copied(target: int, source: int, length: int) -> bool:
    """Copies `length` bytes of this process's memory; False where some of it is not mapped (or the kernel
    refuses this process reading itself, where a plain copy is the only way left)."""
    assert _LIBC is not None
    local, remote = _IoVec(target, length), _IoVec(source, length)
    read = _LIBC.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if read == length:
        return True
    if read < 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        ctypes.memmove(target, source, length)
        return True
    return False


WATCHER = _Watcher()
fork.reset_after_fork(WATCHER)

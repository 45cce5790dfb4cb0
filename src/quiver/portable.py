"""What differs between operating systems, in one place: file locks, fork hooks and the machine's memory
(Windows has neither `fcntl` nor `fork` nor `sysconf`), each a portable equivalent or nothing to do where
the OS lacks it."""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
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


def physical_memory() -> int | None:
    """The machine's memory in bytes, where the OS says (POSIX `sysconf`); None elsewhere."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


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

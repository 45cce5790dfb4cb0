"""A gate that `fork` closes: ONNX Runtime work holding process-wide locks is never cut in half by it.

Making (or dropping) a session takes locks inside ONNX Runtime that belong to the whole process. A
thread that holds one when another thread forks holds it in the child forever, and the child's own
sessions then wait on it (seen: a child whose background packing hung, so it never exited). Work that
passes the gate runs whole before a fork or after it; a fork waits for what is inside.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ForkGate:
    """Any number of threads pass at once; `close()` waits until none is inside and keeps new ones out."""

    def __init__(self) -> None:
        self._open()

    def _open(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._inside = 0

    @contextmanager
    def passing(self) -> Iterator[None]:
        with self._changed:
            self._inside += 1
        try:
            yield
        finally:
            with self._changed:
                self._inside -= 1
                if not self._inside:
                    self._changed.notify_all()

    def close(self) -> None:
        """Called just before `fork`: returns once no thread is inside; the gate stays closed."""
        self._changed.acquire()
        while self._inside:
            self._changed.wait()

    def reopen(self) -> None:
        """In the parent after `fork`."""
        self._changed.release()

    def reopen_in_child(self) -> None:
        """In the child after `fork`: the only thread there is the one that forked, and nobody is inside."""
        self._open()

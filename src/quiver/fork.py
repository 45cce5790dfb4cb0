"""Fork safety: a forked child (gunicorn --preload, multiprocessing's fork) runs contexts and exits normally.

After `fork` only the forking thread exists in the child. ORT sessions made by the parent rely on
threads the child does not have, and locks the parent's threads held stay held. So the child gets new
locks and prepares its own sessions (`Store._after_fork_in_child`); the parent's copies are never
destroyed there (destroying one joins threads that are not there). And ONNX Runtime (seen with 1.32,
not with 1.24) starts a thread when it is imported: at the child's exit its C++ static destructors wait
for that thread forever (upstream: microsoft/onnxruntime#31961). A forked child that imported ONNX Runtime
therefore ends, once Python's own exit work is done (threads joined, atexit callbacks, finalizers),
with `os._exit` and the status it was exiting with.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

from quiver import portable

_IMPORTED_IN = os.getpid()
_exit_status: list[object] = [0]
_handlers: weakref.WeakSet[Any] = weakref.WeakSet()  # objects with an _after_fork_in_child() method


def keep_forever(thing: object) -> None:
    """Makes an object immortal in this process (a forked child's copy of the parent's ORT sessions)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thing))


def reset_after_fork(owner: Any) -> None:
    """Calls `owner._after_fork_in_child()` in every forked child while `owner` lives."""
    _handlers.add(owner)


def _status_code(status: object) -> int:
    """The exit status Python gives `sys.exit(status)` (which has printed a message status already)."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    return 1


def _recording(exit: Callable[..., Any]) -> Callable[..., Any]:
    def recorded_exit(status: object = None) -> Any:
        _exit_status[0] = status
        return exit(status)

    return recorded_exit


def _in_child() -> None:
    for owner in list(_handlers):
        owner._after_fork_in_child()
    sys.exit = _recording(sys.exit)
    previous_hook = sys.excepthook

    def uncaught(*info: Any) -> None:
        _exit_status[0] = 1
        previous_hook(*info)

    sys.excepthook = uncaught


def _end_forked_child() -> None:
    """Registered first, so it runs last of the atexit callbacks: only then skip the C++ destructors."""
    if os.getpid() == _IMPORTED_IN or "onnxruntime" not in sys.modules:
        return
    leave_now(_status_code(_exit_status[0]))


def leave_now(status: int) -> None:
    """Ends the process with `status` once its output is written (Python's and C's buffers), skipping what
    is left of the exit: joining threads, C++ static destructors (ONNX Runtime's can wait on threads)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to write
            pass
    portable.flush_c_streams()  # C stdio buffers, which os._exit would drop
    os._exit(status)


# Registered when Quiver's runtime is first imported: in a forked child, atexit callbacks registered
# after that run first (LIFO), those registered before it are skipped with the C++ destructors.
atexit.register(_end_forked_child)
portable.at_fork(after_in_child=_in_child)

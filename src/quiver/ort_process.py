"""ONNX Runtime's process-wide settings the cpu backend honours: log severity and global thread pools.

Kept apart from the backends (and below them, with `fork`) so that `quiver.ort` can set them without
importing any backend.
"""

from __future__ import annotations

import threading

# ORT's process-wide thread pools (`set_global_thread_pool_sizes`): once made, ORT's Python API refuses
# sessions with threads of their own, so every session the backend makes then runs on them.
GLOBAL_POOLS_MESSAGE = "use_per_session_threads must be false when using a global thread pool"
_global_thread_pools = threading.Event()

# The log severity of the sessions the backend makes: fatal only (a failing run raises with ORT's message,
# and a normal load prints nothing) until the user asks ORT for its logs (`set_ort_log_severity`).
_ort_log_severity = 4


def use_global_thread_pools() -> None:
    """Sessions made from now on use ORT's global thread pools (call after `set_global_thread_pool_sizes`)."""
    _global_thread_pools.set()


def global_thread_pools_in_use() -> bool:
    return _global_thread_pools.is_set()


def set_ort_log_severity(severity: int) -> None:
    """Sessions made from now on log at this severity (0 verbose ... 4 fatal), as the user asked ORT to."""
    global _ort_log_severity
    _ort_log_severity = min(max(int(severity), 0), 4)


def ort_log_severity() -> int:
    return _ort_log_severity

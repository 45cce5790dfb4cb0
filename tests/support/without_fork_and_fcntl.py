"""A pytest plugin (`-p tests.support.without_fork_and_fcntl`) that takes `fcntl`, `os.fork` and
`os.register_at_fork` away before Quiver is imported, as on Windows: what the core must run without (the
standard library's own modules, `random` among them, register fork hooks only where `os.fork` is)."""

from __future__ import annotations

import os
import sys

sys.modules["fcntl"] = None  # type: ignore[assignment]  # `import fcntl` now raises ImportError
for name in ("register_at_fork", "fork", "forkpty"):
    if hasattr(os, name):
        delattr(os, name)

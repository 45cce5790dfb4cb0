"""The cpu backend (ONNX Runtime's CPU execution provider), one module per job; the names other packages use.

Each name is imported from its module on first use (PEP 562): a caller of one module (the settings, the
packed-weights folder) does not load the backend's others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quiver.backends.cpu.backend import CpuBackend
    from quiver.backends.cpu.capi import fork_waits
    from quiver.backends.cpu.executable import CpuExecutable
    from quiver.backends.cpu.packed_file import folder_from
    from quiver.backends.cpu.settings import DEFAULT_ACCURACY_LEVEL, SessionSettings, tuned_value_problem

# name -> the module that defines it
_LAZY = {
    "CpuBackend": "quiver.backends.cpu.backend",
    "CpuExecutable": "quiver.backends.cpu.executable",
    "DEFAULT_ACCURACY_LEVEL": "quiver.backends.cpu.settings",
    "SessionSettings": "quiver.backends.cpu.settings",
    "folder_from": "quiver.backends.cpu.packed_file",
    "fork_waits": "quiver.backends.cpu.capi",
    "tuned_value_problem": "quiver.backends.cpu.settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quiver.backends.cpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DEFAULT_ACCURACY_LEVEL",
    "CpuBackend",
    "CpuExecutable",
    "SessionSettings",
    "folder_from",
    "fork_waits",
    "tuned_value_problem",
]

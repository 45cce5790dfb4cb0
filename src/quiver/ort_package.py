"""The installed onnxruntime package itself, bound once: Quiver never imports `onnxruntime` by name.

Libraries that ship ONNX models do `import onnxruntime` themselves; the way to put them on Quiver is
`sys.modules["onnxruntime"] = quiver.ort` (`quiver.ort.install()`). After such a swap a plain
`import onnxruntime` gives `quiver.ort`, so Quiver's own engines would run themselves and recurse.
Every module of Quiver takes ORT from here instead (`from quiver.ort_package import onnxruntime`, bound
on first use: `import quiver.ort` binds it), and its subpackages through `submodule`, which imports them
with the real package in place.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING

NAME = "onnxruntime"
_lock = threading.RLock()  # one swap of sys.modules at a time (the import of a missing subpackage)


def is_real(module: object) -> bool:
    """Whether `module` is the onnxruntime package itself (not `quiver.ort` or another stand-in)."""
    return isinstance(module, ModuleType) and module.__name__ == NAME


@contextmanager
def _real_package_in_sys_modules(real: ModuleType | None) -> Iterator[None]:
    """The real package under its name while an import runs, the user's choice put back after it (the
    only moment another thread's `import onnxruntime` could see ORT itself instead of a swap)."""
    with _lock:
        swapped = sys.modules.get(NAME)
        if is_real(swapped) or (swapped is None and real is None):
            yield
            return
        if real is None:
            del sys.modules[NAME]
        else:
            sys.modules[NAME] = real
        try:
            yield
        finally:
            if swapped is not None:
                sys.modules[NAME] = swapped


_bound: ModuleType | None = None


def package() -> ModuleType:
    """The onnxruntime package, imported on first use (with a swap in place, ORT itself, not the swap)."""
    global _bound
    if _bound is None:
        with _lock:
            current = sys.modules.get(NAME)
            if isinstance(current, ModuleType) and is_real(current):
                _bound = current
            else:
                with _real_package_in_sys_modules(None):
                    _bound = importlib.import_module(NAME)
    return _bound


if TYPE_CHECKING:
    import onnxruntime  # noqa: F401  (the type of the name `__getattr__` gives)
else:

    def __getattr__(name: str) -> ModuleType:
        """`from quiver.ort_package import onnxruntime`: ORT, bound on first use (importing this is free)."""
        if name == NAME:
            return package()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def submodule(name: str) -> ModuleType:
    """ORT's `onnxruntime.<name>` (e.g. "quantization", "capi.onnxruntime_pybind11_state"), imported with
    the real package in place, so its own `from onnxruntime import ...` binds ORT's objects, not a swap's."""
    real = package()
    full = f"{NAME}.{name}"
    loaded = sys.modules.get(full)
    if loaded is not None:
        return loaded
    with _real_package_in_sys_modules(real):
        return importlib.import_module(full)

"""Backends: `reference` (onnx.reference) and `cpu` (ONNX Runtime) behind one small interface.

Each backend's module is imported when the backend is first made: the cpu one loads ONNX Runtime, the
reference one `onnx.reference`, and a process that uses one should not pay for the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quiver.backends.base import (
    AheadOfTimeBackend,
    AheadOfTimeForm,
    Backend,
    Executable,
    FinalizedGraph,
    MappedFile,
    PreparedGraph,
    Repeatable,
    StoredWeight,
    WeightFile,
    available_backends,
    get_backend,
    register_backend,
)

if TYPE_CHECKING:
    from quiver.backends.cpu import CpuBackend
    from quiver.backends.reference import ReferenceBackend


def _reference() -> Backend:
    from quiver.backends.reference import ReferenceBackend

    return ReferenceBackend()


def _cpu(**options: Any) -> Backend:
    from quiver.backends.cpu import CpuBackend

    return CpuBackend(**options)


register_backend("reference", _reference)
register_backend("cpu", _cpu)
register_backend("cpu-noprepack", lambda: _cpu(prepack=False))


def __getattr__(name: str) -> Any:
    if name == "CpuBackend":
        from quiver.backends.cpu import CpuBackend

        return CpuBackend
    if name == "ReferenceBackend":
        from quiver.backends.reference import ReferenceBackend

        return ReferenceBackend
    raise AttributeError(f"module 'quiver.backends' has no attribute {name!r}")


__all__ = [
    "AheadOfTimeBackend",
    "AheadOfTimeForm",
    "Backend",
    "CpuBackend",
    "Executable",
    "Repeatable",
    "FinalizedGraph",
    "MappedFile",
    "PreparedGraph",
    "ReferenceBackend",
    "StoredWeight",
    "WeightFile",
    "available_backends",
    "get_backend",
    "register_backend",
]

"""Backends: `reference` (onnx.reference) and `cpu` (ONNX Runtime) behind one small interface."""

from quiver.backends.base import Backend, Executable, FinalizedGraph, available_backends, get_backend, register_backend
from quiver.backends.cpu import CpuBackend
from quiver.backends.reference import ReferenceBackend

register_backend("reference", ReferenceBackend)
register_backend("cpu", CpuBackend)
register_backend("cpu-noprepack", lambda: CpuBackend(prepack=False))

__all__ = [
    "Backend",
    "CpuBackend",
    "Executable",
    "FinalizedGraph",
    "ReferenceBackend",
    "available_backends",
    "get_backend",
    "register_backend",
]

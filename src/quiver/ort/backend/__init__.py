"""`quiver.ort.backend`: ONNX's backend API over `quiver.ort` sessions, laid out as `onnxruntime.backend`."""

from quiver.ort.backend.backend import is_compatible, prepare, run, supports_device

__all__ = ["is_compatible", "prepare", "run", "supports_device"]

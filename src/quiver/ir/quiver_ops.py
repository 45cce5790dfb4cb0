"""Quiver's own operators' names (domain `ai.quiver`), importable without the `onnx` package."""

from __future__ import annotations

QUIVER_DOMAIN = "ai.quiver"
MATMUL_4BITS = "MatMul4Bits"  # 4-bit blocks with a float16 scale and minimum each (cpu backend: native_ops)
MATMUL_4BITS_BLOCK = 32  # the one block size it takes
QUIVER_OPS = frozenset({MATMUL_4BITS})

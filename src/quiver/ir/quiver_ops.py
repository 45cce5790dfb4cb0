"""Quiver's own operators' names (domain `ai.quiver`), importable without the `onnx` package."""

from __future__ import annotations

QUIVER_DOMAIN = "ai.quiver"
MATMUL_4BITS = "MatMul4Bits"  # 4-bit blocks with a float16 scale and minimum each (cpu backend: native_ops)
MATMUL_4BITS_BLOCK = 32  # the one block size it takes
# ORT's GroupQueryAttention (its inputs, outputs and attributes) for a decode step's few rows: one read of
# the keys and values per kv head (cpu backend: native_ops; elsewhere ORT's own operator in its place)
DECODE_ATTENTION = "DecodeAttention"
QUIVER_OPS = frozenset({MATMUL_4BITS, DECODE_ATTENTION})

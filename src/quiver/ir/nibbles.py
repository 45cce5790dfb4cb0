"""Values of fewer than 8 bits packed into bytes, the first lowest (ONNX's INT4/UINT4, ORT's MatMulNBits)."""

from __future__ import annotations

import numpy as np


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit values (last axis even) two per byte, the first in the low nibble."""
    values = values.astype(np.uint8)
    return (values[..., 0::2] & 0x0F) | ((values[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: np.ndarray, count: int, signed: bool) -> np.ndarray:
    """The first `count` 4-bit values of packed bytes: int8 (sign-extended) or uint8, flat."""
    values = unpack_bits(packed.reshape(-1), 4)[:count]
    return ((values.astype(np.int8) ^ 8) - 8) if signed else values


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Each byte's 8/bits unsigned values, lowest bits first, in its place: the last axis grows 8/bits
    times (MatMulNBits' layout at 2, 4 or 8 bits)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"MatMulNBits with {bits} bits is not supported; ONNX Runtime's has 2, 4 or 8")
    if bits == 8:
        return packed
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], -1)

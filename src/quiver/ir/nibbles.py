"""4-bit values packed two per byte, the first in the low nibble (ONNX's and ORT's INT4/UINT4 layout)."""

from __future__ import annotations

import numpy as np


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit values (last axis even) two per byte, the first in the low nibble."""
    values = values.astype(np.uint8)
    return (values[..., 0::2] & 0x0F) | ((values[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: np.ndarray, count: int, signed: bool) -> np.ndarray:
    """The first `count` 4-bit values of packed bytes: int8 (sign-extended) or uint8, flat."""
    values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(-1)[:count]
    return ((values.astype(np.int8) ^ 8) - 8) if signed else values

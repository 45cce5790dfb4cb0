"""Skeleton regions stored deflated (format 1.7): ONNX structure is mostly repeated names, several times smaller.

A quantized graph's skeleton (its Q/DQ nodes, their long names, small inline scales) weighs ~1 % of its
weights, and its prepared form as much again; deflated, both together stay well under 1 %.
"""

from __future__ import annotations

import zlib

from quiver.errors import InvalidHeaderError

ZLIB = "zlib"
_LEVEL = 6
# Deflate expands at most ~1032:1; a header claiming more than that of a region is damaged, and no
# skeleton is larger than protobuf's 2 GiB limit: the length is checked before anything is inflated.
_MAX_RATIO = 1032
_MAX_INFLATED = (1 << 31) - 1


def deflated(data: bytes) -> bytes | None:
    """`data` deflated (zlib), or None where that would not make it smaller."""
    packed = zlib.compress(data, _LEVEL)
    return packed if len(packed) < len(data) else None


def check_inflated_length(inflated: int, stored: int, what: str) -> None:
    """Refuses a recorded length no `stored` deflated bytes can come to (read before inflating)."""
    if inflated > min(_MAX_RATIO * stored + 64, _MAX_INFLATED):
        raise InvalidHeaderError(
            f"{what} records {inflated} bytes inflated from {stored}, more than deflate can give; "
            "the context binary is damaged: rebuild it with `quiver build`"
        )


def inflated(data: bytes, length: int, what: str) -> bytes:
    """The `length` bytes a region deflated to `data`; never more than that is produced."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, length + 1)
    except zlib.error as exc:
        raise InvalidHeaderError(
            f"{what} does not inflate ({exc}); the context binary is damaged: rebuild it with `quiver build`"
        ) from None
    whole = inflater.eof and not inflater.unconsumed_tail and not inflater.unused_data
    if not whole or len(out) != length:
        given = f"{len(out)} bytes" if len(out) <= length else "more"
        raise InvalidHeaderError(
            f"{what} does not inflate to the {length} bytes its header records (it gives {given}); "
            "the context binary is damaged: rebuild it with `quiver build`"
        )
    return out

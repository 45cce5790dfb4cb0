"""The target server's wire format: length-prefixed MsgPack messages, tensors by content key, typed errors.

A frame is a 4-byte big-endian length, then that many bytes of MsgPack: a map with "op" (requests) or
"ok" (replies). A failed request is answered `{"ok": false, "error": KIND, "message": ...}` with KIND
one of `ERRORS`. Tensors travel once, in chunks, under a content key "dtype/d0xd1/sha256": the server
checks the bytes against the key before it keeps them.
"""

from __future__ import annotations

import hashlib
import math
import re
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

PROTOCOL = 1
DEFAULT_PORT = 22598  # qnn-gpu-target-server's
MAX_MESSAGE = 64 * 1024 * 1024  # a frame's cap; larger tensors go in chunks
CHUNK = 16 * 1024 * 1024
MAX_OBJECTS = 250_000  # values in one message (keys and strings included): bounds what decoding allocates
_LENGTH = struct.Struct(">I")

ERRORS = {
    "bad-frame": "a frame that is cut short or not MsgPack",
    "too-large": "a frame, tensor or store beyond the server's limits",
    "bad-request": "a request of the wrong shape: unknown op, missing or mistyped fields",
    "unauthorized": "no hello with the server's token yet",
    "unknown-handle": "a graph, input set, variant or tensor the server does not hold",
    "checksum": "a tensor's bytes do not match its key",
    "backend": "the backend failed to prepare or run a variant",
    "busy": "the server serves as many clients as it may; try again later",
    "internal": "an unexpected failure on the server (it keeps serving)",
}

_KEY = re.compile(r"(?P<dtype>[a-z0-9]+)/(?P<shape>(\d+(x\d+)*)?)/(?P<sha>[0-9a-f]{64})(/[0-9a-f]{0,64})?")


class ProtocolError(Exception):
    """A request the server refuses: `kind` is one of `ERRORS`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ConnectionClosed(Exception):
    """The peer closed the connection (or went silent past the timeout) between frames or inside one."""


def _read_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytearray:
    """`count` bytes, received into one buffer; each wait is bounded by the socket's timeout and, with a
    `deadline` (monotonic), by what is left of it, so that bytes trickling in cannot stretch a read past it."""
    buffer = bytearray(count)
    view, got = memoryview(buffer), 0
    idle = sock.gettimeout()
    try:
        while got < count:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectionClosed("too slow")  # a frame trickled in to hold a connection open
                sock.settimeout(remaining if idle is None else min(idle, remaining))
            try:
                received = sock.recv_into(view[got:], min(count - got, 1 << 20))
            except (TimeoutError, OSError):
                raise ConnectionClosed("timed out or reset") from None
            if not received:
                raise ConnectionClosed("closed")
            got += received
    finally:
        view.release()
        if deadline is not None:
            sock.settimeout(idle)
    return buffer


def _earliest(deadline: float | None, other: float) -> float:
    return other if deadline is None else min(deadline, other)


def read_frame(
    sock: socket.socket,
    limit: int = MAX_MESSAGE,
    patience_s: float | None = None,
    deadline: float | None = None,
    reserve: Callable[[int], None] | None = None,
) -> Any:
    """One decoded message; `ProtocolError` for an oversized or undecodable frame (after which the
    stream cannot be trusted: the server replies and closes). With `patience_s`, a frame that has begun
    (its header's first byte) must be whole within that time plus a second per MB, however slowly its
    bytes trickle in; with `deadline` (monotonic), everything must arrive by then, the first byte too.
    `reserve(length)` is called once the length is known, before the frame's buffer is allocated (it
    may refuse by raising `ProtocolError`)."""
    first = _read_exactly(sock, 1, deadline)
    frame_deadline = deadline
    if patience_s is not None:
        frame_deadline = _earliest(deadline, time.monotonic() + patience_s)
    (length,) = _LENGTH.unpack(first + _read_exactly(sock, _LENGTH.size - 1, frame_deadline))
    if length > limit:
        raise ProtocolError("too-large", f"a frame of {length} bytes exceeds the limit of {limit}")
    if reserve is not None:
        reserve(length)
    if patience_s is not None and frame_deadline is not None:
        frame_deadline = _earliest(deadline, frame_deadline + length / 1e6)
    data = _read_exactly(sock, length, frame_deadline)
    try:
        _check_object_count(data)
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError, TypeError, ExtraData, StackError, FormatError...
        raise ProtocolError("bad-frame", f"not a MsgPack message ({type(exc).__name__})") from None


# What follows a MsgPack type byte (the MsgPack spec), to count a frame's values without decoding them:
# byte -> bytes of payload (ints, floats, fixext: type byte included)
_FIXED_SIZES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xCA: 4, 0xCB: 8,
                0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # fmt: skip
# byte -> (width of the length that follows, bytes after the length before the data): bin, str, ext
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),
          0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1)}  # fmt: skip
# byte -> (width of the count that follows, values per counted item): array16/32, map16/32
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _check_object_count(data: bytes | bytearray) -> None:
    """Refuses a frame of more than `MAX_OBJECTS` values before decoding it: one byte of MsgPack can decode
    to a 64-byte Python object (an empty map), so a full frame of them would take 64x its size. Reads
    only type bytes and lengths (msgpack's own Unpacker would copy the frame to skip through it)."""
    position, pending, seen, end = 0, 1, 0, len(data)
    while pending:
        if position >= end:
            raise ProtocolError("bad-frame", "a MsgPack message cut short")
        pending, seen = pending - 1, seen + 1
        if seen > MAX_OBJECTS:
            raise ProtocolError("too-large", f"a message of more than {MAX_OBJECTS} values")
        kind = data[position]
        position += 1
        if kind <= 0x7F or kind >= 0xE0 or kind in (0xC0, 0xC2, 0xC3):  # fixint, nil, booleans
            continue
        if kind <= 0x8F:  # fixmap
            pending += 2 * (kind & 0x0F)
        elif kind <= 0x9F:  # fixarray
            pending += kind & 0x0F
        elif kind <= 0xBF:  # fixstr
            position += kind & 0x1F
        elif kind in _FIXED_SIZES:
            position += _FIXED_SIZES[kind]
        elif kind in _SIZED:
            width, extra = _SIZED[kind]
            position += width + extra + int.from_bytes(data[position : position + width], "big")
        elif kind in _CONTAINERS:
            width, per_item = _CONTAINERS[kind]
            pending += per_item * int.from_bytes(data[position : position + width], "big")
            position += width
        else:  # 0xC1: never used
            raise ProtocolError("bad-frame", "not a MsgPack message (byte 0xc1)")


def write_frame(sock: socket.socket, message: Any) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def tensor_key(array: np.ndarray) -> str:
    """The content key of an array: dtype, shape, SHA-256 of its bytes (C order)."""
    data = np.ascontiguousarray(array)
    return f"{data.dtype.name}/{'x'.join(map(str, data.shape))}/{hashlib.sha256(data.data).hexdigest()}"


def parse_key(key: Any) -> tuple[np.dtype, tuple[int, ...], str]:
    """dtype, shape and checksum of a content key (a weight's may carry an encoding checksum too)."""
    match = _KEY.fullmatch(key) if isinstance(key, str) and len(key) < 1024 else None
    if match is None:
        raise ProtocolError("bad-request", f"{str(key)[:80]!r} is not a tensor key (dtype/d0xd1/sha256)")
    try:
        dtype = np.dtype(match["dtype"])
    except TypeError:
        raise ProtocolError("bad-request", f"unknown dtype {match['dtype']!r}") from None
    if dtype.kind not in "biuf" or dtype.itemsize == 0:
        raise ProtocolError("bad-request", f"dtype {dtype.name} cannot be a tensor here")
    shape = tuple(int(d) for d in match["shape"].split("x")) if match["shape"] else ()
    if len(shape) > 32:
        raise ProtocolError("bad-request", "a tensor has at most 32 dimensions")
    return dtype, shape, match["sha"]


def nbytes_of(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def field(message: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A request's field, checked for type (bool is not an int here)."""
    value = message.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, (int, float))):
        raise ProtocolError("bad-request", f"field {name!r} is missing or not {getattr(kind, '__name__', kind)}")
    return value

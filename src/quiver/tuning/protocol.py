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
from typing import Any

import msgpack
import numpy as np

PROTOCOL = 1
DEFAULT_PORT = 22598  # qnn-gpu-target-server's
MAX_MESSAGE = 64 * 1024 * 1024  # a frame's cap; larger tensors go in chunks
CHUNK = 16 * 1024 * 1024
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


def _read_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytes:
    chunks, left = [], count
    while left:
        if deadline is not None and time.monotonic() > deadline:
            raise ConnectionClosed("too slow")  # a frame trickled in to hold a connection open
        try:
            data = sock.recv(min(left, 1 << 20))
        except (TimeoutError, OSError):
            raise ConnectionClosed("timed out or reset") from None
        if not data:
            raise ConnectionClosed("closed")
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


def read_frame(sock: socket.socket, limit: int = MAX_MESSAGE, patience_s: float | None = None) -> Any:
    """One decoded message; `ProtocolError` for an oversized or undecodable frame (after which the
    stream cannot be trusted: the server replies and closes). With `patience_s`, a frame that has begun
    must arrive within that time plus a second per MB, however slowly its bytes trickle in."""
    (length,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
    if length > limit:
        raise ProtocolError("too-large", f"a frame of {length} bytes exceeds the limit of {limit}")
    deadline = None if patience_s is None else time.monotonic() + patience_s + length / 1e6
    data = _read_exactly(sock, length, deadline)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises ValueError, TypeError, ExtraData, StackError, FormatError...
        raise ProtocolError("bad-frame", f"not a MsgPack message ({type(exc).__name__})") from None


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

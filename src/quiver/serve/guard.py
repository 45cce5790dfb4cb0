"""What a connection may cost before its request reaches the API key check, whatever HTTP parser uvicorn runs.

uvicorn's parsers keep no common bound: httptools buffers a request head of any size, neither times out a
head that never ends, and nothing caps connections. `guarded(protocol)` wraps uvicorn's protocol class
(h11's or httptools') in a layer that reads the raw bytes first:

* **The head**: the request line and each header line at most `max_line` bytes, the whole head at most
  `max_head`; past either the connection gets 414 or 431 and is closed, before the parser holds it.
* **Time**: a head must arrive within `header_timeout` of the connection (or of the previous response, on
  a kept-alive connection); a slow or silent one gets 408 (or is closed, if it sent nothing).
* **Connections**: at most `max_connections` in all and `max_per_client` from one address. A new
  connection beyond either is taken all the same and the oldest connection still waiting for its head
  (of that address, else of all) is closed: whoever holds connections open without sending requests
  loses them first, and a client that sends its request at once is served while others hold the caps.

Bodies are bounded where they are read (`serve.app`: size, time, and bytes held for all requests); a
request answered before its body arrived whole (refused) has its connection closed, rather than the rest
of its body read into the parser's buffer.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from quiver.serve.openai_api import ApiError

_CRLF2 = b"\r\n\r\n"
_REASONS = {408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large"}


@dataclass(frozen=True)
class Limits:
    """What one connection and the server's connections may hold before a request is accepted."""

    max_line: int = 16 << 10  # the request line, and each header line
    max_head: int = 64 << 10  # the request line and every header together
    header_timeout: float = 10.0  # seconds for a whole head, from the connection or the previous response
    max_connections: int = 1024
    max_per_client: int = 128


class Guard:
    """The connections of one server (its event loop's thread alone touches it)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._all: OrderedDict[Any, None] = OrderedDict()  # oldest first
        self._by_client: dict[str, OrderedDict[Any, None]] = {}

    @property
    def connections(self) -> int:
        return len(self._all)

    def admit(self, connection: Any, client: str) -> None:
        """Counts a new connection; over a cap, the oldest one waiting for its head goes."""
        mine = self._by_client.setdefault(client, OrderedDict())
        mine[connection] = None
        self._all[connection] = None
        if len(mine) > self.limits.max_per_client:
            self._evict(mine)
        if len(self._all) > self.limits.max_connections:
            self._evict(self._all)

    def forget(self, connection: Any, client: str) -> None:
        self._all.pop(connection, None)
        mine = self._by_client.get(client)
        if mine is not None:
            mine.pop(connection, None)
            if not mine:
                del self._by_client[client]

    def _evict(self, among: OrderedDict[Any, None]) -> None:
        victim = next((c for c in among if c.waiting_for_head), None)
        if victim is not None:
            victim.close_unheard()


def guarded(protocol: type, guard: Guard) -> type:
    """uvicorn's HTTP protocol class `protocol` behind the head, time and connection limits of `guard`."""

    class GuardedProtocol(protocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
            self._guard_transport = transport
            self._deadline: asyncio.TimerHandle | None = None
            self._refused = False
            self._requests = 0  # heads read whose response is not complete yet
            self._expect_head()
            guard.admit(self, self._client)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.forget(self, self._client)
            self._cancel_deadline()
            super().connection_lost(exc)

        # --- the head --------------------------------------------------------------------------------
        def _expect_head(self) -> None:
            """A request head is next: counted from zero, due within the header timeout."""
            self.waiting_for_head = True
            self._head = bytearray()  # kept (up to max_head) to find where its body ends
            self._line = 0  # bytes of the line being read
            self._lines = 0  # lines read whole: the first is the request line
            self._body_left: int | None = 0
            self._cancel_deadline()
            self._deadline = self.loop.call_later(guard.limits.header_timeout, self._too_slow)

        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def data_received(self, data: bytes) -> None:
            while data and not self._refused:
                if self.waiting_for_head:
                    consumed, problem = self._scan(data)
                    if problem is not None:
                        self._refuse(*problem)
                        return
                    super().data_received(data[:consumed])
                    data = data[consumed:]
                elif self._body_left is None:  # a chunked body: the parser finds its end
                    super().data_received(data)
                    return
                else:
                    taken = min(len(data), self._body_left)
                    if taken:
                        super().data_received(data[:taken])
                        self._body_left -= taken
                        data = data[taken:]
                    if data:  # a pipelined request's head follows the body
                        self._expect_head()

        def _scan(self, data: bytes) -> tuple[int, tuple[int, str] | None]:
            """The bytes of `data` that belong to the head being read (at its end, where its body ends),
            or why it is refused."""
            limits = guard.limits
            start = len(self._head)
            self._head += data[: limits.max_head + 4 - start]
            end = self._head.find(_CRLF2, max(start - 3, 0))
            stop = len(self._head) if end < 0 else end + 2
            position = start
            while position < stop:  # each line's length, a line split over reads counted whole
                newline = self._head.find(b"\n", position, stop)
                self._line += (stop if newline < 0 else newline) - position
                if self._line > limits.max_line:
                    if self._lines == 0:
                        return 0, (414, f"a request line over {limits.max_line} bytes")
                    return 0, (431, f"a header line over {limits.max_line} bytes")
                if newline < 0:
                    break
                self._line, self._lines, position = 0, self._lines + 1, newline + 1
            if end < 0:
                if len(self._head) > limits.max_head:
                    return 0, (431, f"a request head over {limits.max_head} bytes")
                return len(data), None
            self.waiting_for_head = False
            self._requests += 1
            self._cancel_deadline()
            self._body_left = _body_length(bytes(self._head[: end + 4]))
            self._head = bytearray()  # the parser has it: nothing kept while the request runs
            return end + 4 - start, None

        def on_response_complete(self) -> None:
            cycle = getattr(self, "cycle", None)
            unread = cycle is not None and getattr(cycle, "more_body", False)
            super().on_response_complete()
            self._requests -= 1
            if unread:  # answered before its body arrived whole (an error): the rest is not worth reading
                self.close_unheard()
                return
            if not self._refused and not self.waiting_for_head and self._requests == 0:
                self._expect_head()

        # --- ends -------------------------------------------------------------------------------------
        def _too_slow(self) -> None:
            self._deadline = None
            if not self.waiting_for_head:
                return
            if self._head:
                self._refuse(408, f"the request head did not arrive within {guard.limits.header_timeout:g} s")
            else:
                self.close_unheard()

        def close_unheard(self) -> None:
            """Closes a connection waiting for its head (nothing to answer)."""
            self._refused = True
            self._cancel_deadline()
            self._guard_transport.close()

        def _refuse(self, status: int, message: str) -> None:
            self._refused = True
            self._cancel_deadline()
            body = json.dumps(ApiError(status, message, None, "request_head_refused").body()).encode()
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            transport = self._guard_transport
            if not transport.is_closing():
                transport.write(head.encode() + body)
                transport.close()

    GuardedProtocol.__name__ = f"Guarded{protocol.__name__}"
    return GuardedProtocol


def _body_length(head: bytes) -> int | None:
    """The bytes of body after this head: its Content-Length, 0 without one; None when chunked (its end is
    the parser's to find)."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            text = value.strip()
            length = int(text) if text.isdigit() and len(text) <= 18 else 0  # the parser refuses a bad one
    return length

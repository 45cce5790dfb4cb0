"""What a web page may make a server on this machine do: nothing, unless it is let.

A page from anywhere can have a browser POST to 127.0.0.1 (a "simple" request: `Content-Type: text/plain`
needs no preflight), or point its own host name at 127.0.0.1 (DNS rebinding) and read the replies. So,
before the API key check and before any route reads a byte of the body:

* POST routes take `Content-Type: application/json` only (415 otherwise): a page cannot send that without
  a CORS preflight, which this server answers only for `--allowed-origins`;
* the `Host` header must name the address the server listens on, a loopback name, or one of
  `--allowed-hosts` (400 otherwise): a rebound name is refused.
"""

from __future__ import annotations

from collections.abc import Collection

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from quiver.serve.openai_api import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(listening: str, given: Collection[str]) -> frozenset[str] | None:
    """The host names a request may give: the listening address and `given` (and, on loopback, loopback's
    names); None (any) where the server listens on every interface and no name was given."""
    names = {h.strip().lower().strip("[]") for h in given if h.strip()}
    if listening in ("0.0.0.0", "::", "") and not names:
        return None
    names.add(listening.lower().strip("[]"))
    if listening in LOOPBACK_NAMES or listening.startswith("127."):
        names.update(LOOPBACK_NAMES)
    return frozenset(names)


def _host_name(value: bytes) -> str:
    """A Host header's name without its port ("[::1]:8000" -> "::1")."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class BrowserGuard:
    """The two checks above, as ASGI middleware (in front of the API key check)."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if self.hosts is not None and _host_name(headers.get(b"host", b"")) not in self.hosts:
                message = ("the Host header names no address this server answers to (a page that rebound a name "
                           "to it?); add the name with --allowed-hosts")  # fmt: skip
                await _refuse(scope, receive, send, 400, message, "invalid_host")
                return
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if scope.get("method") == "POST" and kind != b"application/json":
                message = "POST bodies are JSON: send 'Content-Type: application/json'"
                await _refuse(scope, receive, send, 415, message, "unsupported_media_type")
                return
        await self.app(scope, receive, send)


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str) -> None:
    await JSONResponse(ApiError(status, message, None, code).body(), status_code=status)(scope, receive, send)

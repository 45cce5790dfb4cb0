"""Running `quiver serve` in tests: a real server process on 127.0.0.1, reached by the `openai` client and
plain HTTP, every wait bounded."""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from quiver import portable

KEY = "serve-test-key"
# whether a server these tests start runs with glibc's malloc on huge pages (its restart's, or the tests'
# own environment's choice): what the huge-page tests check, where this machine gives them on request
MALLOC_ON_HUGE_PAGES = "glibc.malloc.hugetlb=1" in (portable.huge_page_tunables(os.environ) or "").split(":")


@dataclass
class Running:
    """A server process, its dialog config and its address."""

    config: Path
    url: str
    process: subprocess.Popen[str]

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, timeout=60)


def start_server(config: Path, *options: str, env: Mapping[str, str] | None = None) -> Running:
    """`quiver serve` in its own process (`env`: its environment, else this one's), once it listens."""
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", "0", *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    line = process.stdout.readline()
    if "http://" not in line:
        process.kill()
        raise AssertionError(f"the server did not start: {line}{process.communicate(timeout=30)[1]}")
    url = line.split("http://", 1)[1].split("/v1", 1)[0]
    return Running(config, f"http://{url}", process)


def stop_server(running: Running) -> None:
    running.process.terminate()  # SIGTERM: a clean shutdown
    assert running.process.wait(30) == 0


def http(url: str, method: str = "GET", body: bytes | None = None, key: str | None = KEY) -> tuple[int, Any, Any]:
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, decoded(response.read(), response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.headers, decoded(error.read(), error.headers)


def decoded(data: bytes, headers: Any) -> Any:
    """JSON replies as objects, the plain-text ones (vLLM's adapter routes) as text."""
    return json.loads(data or b"null") if "json" in headers.get("Content-Type", "") else data.decode()


def t2t_greedy(config: Path, prompt: str, *args: str, tokens: int = 8) -> list[int]:
    """The token ids `quiver t2t run --greedy` gives (`args`: e.g. `-l ADAPTER`), its own process."""
    command = [sys.executable, "-m", "quiver", "t2t", "run", "-c", str(config), "-p", prompt, "--greedy", "--json",
               "--max-new-tokens", str(tokens), *args]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout)["new_ids"])


# --- raw sockets: what hostile clients send -------------------------------------------------------------
def address(running: Running) -> tuple[str, int]:
    host, port = running.url.removeprefix("http://").split(":")
    return host, int(port)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def reply_of(sock: socket.socket, limit_s: float = 10.0) -> bytes:
    """What the server sends until it closes the connection (or `limit_s` passes)."""
    sock.settimeout(limit_s)
    data = b""
    try:
        while len(data) < 1 << 20:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def flood_head(running: Running, first: bytes, line: bytes, total: int) -> tuple[bytes, int]:
    """Sends `first`, then `line` over and over up to `total` bytes, until the server stops reading;
    returns its reply and the bytes it took."""
    sent = 0
    with socket.create_connection(address(running), timeout=30) as sock:
        sock.sendall(first)
        chunk = line * max(1, (256 << 10) // len(line))
        deadline = time.monotonic() + 30
        try:
            while sent < total and time.monotonic() < deadline:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return reply_of(sock), sent


def hold_unfinished_heads(server: Running, count: int, header_timeout: float) -> None:
    """Opens `count` connections that never finish their request heads: a key holder is served in < 1 s
    meanwhile, and every held connection ends within the header timeout."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection(address(server), timeout=10)
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: b\r\n")  # and never the end
            held.append(sock)
        start = time.monotonic()
        status, _, body = http(f"{server.url}/v1/models", key=KEY)
        assert status == 200 and body["data"], body
        assert time.monotonic() - start < 1.0
        # every held connection ends within the header timeout (most at once: over the caps, the oldest
        # connections still without a request are closed first)
        waiting = selectors.DefaultSelector()  # epoll: thousands of sockets
        for sock in held:
            waiting.register(sock, selectors.EVENT_READ)
        open_ = len(held)
        deadline = time.monotonic() + header_timeout + 3
        while open_ and time.monotonic() < deadline:
            for key, _ in waiting.select(0.5):
                try:
                    key.fileobj.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    pass
                waiting.unregister(key.fileobj)  # closed (EOF or a 408): nothing more to wait for
                open_ -= 1
        waiting.close()
        assert not open_, f"{open_} of {len(held)} still open after {header_timeout + 3} s"
    finally:
        for sock in held:
            sock.close()
    assert http(f"{server.url}/health", key=None)[0] == 200

"""The target server against hostile clients, and the tuner against a hostile server (all on 127.0.0.1)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from quiver.errors import TargetServerError, TuningError
from quiver.tuning import PerformanceCache, tier_name
from quiver.tuning.client import RemoteProfiler
from quiver.tuning.protocol import CHUNK, MAX_OBJECTS, tensor_key
from quiver.tuning.server import TargetServer
from tests.support.cli import assert_one_line_error
from tests.support.cli import quiver as run_quiver

TOKEN = "hostile-test-token"
BUDGET = 64 << 20


def _frame(message: object) -> bytes:
    data = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(data)) + data


def _hello(token: str = TOKEN) -> bytes:
    return _frame({"op": "hello", "token": token})


def _read_reply(sock: socket.socket) -> Any:
    """The next reply, or None when the server closed the connection."""
    data = b""
    while len(data) < 4:
        chunk = sock.recv(4 - len(data))
        if not chunk:
            return None
        data += chunk
    (length,) = struct.unpack(">I", data)
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            return None
        body += chunk
    return msgpack.unpackb(body)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=15)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _served_within(port: int) -> float:
    start = time.monotonic()
    client = RemoteProfiler(f"127.0.0.1:{port}", token=TOKEN, timeout_s=10)
    assert client.fingerprint()["backend"] == "cpu"
    client.close()
    return time.monotonic() - start


@pytest.fixture
def server() -> Iterator[TargetServer]:
    with TargetServer(
        port=0, token=TOKEN, max_store_bytes=BUDGET, idle_timeout_s=3, auth_timeout_s=2, frame_timeout_s=2
    ).start() as running:
        yield running


def _wait_for(condition: Callable[[], bool], seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# --- before authentication: nothing is spent --------------------------------------------------------------
def test_connections_without_the_token_hold_no_slot_and_a_client_with_it_is_served_at_once(
    server: TargetServer,
) -> None:
    hostile = [_connect(server.port) for _ in range(8)]
    try:
        hostile[0].sendall(_frame(7))  # a MsgPack int, then silence
        hostile[1].sendall(struct.pack(">I", 100))  # a header, no body
        hostile[2].sendall(b"\x00")  # a trickled header
        hostile[3].sendall(_hello("wrong"))
        time.sleep(0.2)
        assert _served_within(server.port) < 1.0
        for sock in hostile:  # every one of them is closed within the hello deadline (2 s)
            sock.settimeout(5)
            assert _closed_by_server(sock)
    finally:
        for sock in hostile:
            sock.close()
    assert _served_within(server.port) < 1.0


@pytest.mark.parametrize(
    "payload, kind",
    [
        (_frame(7), "unauthorized"),
        (_frame({"op": "missing", "keys": []}), "unauthorized"),
        (_frame({"op": "hello"}), "unauthorized"),
        (struct.pack(">I", 70_000), "too-large"),  # larger than any hello
    ],
)
def test_anything_but_a_hello_with_the_token_first_is_answered_and_closed(
    server: TargetServer, payload: bytes, kind: str
) -> None:
    with _connect(server.port) as sock:
        sock.sendall(payload)
        reply = _read_reply(sock)
        assert reply is not None and reply["error"] == kind, reply
        assert _closed_by_server(sock)


def test_a_header_trickled_in_after_the_hello_is_dropped_at_the_frame_deadline(server: TargetServer) -> None:
    with _connect(server.port) as sock:
        sock.sendall(_hello())
        assert _read_reply(sock)["ok"]
        start = time.monotonic()
        try:
            for byte in struct.pack(">I", 10):
                sock.sendall(bytes([byte]))
                time.sleep(1.0)  # never idle for the idle timeout (3 s), never whole before the frame one (2 s)
            sock.sendall(b"\x00" * 10)
        except OSError:
            pass
        assert _closed_by_server(sock)
        assert time.monotonic() - start < 4.5


def test_more_clients_than_slots_are_told_busy_after_their_hello(server: TargetServer) -> None:
    held = []
    try:
        for _ in range(server.max_clients):
            sock = _connect(server.port)
            sock.sendall(_hello())
            assert _read_reply(sock)["ok"]
            held.append(sock)
        with _connect(server.port) as extra:
            extra.sendall(_hello())
            assert _read_reply(extra)["error"] == "busy"
    finally:
        for sock in held:
            sock.close()
    assert _wait_for(lambda: _try_served(server.port))


def _try_served(port: int) -> bool:
    try:
        _served_within(port)
        return True
    except TargetServerError:
        return False


# --- after authentication: one memory budget, bounded work --------------------------------------------------
def _call(sock: socket.socket, message: object) -> Any:
    sock.sendall(_frame(message))
    return _read_reply(sock)


def _big_key(nbytes: int) -> str:
    return f"uint8/{nbytes}/{'ab' * 32}"


def test_an_upload_is_charged_before_it_is_allocated_and_given_back_when_its_connection_ends(
    server: TargetServer,
) -> None:
    size = CHUNK + (8 << 20)  # 24 MB of a 64 MB budget; a 16 MB chunk takes 32 MB more while it is decoded
    with _connect(server.port) as first, _connect(server.port) as second:
        for sock in (first, second):
            sock.sendall(_hello())
            assert _read_reply(sock)["ok"]
        chunk = {"op": "put", "key": _big_key(size), "offset": 0, "data": b"\0" * CHUNK}
        assert _call(first, chunk) == {"ok": True, "complete": False}
        assert server.tensors.used == size
        refused = _call(second, chunk)  # a second one does not fit: refused, nothing allocated
        assert refused["error"] == "too-large" and "memory budget" in refused["message"]
        short = _call(second, {"op": "put", "key": _big_key(size), "offset": 0, "data": b"\0" * 112})
        assert short["error"] == "bad-request"  # a chunk of the wrong length is refused before anything
    assert _wait_for(lambda: server.tensors.used == 0)


def test_input_sets_naming_one_stored_tensor_many_times_are_charged_for_every_copy(server: TargetServer) -> None:
    array = np.zeros(4 << 20, np.uint8)
    key = tensor_key(array)
    with _connect(server.port) as sock:
        sock.sendall(_hello())
        assert _read_reply(sock)["ok"]
        assert _call(sock, {"op": "put", "key": key, "offset": 0, "data": array.tobytes()})["complete"]
        sets = [{"feeds": {f"x{i}": key for i in range(40)}, "bound": {}}]  # 160 MB of copies from 4 KB
        reply = _call(sock, {"op": "inputs", "sets": sets})
        assert reply["error"] == "too-large"
        assert server.tensors.used == array.nbytes
        reply = _call(sock, {"op": "inputs", "sets": [{"feeds": {"x": key}, "bound": {"b": key}}]})
        assert reply["ok"]
        assert server.tensors.used == 2 * array.nbytes
    assert _wait_for(lambda: server.tensors.used == array.nbytes)  # the stored tensor stays, its copy went


def test_a_frame_of_too_many_values_is_refused_before_it_is_decoded(server: TargetServer) -> None:
    with _connect(server.port) as sock:
        sock.sendall(_hello())
        assert _read_reply(sock)["ok"]
        flood = {"op": "missing", "keys": [{}] * (MAX_OBJECTS + 1)}  # 1 byte each on the wire, 64 decoded
        reply = _call(sock, flood)
        assert reply["error"] == "too-large" and str(MAX_OBJECTS) in reply["message"]


def test_a_server_beyond_loopback_needs_a_token() -> None:
    with pytest.raises(TuningError, match="needs a token"):
        TargetServer(host="0.0.0.0", port=0)
    result = run_quiver("target-server", "--host", "0.0.0.0", "--port", "0")
    assert_one_line_error(result, "needs a token")


# --- 1,000 hostile requests from 50 clients at once, against a server in its own process ------------------------
def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _hostile_request(port: int, kind: int) -> None:
    try:
        with _connect(port) as sock:
            sock.settimeout(10)
            if kind == 0:  # no token
                sock.sendall(_hello("nope"))
                _read_reply(sock)
            elif kind == 1:  # an oversized frame before the hello
                sock.sendall(struct.pack(">I", 0x7FFFFFFF))
                _read_reply(sock)
            elif kind == 2:  # a trickle, abandoned
                sock.sendall(b"\x00\x00")
            else:  # with the token: an upload begun and abandoned, then copies beyond the budget
                sock.sendall(_hello())
                _read_reply(sock)
                _call(sock, {"op": "put", "key": _big_key(2 * CHUNK), "offset": 0, "data": b"\1" * CHUNK})
                _call(sock, {"op": "inputs", "sets": [{"feeds": {"x": _big_key(2 * CHUNK)}, "bound": {}}]})
    except OSError:
        pass  # refused or closed by the server: what a hostile client gets


def _hostile_load(port: int, count: int, clients: int) -> None:
    """`count` hostile requests from `clients` threads: 3 in 8 without the token, 5 in 8 with it (uploads)."""
    requests = iter([i % 8 for i in range(count)])
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                kind = next(requests, None)
            if kind is None:
                return
            _hostile_request(port, min(kind, 3))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's RSS from /proc")
def test_a_thousand_hostile_requests_from_fifty_clients_stay_within_the_budget() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "QUIVER_TARGET_TOKEN": TOKEN}
    command = [sys.executable, "-m", "quiver", "target-server", "--port", str(port), "--max-store-mb", "64",
               "--max-clients", "64", "--auth-timeout-s", "2"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    done = threading.Event()
    try:
        assert process.stdout is not None and str(port) in process.stdout.readline()
        assert _served_within(port) < 1.0
        baseline = _rss_mb(process.pid)
        peak = [baseline]

        def sample() -> None:
            while not done.wait(0.02):
                peak[0] = max(peak[0], _rss_mb(process.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        # the 50 clients run in a process of their own: here they would hold the GIL the measured client needs
        load = multiprocessing.get_context("spawn").Process(target=_hostile_load, args=(port, 1000, 50))
        load.start()
        served_meanwhile = []  # a client with the token, again and again while the load lasts
        deadline = time.monotonic() + 300
        while load.is_alive() and time.monotonic() < deadline:
            served_meanwhile.append(_served_within(port))
            time.sleep(0.2)
        load.join(10)
        done.set()
        sampler.join()
        assert load.exitcode == 0 and len(served_meanwhile) >= 3
        assert max(served_meanwhile) < 1.0, served_meanwhile
        assert peak[0] <= baseline + 64 + 100, (baseline, peak[0])
        assert _wait_for(lambda: _rss_mb(process.pid) <= baseline + 20, 15), (baseline, _rss_mb(process.pid))
        assert _served_within(port) < 1.0
    finally:
        done.set()
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


# --- the tuner against a hostile server ----------------------------------------------------------------------
class _FakeServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    hello: dict[str, Any]


class _AnswersHello(socketserver.BaseRequestHandler):
    server: _FakeServer

    def handle(self) -> None:
        if _read_reply(self.request) is not None:
            self.request.sendall(_frame(self.server.hello))


@pytest.mark.parametrize(
    "hello, fragment",
    [
        ({"ok": True, "protocol": 1, "fingerprint": ["cpu"], "knob_space_version": 1}, "not a map"),
        ({"ok": True, "protocol": 1, "fingerprint": {"cpu": {"a": 1}}, "knob_space_version": 1}, "fingerprint field"),
        ({"ok": True, "protocol": 1, "fingerprint": {"cpu": "x"}, "knob_space_version": "1"}, "knob_space_version"),
        ({"ok": True, "protocol": "x" * 10_000}, "speaks protocol"),
    ],
)
def test_a_hostile_hello_is_a_target_server_error(hello: dict[str, Any], fragment: str) -> None:
    with _FakeServer(("127.0.0.1", 0), _AnswersHello) as fake:
        fake.hello = hello
        threading.Thread(target=fake.serve_forever, daemon=True).start()
        try:
            with pytest.raises(TargetServerError, match=fragment) as raised:
                RemoteProfiler(f"127.0.0.1:{fake.server_address[1]}", timeout_s=5)
            assert len(str(raised.value)) < 400
        finally:
            fake.shutdown()


def test_a_fingerprint_cannot_place_the_cache_file_outside_its_folder(tmp_path: Path) -> None:
    fingerprint = {"backend": "../../x", "cpu": "/etc/passwd", "cores": "../../../tmp/evil"}
    name = tier_name(fingerprint)
    assert "/" not in name and ".." not in name
    cache = PerformanceCache(tmp_path / "perf", fingerprint)
    cache.store("k", {"config": {}})
    assert sorted(p.name for p in (tmp_path / "perf").iterdir()) == [f"{name}.json", f"{name}.lock"]

"""`quiver target-server`: builds and measures graph variants for a remote tuner (qnn-gpu-target-server's role).

The server only prepares, profiles, executes and releases; the client searches and writes the cache and
the context. It keeps received tensors (by content key) across connections, so a second tuning of the
same model sends no weights. Every request is checked before it is used; a bad one gets a typed error,
a bad frame closes its connection, and the server goes on serving others.

What a client can spend is bounded before it is spent (the threat model is in the README):
* nothing before it authenticates: its first frame, within `auth_timeout_s` and 64 KiB, must be a hello
  with the token; anything else closes the connection, and at most `max_greeters` connections may be
  that far at once. A client slot (`max_clients`) is taken only after the hello;
* every frame, its header included, must be whole within `frame_timeout_s` (+1 s per MB) of its first
  byte, and decode to at most `MAX_OBJECTS` values;
* memory: stored tensors, unfinished uploads and the private copies of input sets share one budget
  (`max_store_bytes`), charged before a byte is allocated and given back when the connection ends;
  tensors in use by a connection's graphs or input sets are never dropped from the store to make room;
* work: graphs, input sets and variants per connection, runs per request, outputs per message.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import socketserver
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from quiver import portable
from quiver.backends.base import Backend, FinalizedGraph
from quiver.errors import BackendError, QuiverError, TuningError
from quiver.tuning.profiler import FeedSet, LocalProfiler
from quiver.tuning.protocol import (
    CHUNK,
    MAX_MESSAGE,
    PROTOCOL,
    ConnectionClosed,
    ProtocolError,
    field,
    nbytes_of,
    parse_key,
    read_frame,
    write_frame,
)

_MAX_KEYS = 100_000
_MAX_RUNS = 1000
_MAX_GRAPHS = 16  # per connection, each holding its weights in the store
_MAX_INPUT_SETS = 64  # input handles per connection
_MAX_VARIANTS = 64  # prepared variants alive per connection (each one ORT session)
_HELLO_LIMIT = 64 * 1024  # the largest frame a connection may send before it has authenticated


class TensorStore:
    """Received tensors by content key, and the one memory budget (`quota` bytes) they share with unfinished
    uploads and input copies. To make room, the least recently used tensors no connection uses are dropped."""

    def __init__(self, quota: int) -> None:
        self.quota = quota
        self._tensors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._pins: Counter[str] = Counter()  # tensors graphs and input sets use: never dropped
        self._used = 0  # stored tensors + charges
        self.lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def get(self, key: str) -> np.ndarray | None:
        with self.lock:
            array = self._tensors.get(key)
            if array is not None:
                self._tensors.move_to_end(key)
            return array

    def charge(self, nbytes: int, what: str) -> None:
        """Reserves `nbytes` of the budget (dropping unused tensors to make room), or raises `too-large`."""
        with self.lock:
            if self._used + nbytes <= self.quota:  # every frame is charged: the common case costs no scan
                self._used += nbytes
                return
            unused = [k for k in self._tensors if not self._pins[k]]  # least recently used first
            if self._used - sum(self._tensors[k].nbytes for k in unused) + nbytes > self.quota:
                raise ProtocolError(
                    "too-large",
                    f"{what} ({nbytes} bytes) does not fit the server's memory budget ({self.quota} bytes, "
                    f"{self.quota - self._used} free); try again when other clients are done",
                )
            for key in unused:
                if self._used + nbytes <= self.quota:
                    break
                self._used -= self._tensors.pop(key).nbytes
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        with self.lock:
            self._used -= nbytes

    def add(self, key: str, array: np.ndarray) -> None:
        """Keeps an uploaded tensor, whose bytes its upload charged: the charge becomes the tensor's."""
        with self.lock:
            if key in self._tensors:
                self._used -= array.nbytes  # another connection sent it meanwhile: one copy is enough
                return
            self._tensors[key] = array

    def pin(self, keys: list[str]) -> None:
        with self.lock:
            self._pins.update(keys)

    def unpin(self, keys: list[str]) -> None:
        with self.lock:
            self._pins.subtract(keys)
            for key in keys:
                if self._pins[key] <= 0:
                    del self._pins[key]


class _Upload:
    """A tensor arriving in chunks; its bytes are charged to the budget before this is made."""

    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(nbytes)
        self.received = bytearray((nbytes + CHUNK - 1) // CHUNK)  # chunks in, by index


class _Session:
    """One authenticated connection's state: its graphs, input sets and variants, its uploads, and what
    it holds of the budget (given back by `close`). Handlers are looked up by name, not held as bound
    methods, so that nothing refers back to the session and it is freed as soon as the connection ends."""

    _OPS = ("missing", "put", "load_graph", "inputs", "prepare", "time", "outputs", "release")

    def __init__(self, server: TargetServer) -> None:
        self.server = server
        self.profiler = LocalProfiler(server.backend)
        self.uploads: dict[str, _Upload] = {}
        self.pinned: list[str] = []  # store keys this connection's graphs and input sets use
        self.charged = 0  # bytes of the budget its input copies hold

    def dispatch(self, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise ProtocolError("bad-request", "a request is a map with an 'op'")
        op = field(message, "op", str)
        if op == "hello":
            return self.server.greeting()
        if op not in self._OPS:
            raise ProtocolError("bad-request", f"unknown op {op[:40]!r}; ops: hello, {', '.join(self._OPS)}, bye")
        result: dict[str, Any] = getattr(self, op)(message)
        return result

    def missing(self, message: dict[str, Any]) -> dict[str, Any]:
        keys = field(message, "keys", list)
        if len(keys) > _MAX_KEYS:
            raise ProtocolError("too-large", f"at most {_MAX_KEYS} keys per request")
        for key in keys:
            parse_key(key)
        return {"missing": [k for k in keys if self.server.tensors.get(k) is None]}

    def put(self, message: dict[str, Any]) -> dict[str, Any]:
        key, offset, data = field(message, "key", str), field(message, "offset", int), field(message, "data", bytes)
        dtype, shape, sha = parse_key(key)
        nbytes = nbytes_of(dtype, shape)
        if nbytes > self.server.tensors.quota:
            raise ProtocolError("too-large", f"a tensor of {nbytes} bytes exceeds the server's memory budget")
        upload = self.uploads.get(key)
        if offset < 0 or offset % CHUNK or offset + len(data) > nbytes or len(data) != min(CHUNK, nbytes - offset):
            raise ProtocolError("bad-request", f"a chunk of {key[:40]} covers [offset, offset + {CHUNK}) of the tensor")
        if upload is None:
            if self.server.tensors.get(key) is not None:
                return {"complete": True}  # another connection sent it meanwhile
            self.server.tensors.charge(nbytes, f"a tensor of {dtype.name}{list(shape)}")  # before allocating
            upload = self.uploads[key] = _Upload(nbytes)
        upload.data[offset : offset + len(data)] = data
        if nbytes:
            upload.received[offset // CHUNK] = 1
        if not all(upload.received):
            return {"complete": False}
        del self.uploads[key]
        if hashlib.sha256(upload.data).hexdigest() != sha:
            self.server.tensors.release(nbytes)
            raise ProtocolError("checksum", f"the bytes sent for {key[:40]}... do not match its checksum")
        array = np.frombuffer(upload.data, dtype).reshape(shape)
        array.flags.writeable = False
        self.server.tensors.add(key, array)
        return {"complete": True}

    def _tensor(self, key: Any) -> np.ndarray:
        parse_key(key)
        array = self.server.tensors.get(key)
        if array is None:
            raise ProtocolError("unknown-handle", f"no tensor {str(key)[:48]}...; send it first")
        return array

    def load_graph(self, message: dict[str, Any]) -> dict[str, Any]:
        from quiver.ir.proto import ModelProto
        from quiver.ir.tensors import TensorType, info_of_value

        name, skeleton = field(message, "name", str), field(message, "model", bytes)
        weights = field(message, "weights", dict)
        if len(self.profiler.graphs) >= _MAX_GRAPHS:
            raise ProtocolError("too-large", f"at most {_MAX_GRAPHS} graphs per connection; connect again")
        model = ModelProto()
        try:
            model.ParseFromString(skeleton)
            inputs = tuple(info_of_value(v, TensorType.APP_WRITE) for v in model.graph.input)
            outputs = tuple(info_of_value(v, TensorType.APP_READ) for v in model.graph.output)
        except Exception as exc:  # protobuf's DecodeError, a type Quiver does not know
            raise ProtocolError("bad-request", f"'model' is not an ONNX graph Quiver can describe ({exc})") from None
        arrays = {str(n): self._tensor(k) for n, k in weights.items()}
        self._pin(list(weights.values()))
        graph = FinalizedGraph(name, model, arrays, inputs, outputs)
        with self.server.measuring:
            handle, knobs = self.profiler.load(graph)
        described = [{"name": k.name, "values": list(k.values), "help": k.help, "exact": k.exact} for k in knobs]
        return {"graph": handle, "knobs": described}

    def inputs(self, message: dict[str, Any]) -> dict[str, Any]:
        sets = field(message, "sets", list)
        if len(self.profiler.inputs) >= _MAX_INPUT_SETS:
            raise ProtocolError("too-large", f"at most {_MAX_INPUT_SETS} input handles per connection")
        for item in sets:
            if not isinstance(item, dict) or not all(isinstance(item.get(k), dict) for k in ("feeds", "bound")):
                raise ProtocolError("bad-request", "an input set is a map with 'feeds' and 'bound' maps of tensor keys")
        # private, writable copies of the feeds (a run may write into its inputs: a KV cache), charged first:
        # a small request may name one large stored tensor many times
        arrays = {k: self._tensor(k) for item in sets for part in ("feeds", "bound") for k in item[part].values()}
        copies = sum(arrays[k].nbytes for item in sets for k in item["feeds"].values())
        self.server.tensors.pin(list(arrays))  # not dropped to make room for their own copies
        try:
            self.server.tensors.charge(copies, f"the copies of {len(sets)} input sets")
        finally:
            self.server.tensors.unpin(list(arrays))
        self.charged += copies
        feed_sets = []
        for item in sets:
            feeds = {str(n): np.array(arrays[k]) for n, k in item["feeds"].items()}
            feed_sets.append(FeedSet(feeds, {str(n): arrays[k] for n, k in item["bound"].items()}))
            self._pin(list(item["bound"].values()))
        return {"inputs": self.profiler.upload(feed_sets)}

    def _pin(self, keys: list[str]) -> None:
        self.server.tensors.pin(keys)
        self.pinned.extend(keys)

    def prepare(self, message: dict[str, Any]) -> dict[str, Any]:
        graph, config = field(message, "graph", str), field(message, "config", dict)
        if not all(isinstance(v, (bool, int, str)) for v in config.values()):
            raise ProtocolError("bad-request", "a configuration maps knob names to booleans, integers or strings")
        if len(self.profiler.variants) >= _MAX_VARIANTS:
            raise ProtocolError("too-large", f"at most {_MAX_VARIANTS} variants per connection; release some first")
        with self.server.measuring:
            return {"variant": self.profiler.prepare(graph, config)}

    def time(self, message: dict[str, Any]) -> dict[str, Any]:
        variant, inputs = field(message, "variant", str), field(message, "inputs", str)
        index, runs = field(message, "index", int), field(message, "runs", int)
        if not 1 <= runs <= _MAX_RUNS:
            raise ProtocolError("bad-request", f"runs must be 1 to {_MAX_RUNS}")
        with self.server.measuring:
            return {"times": self.profiler.time(variant, inputs, index, runs)}

    def outputs(self, message: dict[str, Any]) -> dict[str, Any]:
        variant, inputs = field(message, "variant", str), field(message, "inputs", str)
        with self.server.measuring:
            results = self.profiler.outputs(variant, inputs)
        size = sum(a.nbytes for r in results for a in r.values())
        if size > self.server.max_message - 65536:
            raise ProtocolError("too-large", f"the outputs ({size} bytes) exceed a message")
        encoded = [
            {n: {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()} for n, a in r.items()}
            for r in results
        ]
        return {"outputs": encoded}

    def release(self, message: dict[str, Any]) -> dict[str, Any]:
        with self.server.measuring:
            self.profiler.release(field(message, "variant", str))
        return {}

    def close(self) -> None:
        """Gives back everything the connection held: variants, graphs, input copies, uploads, pins."""
        with self.server.measuring:
            self.profiler.close()
        store = self.server.tensors
        store.release(self.charged + sum(len(u.data) for u in self.uploads.values()))
        store.unpin(self.pinned)
        self.uploads.clear()
        self.pinned.clear()
        self.charged = 0


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        target = self.server.target
        sock = self.request
        if not target.greeters.acquire(blocking=False):
            return  # as many connections as may be are still to say hello: this one is closed at once
        try:
            greeted = _authenticate(sock, target)
        finally:
            target.greeters.release()
        if not greeted:
            return
        if not target.slots.acquire(blocking=False):
            _reply(sock, _error(ProtocolError("busy", f"serving {target.max_clients} clients already")))
            return
        session = _Session(target)
        try:
            if _reply(sock, {"ok": True, **target.greeting()}):
                _serve(sock, target, session)
        finally:
            session.close()
            target.slots.release()


def _authenticate(sock: Any, target: TargetServer) -> bool:
    """Whether the connection's first frame, whole within the deadline, is a hello with the token; it is
    answered (with the reason) and closed otherwise. Nothing else is read or kept before this."""
    sock.settimeout(target.auth_timeout_s)
    try:
        message = read_frame(sock, _HELLO_LIMIT, deadline=time.monotonic() + target.auth_timeout_s)
    except ConnectionClosed:
        return False
    except ProtocolError as exc:
        _reply(sock, _error(exc))
        return False
    if not isinstance(message, dict) or message.get("op") != "hello":
        _reply(sock, _error(ProtocolError("unauthorized", "the first message must be a hello (with the token)")))
        return False
    token = message.get("token")
    if target.token is not None and (
        not isinstance(token, str) or not hmac.compare_digest(token.encode(), target.token.encode())
    ):
        _reply(sock, _error(ProtocolError("unauthorized", "wrong or missing token")))
        return False
    return True


def _serve(sock: Any, target: TargetServer, session: _Session) -> None:
    """An authenticated connection's requests, one frame at a time, until bye, a bad frame or silence.
    Each frame is charged to the memory budget (twice its length: the frame, and the bytes decoded from
    it) before it is read, and given back once it is answered."""
    sock.settimeout(target.idle_timeout_s)
    held = [0]

    def reserve(length: int) -> None:
        target.tensors.charge(2 * length, f"a message of {length} bytes")
        held[0] = 2 * length

    while True:
        try:
            reply = _answer(sock, target, session, reserve)
        finally:
            target.tensors.release(held[0])
            held[0] = 0
        if reply is None:
            return
        closing = reply.pop("closing", False)
        if not _reply(sock, reply) or closing:
            return


def _answer(
    sock: Any, target: TargetServer, session: _Session, reserve: Callable[[int], None]
) -> dict[str, Any] | None:
    """The reply to the connection's next frame (`closing` set when the connection ends after it), or None
    when the connection ended without one."""
    try:
        message = read_frame(sock, target.max_message, target.frame_timeout_s, reserve=reserve)
    except ConnectionClosed:
        return None
    except ProtocolError as exc:  # the stream can no longer be followed: say why, then close
        return {**_error(exc), "closing": True}
    if isinstance(message, dict) and message.get("op") == "bye":
        return {"ok": True, "closing": True}
    try:
        return {"ok": True, **session.dispatch(message)}
    except ProtocolError as exc:
        return _error(exc)
    except BackendError as exc:
        return _error(ProtocolError("backend", str(exc)))
    except TuningError as exc:  # a handle this connection never made
        return _error(ProtocolError("unknown-handle", str(exc)))
    except (QuiverError, Exception) as exc:  # noqa: BLE001  the server keeps serving
        return _error(ProtocolError("internal", f"{type(exc).__name__}: {exc}"))


def _error(exc: ProtocolError) -> dict[str, Any]:
    return {"ok": False, "error": exc.kind, "message": str(exc)[:4096]}


def _reply(sock: Any, message: dict[str, Any]) -> bool:
    try:
        write_frame(sock, message)
        return True
    except OSError:
        return False


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: under a flood of connections the kernel then drops new SYNs,
    # and a client with the token waits for its SYN to be sent again, a second later
    request_queue_size = 1024
    target: TargetServer


def return_large_blocks_to_the_system() -> None:
    """Makes this process's allocator map every block of 256 KiB or more on its own and unmap it when freed
    (glibc only; elsewhere nothing changes). By default glibc raises that threshold to the largest block
    freed so far, after which 16 MB frames come from per-thread arenas that keep their pages: a server of
    many connection threads then holds several times its budget long after the frames are gone. For
    processes that exist to serve (the CLI calls it); a library does not change its host's allocator."""
    portable.map_large_blocks_alone(256 * 1024)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface only (a name is resolved as `bind` would)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses)


class TargetServer:
    """A target server on `host:port` (port 0: any free port, see `.port`). Beyond loopback it needs a token.

    `max_store_bytes`: the memory budget of everything kept for clients; `auth_timeout_s`: how long a new
    connection has to say hello; `idle_timeout_s`: silence allowed between frames; `frame_timeout_s`: how
    long a frame may take once begun (+1 s per MB); `max_clients`: authenticated connections at once;
    `max_greeters`: connections not yet authenticated at once (more are closed at once)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 22598,
        token: str | None = None,
        backend: Backend | None = None,
        max_store_bytes: int = 8 << 30,
        max_message: int = MAX_MESSAGE,
        idle_timeout_s: float = 120.0,
        max_clients: int = 16,
        auth_timeout_s: float = 10.0,
        frame_timeout_s: float = 30.0,
        max_greeters: int = 64,
    ) -> None:
        self.token = token or None
        if self.token is None and not is_loopback(host):
            raise TuningError(
                f"a target server on {host} (beyond loopback) needs a token: pass --token or set "
                "QUIVER_TARGET_TOKEN, or listen on 127.0.0.1"
            )
        if backend is None:
            from quiver.backends.cpu import CpuBackend

            backend = CpuBackend(lazy_prepack=False)
        self.backend = backend
        self.tensors = TensorStore(max_store_bytes)
        self.max_message = max_message
        self.idle_timeout_s = idle_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.max_clients = max_clients
        self.slots = threading.Semaphore(max_clients)
        self.greeters = threading.Semaphore(max_greeters)
        self.measuring = threading.Lock()  # one client measures at a time: timings must not overlap
        profiler = LocalProfiler(backend)
        self._greeting = {
            "protocol": PROTOCOL,
            "fingerprint": profiler.fingerprint(),
            "knob_space_version": profiler.knob_space_version(),
            "max_message": max_message,
            "chunk": CHUNK,
        }
        try:
            self._server = _TCPServer((host, port), _Handler)
        except OSError as exc:
            raise TuningError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        self._server.target = self
        address = self._server.server_address
        self.host, self.port = str(address[0]), int(address[1])
        self._thread: threading.Thread | None = None

    def greeting(self) -> dict[str, Any]:
        """The reply to a hello: protocol, device fingerprint, knob space and limits."""
        return dict(self._greeting)

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def start(self) -> TargetServer:
        """Serves from a background thread (tests, notebooks)."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="quiver-target-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops serving. `shutdown()` only for the background thread of `start()`: after `serve_forever()`
        in the caller's thread has ended (Ctrl-C), it could wait forever had the interrupt landed before
        socketserver marked the loop as ended."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> TargetServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

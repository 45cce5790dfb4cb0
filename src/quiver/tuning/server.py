"""`quiver target-server`: builds and measures graph variants for a remote tuner (qnn-gpu-target-server's role).

The server only prepares, profiles, executes and releases; the client searches and writes the cache and
the context. It keeps received tensors (by content key, within a byte quota) across connections, so a
second tuning of the same model sends no weights. Every request is checked before it is used; a bad
one gets a typed error, a bad frame closes its connection, and the server goes on serving others.
"""

from __future__ import annotations

import hashlib
import hmac
import socketserver
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

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


class TensorStore:
    """Received tensors by content key, least recently used dropped first beyond `quota` bytes."""

    def __init__(self, quota: int) -> None:
        self.quota = quota
        self._tensors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> np.ndarray | None:
        with self.lock:
            array = self._tensors.get(key)
            if array is not None:
                self._tensors.move_to_end(key)
            return array

    def add(self, key: str, array: np.ndarray) -> None:
        with self.lock:
            if key in self._tensors:
                return
            while self._tensors and self._bytes + array.nbytes > self.quota:
                self._bytes -= self._tensors.popitem(last=False)[1].nbytes  # live graphs keep their arrays
            self._tensors[key] = array
            self._bytes += array.nbytes


class _Upload:
    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(nbytes)
        self.received = bytearray((nbytes + CHUNK - 1) // CHUNK)  # chunks in, by index


class _Session:
    """One connection's state: whether it said hello, its graphs, input sets and variants."""

    def __init__(self, server: TargetServer) -> None:
        self.server = server
        self.authorized = server.token is None
        self.profiler = LocalProfiler(server.backend)
        self.uploads: dict[str, _Upload] = {}
        self.ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "missing": self.missing,
            "put": self.put,
            "load_graph": self.load_graph,
            "inputs": self.inputs,
            "prepare": self.prepare,
            "time": self.time,
            "outputs": self.outputs,
            "release": self.release,
        }

    def dispatch(self, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise ProtocolError("bad-request", "a request is a map with an 'op'")
        op = field(message, "op", str)
        if op == "hello":
            return self.hello(message)
        if not self.authorized:
            raise ProtocolError("unauthorized", "say hello with the server's token first")
        handler = self.ops.get(op)
        if handler is None:
            raise ProtocolError("bad-request", f"unknown op {op[:40]!r}; ops: hello, {', '.join(self.ops)}, bye")
        return handler(message)

    def hello(self, message: dict[str, Any]) -> dict[str, Any]:
        token = message.get("token")
        if self.server.token is not None:
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.server.token.encode()):
                raise ProtocolError("unauthorized", "wrong or missing token")
        self.authorized = True
        return {
            "protocol": PROTOCOL,
            "fingerprint": self.profiler.fingerprint(),
            "knob_space_version": self.profiler.knob_space_version(),
            "max_message": self.server.max_message,
            "chunk": CHUNK,
        }

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
            quota = self.server.tensors.quota
            raise ProtocolError("too-large", f"a tensor of {nbytes} bytes exceeds the store's {quota}")
        upload = self.uploads.get(key)
        if upload is None:
            pending = sum(len(u.data) for u in self.uploads.values())
            if pending + nbytes > self.server.tensors.quota:
                raise ProtocolError("too-large", "unfinished uploads exceed the store's quota")
            upload = self.uploads[key] = _Upload(nbytes)
        if offset < 0 or offset % CHUNK or offset + len(data) > nbytes or len(data) != min(CHUNK, nbytes - offset):
            raise ProtocolError("bad-request", f"a chunk of {key[:40]} covers [offset, offset + {CHUNK}) of the tensor")
        upload.data[offset : offset + len(data)] = data
        if nbytes:
            upload.received[offset // CHUNK] = 1
        if all(upload.received):
            del self.uploads[key]
            if hashlib.sha256(upload.data).hexdigest() != sha:
                raise ProtocolError("checksum", f"the bytes sent for {key[:40]}... do not match its checksum")
            array = np.frombuffer(upload.data, dtype).reshape(shape)
            array.flags.writeable = False
            self.server.tensors.add(key, array)
            return {"complete": True}
        return {"complete": False}

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
        model = ModelProto()
        try:
            model.ParseFromString(skeleton)
            inputs = tuple(info_of_value(v, TensorType.APP_WRITE) for v in model.graph.input)
            outputs = tuple(info_of_value(v, TensorType.APP_READ) for v in model.graph.output)
        except Exception as exc:  # protobuf's DecodeError, a type Quiver does not know
            raise ProtocolError("bad-request", f"'model' is not an ONNX graph Quiver can describe ({exc})") from None
        arrays = {str(n): self._tensor(k) for n, k in weights.items()}
        graph = FinalizedGraph(name, model, arrays, inputs, outputs)
        with self.server.measuring:
            handle, knobs = self.profiler.load(graph)
        described = [{"name": k.name, "values": list(k.values), "help": k.help, "exact": k.exact} for k in knobs]
        return {"graph": handle, "knobs": described}

    def inputs(self, message: dict[str, Any]) -> dict[str, Any]:
        sets = field(message, "sets", list)
        feed_sets = []
        for item in sets:
            if not isinstance(item, dict) or not all(isinstance(item.get(k), dict) for k in ("feeds", "bound")):
                raise ProtocolError("bad-request", "an input set is a map with 'feeds' and 'bound' maps of tensor keys")
            # private, writable copies: a run may write into its inputs (a KV cache)
            feeds = {str(n): np.array(self._tensor(k)) for n, k in item["feeds"].items()}
            feed_sets.append(FeedSet(feeds, {str(n): self._tensor(k) for n, k in item["bound"].items()}))
        return {"inputs": self.profiler.upload(feed_sets)}

    def prepare(self, message: dict[str, Any]) -> dict[str, Any]:
        graph, config = field(message, "graph", str), field(message, "config", dict)
        if not all(isinstance(v, (bool, int, str)) for v in config.values()):
            raise ProtocolError("bad-request", "a configuration maps knob names to booleans, integers or strings")
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
        with self.server.measuring:
            self.profiler.close()


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        target = self.server.target
        sock = self.request
        sock.settimeout(target.idle_timeout_s)
        if not target.slots.acquire(blocking=False):
            _reply(sock, _error(ProtocolError("busy", f"serving {target.max_clients} clients already")))
            return
        session = _Session(target)
        try:
            while True:
                try:
                    message = read_frame(sock, target.max_message, target.idle_timeout_s)
                except ConnectionClosed:
                    return
                except ProtocolError as exc:  # the stream can no longer be followed: say why, then close
                    _reply(sock, _error(exc))
                    return
                if isinstance(message, dict) and message.get("op") == "bye":
                    _reply(sock, {"ok": True})
                    return
                try:
                    reply = {"ok": True, **session.dispatch(message)}
                except ProtocolError as exc:
                    reply = _error(exc)
                except BackendError as exc:
                    reply = _error(ProtocolError("backend", str(exc)))
                except TuningError as exc:  # a handle this connection never made
                    reply = _error(ProtocolError("unknown-handle", str(exc)))
                except (QuiverError, Exception) as exc:  # noqa: BLE001  the server keeps serving
                    reply = _error(ProtocolError("internal", f"{type(exc).__name__}: {exc}"))
                if not _reply(sock, reply) or reply.get("error") == "unauthorized":
                    return
        finally:
            session.close()
            target.slots.release()


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
    target: TargetServer


class TargetServer:
    """A target server on `host:port` (port 0: any free port, see `.port`)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 22598,
        token: str | None = None,
        backend: Backend | None = None,
        max_store_bytes: int = 8 << 30,
        max_message: int = MAX_MESSAGE,
        idle_timeout_s: float = 120.0,
        max_clients: int = 4,
    ) -> None:
        if backend is None:
            from quiver.backends.cpu import CpuBackend

            backend = CpuBackend(lazy_prepack=False)
        self.backend = backend
        self.token = token or None
        self.tensors = TensorStore(max_store_bytes)
        self.max_message = max_message
        self.idle_timeout_s = idle_timeout_s
        self.max_clients = max_clients
        self.slots = threading.Semaphore(max_clients)
        self.measuring = threading.Lock()  # one client measures at a time: timings must not overlap
        try:
            self._server = _TCPServer((host, port), _Handler)
        except OSError as exc:
            raise TuningError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        self._server.target = self
        address = self._server.server_address
        self.host, self.port = str(address[0]), int(address[1])
        self._thread: threading.Thread | None = None

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

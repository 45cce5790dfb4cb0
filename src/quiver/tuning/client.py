"""The tuner's side of a target server: a `Profiler` whose variants are prepared and measured remotely."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from quiver.backends.base import FinalizedGraph, Knob, KnobValue
from quiver.errors import BackendError, TargetServerError
from quiver.tuning.profiler import FeedSet
from quiver.tuning.protocol import (
    CHUNK,
    DEFAULT_PORT,
    PROTOCOL,
    ConnectionClosed,
    ProtocolError,
    read_frame,
    tensor_key,
    write_frame,
)

ENVIRONMENT = "TARGET_SERVER_SOCKET"  # host:port, as QNN's tools read it


def parse_target(text: str) -> tuple[str, int]:
    """`host:port` (or `host`, port 22598); `[v6]:port` for IPv6."""
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port:
        host, port = text, str(DEFAULT_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TargetServerError(f"{text!r} is not a target server address: give HOST:PORT (port {DEFAULT_PORT})")
    return host, int(port)


def target_from_environment() -> str | None:
    return os.environ.get(ENVIRONMENT) or None


class RemoteProfiler:
    """Connects to `quiver target-server`; sends each tensor (weights, inputs) only when the server lacks it."""

    def __init__(self, target: str, token: str | None = None, timeout_s: float = 600.0) -> None:
        self.target = target
        host, port = parse_target(target)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise TargetServerError(f"cannot reach the target server at {target}: {exc.strerror or exc}") from None
        self.sent_bytes = 0  # tensor bytes sent (weights and inputs): what the server lacked
        self.sent_tensors = 0
        hello = self._call({"op": "hello", "token": token, "protocol": PROTOCOL})
        if hello.get("protocol") != PROTOCOL:
            spoken = hello.get("protocol")
            raise TargetServerError(f"the target server at {target} speaks protocol {spoken}, not {PROTOCOL}")
        self._fingerprint = {str(k): str(v) for k, v in dict(hello["fingerprint"]).items()}
        self._version = int(hello["knob_space_version"])

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            write_frame(self._sock, request)
            reply = read_frame(self._sock)
        except (OSError, ConnectionClosed) as exc:
            raise TargetServerError(f"the target server at {self.target} closed the connection ({exc})") from None
        except ProtocolError as exc:
            raise TargetServerError(f"the target server at {self.target} sent {exc}", exc.kind) from None
        if not isinstance(reply, dict):
            raise TargetServerError(f"the target server at {self.target} sent a reply that is not a map", "bad-frame")
        if not reply.get("ok"):
            kind, message = str(reply.get("error")), str(reply.get("message"))
            if kind == "backend":
                raise BackendError(message)
            raise TargetServerError(f"target server {self.target}: {kind}: {message}", kind)
        return reply

    def fingerprint(self) -> dict[str, str]:
        return dict(self._fingerprint)

    def knob_space_version(self) -> int:
        return self._version

    def _send(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Sends the tensors (by key) the server does not hold yet, in chunks."""
        if not tensors:
            return
        missing = self._call({"op": "missing", "keys": list(tensors)})["missing"]
        for key in missing:
            data = np.ascontiguousarray(tensors[key]).data.cast("B")
            for offset in range(0, max(len(data), 1), CHUNK):
                self._call({"op": "put", "key": key, "offset": offset, "data": bytes(data[offset : offset + CHUNK])})
            self.sent_bytes += len(data)
            self.sent_tensors += 1

    def load(self, graph: FinalizedGraph, weight_keys: Mapping[str, str]) -> tuple[str, tuple[Knob, ...]]:
        keys = {name: weight_keys.get(name) or tensor_key(array) for name, array in graph.weights.items()}
        self._send({keys[name]: array for name, array in graph.weights.items()})
        reply = self._call(
            {"op": "load_graph", "name": graph.name, "model": graph.model.SerializeToString(), "weights": keys}
        )
        knobs = tuple(
            Knob(str(k["name"]), tuple(k["values"]), str(k.get("help", "")), k.get("exact")) for k in reply["knobs"]
        )
        return str(reply["graph"]), knobs

    def upload(self, feed_sets: Sequence[FeedSet]) -> str:
        sets, tensors = [], {}
        for feed_set in feed_sets:
            entry: dict[str, dict[str, str]] = {"feeds": {}, "bound": {}}
            for part, arrays in (("feeds", feed_set.feeds), ("bound", feed_set.bound)):
                for name, array in arrays.items():
                    key = tensor_key(array)
                    tensors[key] = array
                    entry[part][name] = key
            sets.append(entry)
        self._send(tensors)
        return str(self._call({"op": "inputs", "sets": sets})["inputs"])

    def prepare(self, graph: str, config: Mapping[str, KnobValue]) -> str:
        return str(self._call({"op": "prepare", "graph": graph, "config": dict(config)})["variant"])

    def time(self, variant: str, inputs: str, index: int, runs: int) -> list[float]:
        reply = self._call({"op": "time", "variant": variant, "inputs": inputs, "index": index, "runs": runs})
        return [float(t) for t in reply["times"]]

    def outputs(self, variant: str, inputs: str) -> list[dict[str, np.ndarray]]:
        reply = self._call({"op": "outputs", "variant": variant, "inputs": inputs})
        return [
            {n: np.frombuffer(o["data"], np.dtype(o["dtype"])).reshape(o["shape"]) for n, o in result.items()}
            for result in reply["outputs"]
        ]

    def release(self, variant: str) -> None:
        self._call({"op": "release", "variant": variant})

    def close(self) -> None:
        try:
            self._call({"op": "bye"})
        except TargetServerError:
            pass
        self._sock.close()

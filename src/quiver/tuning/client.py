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
            spoken = str(hello.get("protocol"))[:20]
            raise TargetServerError(f"the target server at {target} speaks protocol {spoken}, not {PROTOCOL}")
        self._fingerprint = self._checked_fingerprint(hello.get("fingerprint"))
        self._version = self._checked(hello.get("knob_space_version"), int, "knob_space_version")

    def _bad_reply(self, what: str) -> TargetServerError:
        return TargetServerError(
            f"the target server at {self.target} sent {what}; is it a quiver target-server?", "bad-frame"
        )

    def _checked(self, value: Any, kind: type, what: str) -> Any:
        """A reply's field, as the server's own replies type it (a hostile server is refused, not trusted)."""
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise self._bad_reply(f"a '{what}' that is not {kind.__name__}")
        return value

    def _checked_fingerprint(self, value: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not 0 < len(value) <= 64:
            raise self._bad_reply("a device fingerprint that is not a map")
        fingerprint = {}
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, (str, int)) or len(key) > 64 or len(str(item)) > 256:
                raise self._bad_reply("a device fingerprint field that is not a short name and value")
            fingerprint[key] = str(item)
        return fingerprint

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
        knobs = []
        for knob in self._checked(reply.get("knobs"), list, "knobs"):
            knob = self._checked(knob, dict, "knobs[]")
            values = tuple(self._checked(knob.get("values"), list, "knobs[].values"))
            exact = knob.get("exact")
            if not values or not all(isinstance(v, (bool, int, str)) for v in values) or exact not in (None, *values):
                raise self._bad_reply("a knob whose values are not booleans, integers or strings")
            name = self._checked(knob.get("name"), str, "knobs[].name")
            knobs.append(Knob(name, values, str(knob.get("help", ""))[:1000], exact))
        return self._checked(reply.get("graph"), str, "graph"), tuple(knobs)

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
        return self._checked(self._call({"op": "inputs", "sets": sets}).get("inputs"), str, "inputs")

    def prepare(self, graph: str, config: Mapping[str, KnobValue]) -> str:
        reply = self._call({"op": "prepare", "graph": graph, "config": dict(config)})
        return self._checked(reply.get("variant"), str, "variant")

    def time(self, variant: str, inputs: str, index: int, runs: int) -> list[float]:
        reply = self._call({"op": "time", "variant": variant, "inputs": inputs, "index": index, "runs": runs})
        times = self._checked(reply.get("times"), list, "times")
        if len(times) != runs or not all(isinstance(t, float) and 0 <= t < 1e6 for t in times):
            raise self._bad_reply(f"'times' that are not {runs} durations in seconds")
        return list(times)

    def outputs(self, variant: str, inputs: str) -> list[dict[str, np.ndarray]]:
        reply = self._call({"op": "outputs", "variant": variant, "inputs": inputs})
        results = []
        for result in self._checked(reply.get("outputs"), list, "outputs"):
            arrays = {}
            for name, output in self._checked(result, dict, "outputs[]").items():
                arrays[str(name)] = self._output_array(self._checked(output, dict, "outputs[][]"))
            results.append(arrays)
        return results

    def _output_array(self, output: dict[str, Any]) -> np.ndarray:
        try:
            dtype = np.dtype(self._checked(output.get("dtype"), str, "dtype"))
        except TypeError:
            raise self._bad_reply("an output of an unknown dtype") from None
        shape = self._checked(output.get("shape"), list, "shape")
        data = self._checked(output.get("data"), bytes, "data")
        if dtype.kind not in "biuf" or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise self._bad_reply("an output that is not a numeric tensor")
        if int(np.prod(shape, dtype=object)) * dtype.itemsize != len(data):
            raise self._bad_reply("an output whose bytes do not match its shape")
        return np.frombuffer(data, dtype).reshape(shape)

    def release(self, variant: str) -> None:
        self._call({"op": "release", "variant": variant})

    def close(self) -> None:
        try:
            self._call({"op": "bye"})
        except TargetServerError:
            pass
        self._sock.close()

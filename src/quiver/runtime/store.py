"""What every handle of one loaded context shares: the mapped file, parsed graphs and prepared executables.

One lock discipline for the graph table: lookups, preparation, eviction and release happen under the
store's lock (preparing a graph holds only that graph's own lock, so other graphs keep running); a run
holds a use count on its executable, and an executable evicted or released meanwhile is released by
the last run that uses it. After `fork` the child gets new locks and prepares its own executables:
the parent's sessions rely on threads the child does not have, so they are kept but never touched.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from quiver import fork
from quiver.backends import Backend, Executable, FinalizedGraph
from quiver.errors import ContextStateError, InvalidHeaderError
from quiver.formats.layout import WEIGHT_LOCATION
from quiver.formats.reader import ContextFile
from quiver.ir import dtypes, proto
from quiver.ir.tensors import TensorInfo, TensorType, info_of_value
from quiver.runtime.tuned import select_tuning


@dataclass(frozen=True)
class GraphInfo:
    """A graph's parsed structure and tensor descriptions: read once per store."""

    name: str
    skeleton: proto.ModelProto
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    static: tuple[TensorInfo, ...]


@dataclass
class _Live:
    executable: Executable
    users: int = 0
    retired: bool = False  # out of the table: released when its last run ends


def _parse_skeleton(file: ContextFile, name: str) -> proto.ModelProto:
    return parse_mapped_skeleton(file, file.skeleton(name), file.graphs[name].weights, f"graph {name!r}")


def parse_mapped_skeleton(file: ContextFile, data: bytes, mapping: dict[str, int], what: str) -> proto.ModelProto:
    """A skeleton parsed and checked against its weight map: one placeholder per mapped weight, of its
    dtype and shape (a backend binds the weights' bytes to these, so a mismatch must never reach it)."""
    model = proto.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise InvalidHeaderError(
            f"{file.source}: {what} is not a valid ONNX structure ({exc}); rebuild the context"
        ) from None
    placeholders = {t.name: t for t in model.graph.initializer if t.data_location == proto.TensorProto.EXTERNAL}
    if set(placeholders) != set(mapping):
        raise InvalidHeaderError(
            f"{file.source}: {what} weight map does not match its initializers; rebuild the context"
        )
    for tensor_name, index in mapping.items():
        tensor, weight = placeholders[tensor_name], file.weights[index]
        where = tensor.external_data
        if (
            tensor.data_type != dtypes.onnx_of(weight.dtype)
            or tuple(tensor.dims) != weight.shape
            or len(where) != 1
            or (where[0].key, where[0].value) != ("location", WEIGHT_LOCATION)
        ):
            raise InvalidHeaderError(
                f"{file.source}: {what} initializer {tensor_name!r} does not match weight {index}; rebuild the context"
            )
    return model


def _describe(file: ContextFile, name: str) -> GraphInfo:
    model = _parse_skeleton(file, name)
    entry = file.graphs[name]
    try:
        static = tuple(  # every initializer, stored or inline, is a static tensor of the graph
            TensorInfo(
                t.name,
                dtypes.name_of_onnx(t.data_type),
                tuple(t.dims),
                TensorType.UPDATEABLE_STATIC if t.name in entry.updateable else TensorType.STATIC,
            )
            for t in model.graph.initializer
        )
        inputs = tuple(info_of_value(v, TensorType.APP_WRITE) for v in model.graph.input)
        outputs = tuple(info_of_value(v, TensorType.APP_READ) for v in model.graph.output)
    except (KeyError, ValueError) as exc:  # a data type Quiver does not know
        raise InvalidHeaderError(f"{file.source}: graph {name!r} has a tensor Quiver cannot describe ({exc})") from None
    if len({i.name for i in inputs}) != len(inputs) or not outputs:
        raise InvalidHeaderError(f"{file.source}: graph {name!r} has duplicate inputs or no outputs; rebuild it")
    return GraphInfo(name, model, inputs, outputs, static)


class Store:
    """One loaded context binary on one backend, shared by all handles (`Context.view()`) over it."""

    def __init__(self, backend: Backend, file: ContextFile, memory_limit_hint_mb: float | None = None) -> None:
        self.backend = backend
        self.file = file
        self.memory_limit_hint_mb = memory_limit_hint_mb
        self.tuning = select_tuning(getattr(file, "tuning", ()), backend, file.source)  # per graph, for this device
        self._lock = threading.RLock()
        self._graph_locks: dict[str, threading.Lock] = {}
        self._infos: dict[str, GraphInfo] = {}
        self._weight_views: dict[int, np.ndarray] = {}
        self._live: OrderedDict[str, _Live] = OrderedDict()
        self._handles = 0
        self.closed = False
        fork.reset_after_fork(self)

    # --- handles ------------------------------------------------------------------------------------
    def attach(self) -> None:
        with self._lock:
            self._check_open()
            self._handles += 1

    def detach(self) -> None:
        """One handle is done; the last one closes the store."""
        with self._lock:
            self._handles -= 1
            if self._handles > 0 or self.closed:
                return
            self.closed = True
            idle = self._retire(list(self._live))
            self._weight_views.clear()
        for live in idle:
            live.executable.release()
        self.file.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ContextStateError("the context is closed; load it again with Context.from_binary()")

    # --- graphs -------------------------------------------------------------------------------------
    def info(self, name: str) -> GraphInfo:
        with self._lock:
            self._check_open()
            info = self._infos.get(name)
            if info is None:
                info = self._infos[name] = _describe(self.file, name)
            return info

    def prepared_model(self, name: str, number: int) -> proto.ModelProto:
        """A graph's prepared form `number` (format 1.6), parsed and checked against its weight map."""
        self._check_open()
        form = self.file.graphs[name].prepared[number]
        data = self.file.prepared_skeleton(name, number)
        return parse_mapped_skeleton(self.file, data, form.weights, f"graph {name!r} prepared form {number}")

    def weight_view(self, index: int) -> np.ndarray:
        with self._lock:
            view = self._weight_views.get(index)
            if view is None:
                view = self._weight_views[index] = self.file.weight_array(index)
            return view

    @contextmanager
    def running(self, name: str, prepare: Callable[[], FinalizedGraph]) -> Iterator[Executable]:
        """The graph's executable for one run, prepared on first use (`prepare()` -> FinalizedGraph)."""
        live = self._acquire(name, prepare)
        try:
            yield live.executable
        finally:
            with self._lock:
                live.users -= 1
                last = live.retired and live.users == 0
            if last:
                live.executable.release()

    def _acquire(self, name: str, prepare: Callable[[], FinalizedGraph]) -> _Live:
        with self._lock:
            self._check_open()
            live = self._use(name)
            if live is not None:
                return live
            graph_lock = self._graph_locks.setdefault(name, threading.Lock())
        with graph_lock:  # one preparation per graph; other graphs keep running
            with self._lock:
                self._check_open()
                live = self._use(name)
                if live is not None:
                    return live
            executable = self.backend.prepare(prepare())
            with self._lock:
                if self.closed:
                    executable.release()
                    self._check_open()
                live = self._live[name] = _Live(executable, users=1)
                evicted = self._retire(self._over_limit(keep=name))
        for old in evicted:
            old.executable.release()
        return live

    def _use(self, name: str) -> _Live | None:
        live = self._live.get(name)
        if live is not None:
            self._live.move_to_end(name)
            live.users += 1
        return live

    def _over_limit(self, keep: str) -> list[str]:
        """Least recently used graphs to drop so the live ones fit the memory hint (never `keep`)."""
        if self.memory_limit_hint_mb is None:
            return []
        limit = self.memory_limit_hint_mb * 1024 * 1024
        # an executable several graphs share (a backend may prepare graphs of one body once) counts once,
        # and dropping one of its graphs frees nothing while another holds it
        holders = Counter(id(live.executable) for live in self._live.values())
        total = sum({id(live.executable): live.executable.private_bytes for live in self._live.values()}.values())
        drop = []
        for name, live in self._live.items():
            if total <= limit or name == keep:
                break
            drop.append(name)
            holders[id(live.executable)] -= 1
            if holders[id(live.executable)] == 0:
                total -= live.executable.private_bytes
        return drop

    def _retire(self, names: Sequence[str]) -> list[_Live]:
        """Takes graphs out of the table; returns those no run uses (the caller releases them unlocked)."""
        idle = []
        for name in names:
            live = self._live.pop(name, None)
            if live is not None:
                live.retired = True
                if live.users == 0:
                    idle.append(live)
        return idle

    def release_graph(self, name: str) -> None:
        with self._lock:
            idle = self._retire([name])
        for live in idle:
            live.executable.release()

    @property
    def live_graphs(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def wait_until_ready(self) -> None:
        with self._lock:
            executables = [live.executable for live in self._live.values()]
        for executable in executables:
            executable.wait_until_ready()

    # --- fork ---------------------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        """New locks; the parent's executables are forgotten, never released (their threads are not here)."""
        self._lock = threading.RLock()
        self._graph_locks = {}
        for live in self._live.values():
            fork.keep_forever(live.executable)
        self._live = OrderedDict()
        after_fork = getattr(self.backend, "after_fork_in_child", None)
        if after_fork is not None:
            after_fork()

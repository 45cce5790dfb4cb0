"""A graph's run with its feeds and output buffers bound once (ORT's IOBinding): repeated runs skip the checks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

import numpy as np

from quiver import fork
from quiver.errors import FeedDTypeError
from quiver.runtime.feeds import validate_outputs

if TYPE_CHECKING:
    from quiver.ir.tensors import TensorInfo
    from quiver.runtime.owner import GraphOwner
    from quiver.runtime.state import GraphState

    # the state a run was prepared for, and the feeds and bound tensors the backend gets for it
    _Prepared = tuple[GraphState | None, dict[str, np.ndarray], Mapping[str, np.ndarray]]


class Bindable(Protocol):
    """What a binding needs of its graph (`quiver.Graph`, which makes bindings: `Graph.bind`)."""

    name: str
    outputs: tuple[TensorInfo, ...]
    _context: GraphOwner

    def backend_feeds(
        self, feeds: Mapping[str, object], state: GraphState
    ) -> tuple[dict[str, np.ndarray], Mapping[str, np.ndarray]]: ...


class BoundRun:
    """Runs one graph on arrays bound once: write new values into them in place between runs.

    Outputs given a buffer are written into it (a KV cache appended in place); the others, like an
    output of a varying shape, come back from `run()` as new arrays, as ORT's IOBinding allocates an
    output bound by device only.

    `Graph.execute` checks every feed and output buffer and builds its dictionaries on each run; a
    generation's decode step feeds the same KV cache and token arrays thousands of times, and those
    checks were most of the Python time around its ORT run. Here names, dtypes and shapes are checked
    when binding (and again only when the graph's state changes: a section applied, a strength set);
    each `run()` sees the state in use when it starts, as `execute` does. Runs of one binding take
    turns: they share its output buffers.
    """

    def __init__(self, graph: Bindable, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> None:
        for name, array in feeds.items():
            if not isinstance(array, np.ndarray):
                raise FeedDTypeError(
                    f"graph {graph.name!r}: bound feed {name!r} must be a numpy array (a run reads it in place); "
                    f"got {type(array).__name__}"
                )
        validate_outputs(graph.name, graph.outputs, out)
        self.graph = graph
        self._feeds = dict(feeds)  # private copies: a run hands the backend the same, unchanged dicts
        self._out = dict(out)
        # outputs without a buffer (a shape that varies, or one not wanted in place): new arrays each run
        self._unbound = [(i, o.name) for i, o in enumerate(graph.outputs) if o.name not in out]
        self._prepared: _Prepared = (None, {}, {})
        self._prepare(graph._context._state(graph.name))  # refuses bad feeds now, not at the first run
        self._lock = threading.Lock()
        fork.reset_after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def _prepare(self, state: GraphState) -> _Prepared:
        arrays, bound = self.graph.backend_feeds(self._feeds, state)
        self._prepared = (state, arrays, bound)
        return self._prepared

    @contextmanager
    def repeating(self) -> Iterator[Callable[[], None]]:
        """`run()` as a function for a loop of steps (a generation's decode steps), whose outputs all have
        buffers: the graph's executable is held for the loop and each call is the backend's run alone.
        A change of the graph's state (a section applied, a strength set) is seen at the next call, as by
        `run()`; the binding's runs take turns with the loop's, which holds it until it ends."""
        graph = self.graph
        if self._unbound:
            raise FeedDTypeError(
                f"graph {graph.name!r}: a repeating run writes every output into a buffer; bind "
                f"{[name for _, name in self._unbound]} too"
            )
        with self._lock:
            state = graph._context._state(graph.name)
            prepared = self._prepared if self._prepared[0] is state else self._prepare(state)
            with graph._context._repeating(graph.name, prepared[1], prepared[2], self._out) as step:

                def run() -> None:
                    if graph._context._state(graph.name) is state:
                        step()
                    else:  # changed meanwhile: this run sees the new state, as `run()` would
                        latest = self._prepare(graph._context._state(graph.name))
                        graph._context._run(graph.name, latest[1], latest[2], self._out)

                yield run

    def run(self) -> dict[str, np.ndarray]:
        """Executes the graph: outputs with a buffer land in it; the others come back, new arrays by name."""
        graph = self.graph
        with self._lock:
            state = graph._context._state(graph.name)
            prepared = self._prepared
            if prepared[0] is not state:
                prepared = self._prepare(state)
            results = graph._context._run(graph.name, prepared[1], prepared[2], self._out)
        return {name: results[i] for i, name in self._unbound}

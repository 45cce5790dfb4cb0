"""Plain ONNX Runtime behind a `quiver.ort` session: the engine for a model Quiver cannot take on, and
the twin a Quiver session keeps for what only ORT can do (adapters of other shapes, ORT's private `_sess`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from quiver import fork
from quiver.backends.cpu import fork_waits
from quiver.ort.binding import ortvalue_of
from quiver.ort.errors import InvalidArgument
from quiver.ort.metadata import ExecutionPath, NodeArg
from quiver.ort_package import onnxruntime


class PlainOrtSession:
    """ORT's own session over a model, with the caller's options (ORT applies their overrides). Made on first
    use, and again in a forked child: the parent's relies on threads the child lacks (it is kept there,
    never destroyed)."""

    def __init__(self, source: str | Path | bytes, options: Any, eager: bool = False) -> None:
        self._source = str(source) if isinstance(source, Path) else source
        self._options = options if isinstance(options, onnxruntime.SessionOptions) else None
        self._lock = threading.Lock()
        self._session: onnxruntime.InferenceSession | None = None
        fork.reset_after_fork(self)
        if eager:  # errors surface when the caller's session is made, as with ORT
            self.get()

    def get(self) -> onnxruntime.InferenceSession:
        with self._lock:
            if self._session is None:
                with fork_waits():
                    self._session = onnxruntime.InferenceSession(
                        self._source, sess_options=self._options, providers=["CPUExecutionProvider"]
                    )
            return self._session

    @property
    def made(self) -> bool:
        return self._session is not None

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        if self._session is not None:
            fork.keep_forever(self._session)
        self._session = None


def _node_args(args: Sequence[Any]) -> list[NodeArg]:
    return [NodeArg(a.name, a.shape, a.type) for a in args]


class OrtEngine:
    """The whole model on plain ONNX Runtime (ORT's CPU EP fallback), from its path when it has one
    (external data then resolves against the model's folder, as ORT does, not the working one)."""

    plain_ort: Literal[True] = True  # tells the engines apart without importing the other one

    def __init__(self, source: str | Path | bytes, options: Any, reason: str) -> None:
        self.session = PlainOrtSession(source, options, eager=True)
        self.path = ExecutionPath("onnxruntime", reason)

    def inputs(self) -> list[NodeArg]:
        return _node_args(self.session.get().get_inputs())

    def outputs(self) -> list[NodeArg]:
        return _node_args(self.session.get().get_outputs())

    def overridable_initializers(self) -> list[NodeArg]:
        return _node_args(self.session.get().get_overridable_initializers())

    def _with_adapters(self, feeds: Mapping[str, Any], run_options: Any) -> Mapping[str, Any]:
        if not _parameter_adapters(run_options):  # most runs: nothing to list
            return feeds
        names = {a.name for a in self.inputs()}, {a.name for a in self.overridable_initializers()}
        return adapter_feeds(feeds, run_options, *names, on_ort=True)

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any], run_options: Any) -> list[Any]:
        """ORT takes every feed it knows (sequences, maps, strings) as it is."""
        return list(self.session.get().run(output_names, dict(self._with_adapters(feeds, run_options)), run_options))

    def execute(
        self, feeds: Mapping[str, np.ndarray], run_options: Any, out: Mapping[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]:
        """Every output by name; those in `out` are copied into the caller's arrays."""
        return run_into(self.session.get(), self._with_adapters(feeds, run_options), run_options, out)

    def run_with_ort_values(
        self, output_names: Sequence[str] | None, feeds: Mapping[str, Any], run_options: Any
    ) -> list[onnxruntime.OrtValue]:
        """ORT's own: its outputs may be sparse tensors, sequences or maps."""
        feeds = self._with_adapters(feeds, run_options)
        values = {n: v if isinstance(v, onnxruntime.OrtValue) else ortvalue_of(v) for n, v in feeds.items()}
        return list(self.session.get().run_with_ort_values(output_names, values, run_options))

    def end_profiling(self) -> str:
        return str(self.session.get().end_profiling())

    def assignment_info(self) -> list[Any]:
        return list(self.session.get().get_provider_graph_assignment_info())

    def close(self) -> None:
        """ORT's session goes with this engine."""


def run_into(
    session: onnxruntime.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    run_options: Any,
    out: Mapping[str, np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """A plain ORT run, every output by name; those in `out` are copied into the caller's arrays."""
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(None, dict(feeds), run_options)))
    for name, target in (out or {}).items():
        if name in values:
            np.copyto(target, values[name].reshape(target.shape))
            values[name] = target
    return values


def _parameter_adapters(run_options: Any) -> list[Any]:
    """The run's active `.onnx_adapter` adapters (those with parameters)."""
    return [a for a in getattr(run_options, "active_adapters", []) if a.parameters is not None]


def adapter_feeds(
    feeds: Mapping[str, Any],
    run_options: Any,
    inputs: set[str] | frozenset[str],
    overridable: set[str] | frozenset[str],
    on_ort: bool,
) -> Mapping[str, Any]:
    """The active `.onnx_adapter` adapters' parameters fed as the model's inputs, as ORT feeds them
    (`on_ort`: overridable initializers too; on Quiver those are applied as sections instead)."""
    adapters = _parameter_adapters(run_options)
    if not adapters:
        return feeds
    merged = dict(feeds)
    for adapter in adapters:
        unknown = sorted(set(adapter.parameters) - inputs - overridable)
        if unknown:
            raise InvalidArgument(
                f"adapter {adapter.path}: parameters {unknown} are neither inputs nor overridable initializers"
            )
        merged.update({n: v for n, v in adapter.parameters.items() if on_ort or n in inputs})
    return merged

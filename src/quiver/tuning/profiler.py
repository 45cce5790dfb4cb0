"""Where candidates are prepared and measured: this process (`LocalProfiler`) or a target server."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from quiver.backends.base import Backend, Executable, FinalizedGraph, Knob, KnobValue, TunableBackend, is_tunable
from quiver.errors import BackendError, TuningError
from quiver.ir.quiver_ops import DECODE_ATTENTION
from quiver.tuning.measure import time_block


@dataclass(frozen=True)
class FeedSet:
    """One run's inputs as the backend gets them: feeds, and bound tensors (updateable ones, strengths)."""

    feeds: Mapping[str, np.ndarray]
    bound: Mapping[str, np.ndarray]


def inplace_outputs(graph: FinalizedGraph) -> dict[str, str]:
    """Outputs a run writes into one of its inputs (output -> input): a GroupQueryAttention's (or Quiver's
    DecodeAttention's) present keys and values, bound to the past buffers as the text generator binds them,
    so a measured step neither copies nor allocates the cache."""
    inputs = {i.name: i for i in graph.inputs}
    outputs = {o.name: o for o in graph.outputs}
    pairs = {}
    for node in graph.model.graph.node:
        if node.op_type not in ("GroupQueryAttention", DECODE_ATTENTION):
            continue
        for past, present in ((3, 1), (4, 2)):
            if len(node.input) > past and len(node.output) > present:
                source, target = node.input[past], node.output[present]
                if source in inputs and target in outputs and inputs[source].shape == outputs[target].shape:
                    pairs[target] = source
    return pairs


@dataclass(frozen=True)
class _Variant:
    executable: Executable
    inplace: dict[str, str]  # output -> the input it is written into
    names: list[str]  # the outputs, in order


class Profiler(Protocol):
    """Prepares variants of graphs and measures them; the search that picks among them runs elsewhere."""

    def fingerprint(self) -> dict[str, str]: ...

    def knob_space_version(self) -> int: ...

    def load(self, graph: FinalizedGraph, weight_keys: Mapping[str, str]) -> tuple[str, tuple[Knob, ...]]:
        """Makes the graph known (its weights included: `weight_keys` names each weight's content, so a
        remote profiler sends only those it lacks); returns a handle and the knobs it may turn."""
        ...

    def upload(self, feed_sets: Sequence[FeedSet]) -> str:
        """Makes input sets known; returns a handle."""
        ...

    def prepare(self, graph: str, config: Mapping[str, KnobValue]) -> str:
        """A variant: the graph prepared with the configuration."""
        ...

    def time(self, variant: str, inputs: str, index: int, runs: int) -> list[float]:
        """Seconds per run of the variant on input set `index` (after a pause and one untimed run)."""
        ...

    def outputs(self, variant: str, inputs: str) -> list[dict[str, np.ndarray]]:
        """The variant's outputs for every input set, by name, but those written in place (KV caches)."""
        ...

    def release(self, variant: str) -> None: ...

    def close(self) -> None: ...


class Variants:
    """Prepared graphs and input sets by handle, run the same way here and on a target server."""

    def __init__(self, backend: Backend) -> None:
        if not is_tunable(backend):
            raise TuningError(f"backend {backend.name!r} declares no tunable parameters; tune on the cpu backend")
        self.backend: TunableBackend = backend
        self._ids = itertools.count(1)
        self.graphs: dict[str, FinalizedGraph] = {}
        self.knobs: dict[str, dict[str, Knob]] = {}
        self.inputs: dict[str, list[FeedSet]] = {}
        self.variants: dict[str, _Variant] = {}

    def _id(self, kind: str) -> str:
        return f"{kind}{next(self._ids)}"

    def load(self, graph: FinalizedGraph, weight_keys: Mapping[str, str] | None = None) -> tuple[str, tuple[Knob, ...]]:
        handle = self._id("g")
        knobs: tuple[Knob, ...] = self.backend.tunable_parameters(graph)
        self.graphs[handle] = graph
        self.knobs[handle] = {k.name: k for k in knobs}
        return handle, knobs

    def upload(self, feed_sets: Sequence[FeedSet]) -> str:
        handle = self._id("i")
        self.inputs[handle] = list(feed_sets)
        return handle

    def prepare(self, graph: str, config: Mapping[str, KnobValue]) -> str:
        finalized = self.graphs.get(graph)
        if finalized is None:
            raise TuningError(f"no graph {graph!r} was loaded")
        knobs = self.knobs[graph]
        for name, value in config.items():
            if name not in knobs or value not in knobs[name].values or type(value) is not type(knobs[name].default):
                known = {k.name: list(k.values) for k in knobs.values()}
                raise BackendError(f"{name}={value!r} is not in this graph's knob space: {known}")
        executable = self.backend.prepare(dataclasses.replace(finalized, tuning=dict(config)))
        executable.wait_until_ready()
        handle = self._id("v")
        self.variants[handle] = _Variant(executable, inplace_outputs(finalized), [o.name for o in finalized.outputs])
        return handle

    def _run(self, variant: str, inputs: str, index: int) -> list[np.ndarray]:
        if variant not in self.variants:
            raise TuningError(f"no variant {variant!r} is prepared")
        sets = self.inputs.get(inputs)
        if sets is None or not 0 <= index < len(sets):
            raise TuningError(f"no input set {inputs!r}[{index}]")
        executable, inplace = self.variants[variant].executable, self.variants[variant].inplace
        feed_set = sets[index]
        feeds, bound = feed_set.feeds, feed_set.bound
        out = {output: feeds[source] for output, source in inplace.items() if source in feeds}
        return executable.run(feeds, bound, out) if out else executable.run(feeds, bound)

    def time(self, variant: str, inputs: str, index: int, runs: int) -> list[float]:
        return time_block(lambda: self._run(variant, inputs, index), runs)

    def outputs(self, variant: str, inputs: str) -> list[dict[str, np.ndarray]]:
        results = []
        for index in range(len(self.inputs.get(inputs, [None]))):
            values = self._run(variant, inputs, index)  # checks the handles
            prepared = self.variants[variant]
            # copies: the next run may write into the arrays returned
            results.append({n: np.array(v) for n, v in zip(prepared.names, values) if n not in prepared.inplace})
        return results

    def release(self, variant: str) -> None:
        entry = self.variants.pop(variant, None)
        if entry is not None:
            entry.executable.release()

    def close(self) -> None:
        for variant in list(self.variants):
            self.release(variant)
        self.graphs.clear()
        self.knobs.clear()
        self.inputs.clear()


class LocalProfiler(Variants):
    """Measures in this process, on the given backend (default: cpu, packed from the first run)."""

    def __init__(self, backend: Backend | None = None) -> None:
        if backend is None:
            from quiver.backends.cpu import CpuBackend

            backend = CpuBackend(lazy_prepack=False)
        super().__init__(backend)

    def fingerprint(self) -> dict[str, str]:
        return dict(self.backend.device_fingerprint())

    def knob_space_version(self) -> int:
        return int(self.backend.knob_space_version)

"""The context (QNN context): graphs over one weight store, built, saved, loaded by mmap and executed.

A `Context` is a handle: the mapped binary, parsed graphs and prepared executables live in a shared
store (`runtime/store.py`), while the applied sections and LoRA strengths belong to the handle. Each
`view()` is another handle over the same store with its own adapter state (QNN's per-graph state over
one context), so users sharing a context share weights and packed weights, never adapters.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from quiver.backends import (
    AheadOfTimeBackend,
    Backend,
    FinalizedGraph,
    MappedFile,
    PreparedGraph,
    Repeatable,
    StoredWeight,
    WeightFile,
    get_backend,
)
from quiver.errors import (
    ContextStateError,
    DuplicateGraphError,
    EncodingsError,
    TensorUpdateError,
    UnknownGraphError,
)
from quiver.formats.reader import ContextFile
from quiver.formats.section import SectionFile
from quiver.ir import dtypes
from quiver.ir.edit import initializers_as_inputs
from quiver.runtime import sections
from quiver.runtime.graph import Graph
from quiver.runtime.state import GraphState, LoraStrengths
from quiver.runtime.store import Store

if TYPE_CHECKING:  # converting models (onnx.reference, the inliner...) and writing are for building
    import onnx

    from quiver.formats.encodings import EncodingSet
    from quiver.formats.writer import ContextWriter
    from quiver.ir.deferred import Deferred
    from quiver.passes.convert import InputShapes


@dataclass(frozen=True)
class WeightStats:
    unique_bytes: int  # bytes stored once in the weight region
    referenced_bytes: int  # bytes all graphs reference, counted once per graph
    unique_count: int
    referenced_count: int


def _as_the_backend_gets_it(skeleton: onnx.ModelProto, updateable: Sequence[str]) -> onnx.ModelProto:
    """A graph's model as backends are given it: updateable tensors are inputs, fed with each run, so
    replacing them never rebuilds the backend's state."""
    return initializers_as_inputs(skeleton, updateable) if updateable else skeleton


def _graph_name(graph: str | Graph) -> str:
    return graph.name if isinstance(graph, Graph) else graph


class Context:
    """A set of graphs sharing one content-addressed weight store, on one backend.

    Build: `Context.create()`, `add_graph(...)`, `finalize()`, `save()`. Load: `Context.from_binary(...)`.
    Graphs are prepared on first use; with `memory_limit_hint_mb` the least recently used graph's
    backend state is released when the live graphs' estimated backend memory (`Executable.private_bytes`;
    for the cpu backend, the weight bytes ORT packs for the graph) exceeds the hint. Weights are
    in memory once (mapped from the binary), whichever graphs are live. Safe to use from many threads:
    every run sees one consistent state of tensors and strengths, taken when it starts.
    """

    def __init__(self, backend: str | Backend = "cpu") -> None:
        self._backend = get_backend(backend)
        self._writer: ContextWriter | None = None
        self._workdir: Path | None = None
        self._store: Store | None = None
        self._temp_path: Path | None = None
        self._enabled: list[str] = []
        self._graphs: dict[str, Graph] = {}
        # graph -> what runs read now (one immutable GraphState: replaced whole, never mutated)
        self._states: dict[str, GraphState] = {}
        self._staged: dict[str, sections.Values] = {}  # graph -> updates waiting for finalize()
        self._lock = threading.RLock()  # orders this handle's changes; runs only read self._states
        self._memory_limit_hint_mb: float | None = None
        self._closed = False

    # --- building ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, backend: str | Backend = "cpu", workdir: str | Path | None = None) -> Context:
        """An empty context to add graphs to; `workdir` is where the binary is spooled (default: temp dir)."""
        context = cls(backend)
        context._workdir = Path(workdir) if workdir is not None else None
        return context

    @property
    def finalized(self) -> bool:
        return self._store is not None

    def add_graph(
        self,
        name: str,
        model: str | Path | onnx.ModelProto,
        input_shapes: InputShapes | None = None,
        updateable: Sequence[str] = (),
        external_data_folder: str | Path | None = None,
        fold_constants: bool = True,
        deferred: Mapping[str, Deferred] | None = None,
        on_weight: Callable[[str], object] = lambda _: None,
    ) -> None:
        """Converts an ONNX model (path or ModelProto); streams its weights in, each distinct one stored once.
        A ModelProto's external data is read from `external_data_folder` (a file's: from beside it).
        `fold_constants=False` keeps constant subgraphs for the backend's runtime to fold (or not).
        `deferred`: the values of placeholders a streaming export made, each made once when it is stored
        (graphs added with the same `Deferred` share it without making it again); `on_weight(name)` before
        each weight is stored."""
        if self.finalized:
            raise ContextStateError("the context is finalized; create a new context to add graphs")
        if not name:
            raise ContextStateError("graph names must not be empty")
        if self._writer is None:
            from quiver.formats.writer import ContextWriter

            self._writer = ContextWriter(self._workdir)
            weakref.finalize(self, self._writer.abort)
        if name in self._enabled:
            raise DuplicateGraphError(f"graph {name!r} is already in the context; give each graph a unique name")
        from quiver.passes.convert import convert

        folder = Path(external_data_folder) if external_data_folder is not None else None
        converted = convert(
            model, input_shapes, name, updateable, external_data_folder=folder, fold=fold_constants, deferred=deferred
        )
        mapping = self._writer.add_weights(converted.weights, converted.encodings, on_weight)
        self._writer.add_graph(name, converted.skeleton.SerializeToString(), mapping, updateable)
        self._enabled.append(name)

    def finalize(self) -> Context:
        """Writes the binary (QnnGraph_finalize for all graphs) and maps it; the context is then executable."""
        return self._finalize(prepare_ahead=False)

    def _finalize(self, prepare_ahead: bool) -> Context:
        if self.finalized:
            self._apply_staged(list(self._staged))
            return self
        if self._closed:
            raise ContextStateError("the context is closed; load it again with Context.from_binary()")
        if self._writer is None:
            raise ContextStateError("the context has no graphs; add at least one with add_graph() before finalize()")
        if prepare_ahead:
            self._prepare_ahead(self._writer)
        path = self._writer.finish()
        self._temp_path = path
        # only the process that wrote it removes it: a forked child exiting must not take the parent's file
        weakref.finalize(self, self._writer.discard)
        self._attach(Store(self._backend, ContextFile.open(path), self._memory_limit_hint_mb), None)
        return self

    def save(self, path: str | Path, prepare_ahead: bool = True) -> Path:
        """Writes the context binary to `path` atomically (finalizing first if needed).

        What is written is what this context holds (its mapping), whatever now lies at the path it was
        loaded from. A context not finalized yet is first prepared ahead for its backend where the backend
        can (`prepare_ahead`: the cpu backend stores ONNX Runtime's optimized form of each graph, which
        makes opening it faster with the same ORT); `finalize()` alone prepares nothing ahead, as a
        context used in the process that built it would gain nothing from it.
        """
        from quiver.formats.writer import publish, write_atomically

        self._finalize(prepare_ahead)
        destination = Path(path)
        file = self.file
        if self._temp_path is not None:
            assert self._writer is not None
            self._writer.sync()  # written as scratch: on disk before it takes a lasting name
            publish(self._temp_path, destination)  # the mapping stays valid: same file, new name
            self._temp_path = None
            self._writer.release()
        elif not file.is_file_at(destination):
            write_atomically(destination, file.buffer)
        return destination

    def _prepare_ahead(self, writer: ContextWriter) -> None:
        """Stores the backend's own form of each graph next to its skeleton, where the backend makes one."""
        backend = self._backend
        if not isinstance(backend, AheadOfTimeBackend):
            return
        from quiver.formats.writer import PreparedRecord
        from quiver.ir.proto import ModelProto

        records = writer.weights
        for name, (skeleton, mapping, updateable) in writer.graphs.items():
            model = _as_the_backend_gets_it(ModelProto.FromString(skeleton), updateable)
            stored = {
                t: StoredWeight(records[i].offset, records[i].length, records[i].sha256)
                for t, i in mapping.items()
                if t not in updateable
            }
            form = backend.prepare_ahead(
                FinalizedGraph(name, model, {}, (), ()), WeightFile(writer.flushed_path(), stored)
            )
            if form is None:
                continue
            indices = {tensor: mapping[original] for tensor, original in form.reused.items()}
            types = {t.name: t.data_type for t in form.model.graph.initializer}
            for tensor, array in form.added.items():  # tensors the preparation made (a folded constant)
                indices[tensor] = writer.add_weight(dtypes.name_of_onnx(types[tensor]), array.shape, [array.tobytes()])
            record = PreparedRecord(form.runtime, form.source, form.model.SerializeToString(), indices)
            writer.add_prepared(name, record)

    def get_binary(self) -> bytes:
        """The context binary as bytes (QnnContext_getBinary): what `save()` writes, prepared ahead alike."""
        self._finalize(prepare_ahead=True)
        return bytes(self.file.buffer)

    # --- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_binary(
        cls,
        source: str | Path | bytes | bytearray | memoryview,
        backend: str | Backend = "cpu",
        enable_graphs: Sequence[str] | None = None,
        memory_limit_hint_mb: float | None = None,
        persistent: bool = True,
    ) -> Context:
        """Loads a context binary (QnnContext_createFromBinary).

        `persistent=True` maps the file (or keeps a view of the bytes) and uses weights in place: the
        file must be replaced, never rewritten or truncated in place, while the context lives (as with
        SQLite or LMDB files; every Quiver command replaces). `persistent=False` copies it into private
        memory. `enable_graphs` limits which graphs can be retrieved, in priority order.
        """
        context = cls(backend)
        if isinstance(source, (bytes, bytearray, memoryview)):
            file = ContextFile(source if persistent else bytes(source))
        else:
            file = ContextFile.open(source, persistent=persistent)
        context._attach(Store(context._backend, file, memory_limit_hint_mb), enable_graphs)
        return context

    def _attach(self, store: Store, enable_graphs: Sequence[str] | None) -> None:
        file = store.file
        if enable_graphs is None:
            enabled = list(file.graphs)
        else:
            unknown = [g for g in enable_graphs if g not in file.graphs]
            if unknown:
                raise UnknownGraphError(f"cannot enable {unknown}: the context holds {list(file.graphs)}")
            enabled = list(dict.fromkeys(enable_graphs))
        store.attach()
        self._store, self._enabled = store, enabled
        self._detach = weakref.finalize(self, store.detach)  # also when a handle is dropped unclosed

    def view(self) -> Context:
        """Another handle on the same loaded context: same weights, packed weights and prepared graphs,
        its own applied sections and strengths (starting from the context's own values)."""
        store = self._require_store()
        handle = Context(self._backend)
        handle._attach(store, self._enabled)
        return handle

    def _require_store(self) -> Store:
        if self._closed:
            raise ContextStateError("the context is closed; load it again with Context.from_binary()")
        if self._store is None:
            raise ContextStateError("the context is not finalized yet; call finalize() first")
        return self._store

    # --- graphs -----------------------------------------------------------------------------------
    @property
    def graph_names(self) -> list[str]:
        return list(self._enabled)

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def memory_limit_hint_mb(self) -> float | None:
        return self._store.memory_limit_hint_mb if self._store is not None else self._memory_limit_hint_mb

    @memory_limit_hint_mb.setter
    def memory_limit_hint_mb(self, value: float | None) -> None:
        self._memory_limit_hint_mb = value
        if self._store is not None:
            self._store.memory_limit_hint_mb = value

    def graph(self, name: str) -> Graph:
        """The graph of that name (QnnGraph_retrieve)."""
        graph = self._graphs.get(name)
        if graph is not None:
            return graph
        if name not in self._enabled:
            raise UnknownGraphError(f"no graph {name!r} in this context; its graphs are {self.graph_names}")
        info = self._require_store().info(name)
        with self._lock:
            return self._graphs.setdefault(name, Graph(self, name, info.inputs, info.outputs, info.static))

    def graphs(self) -> Iterable[Graph]:
        return (self.graph(name) for name in self._enabled)

    def _state(self, name: str) -> GraphState:
        """What a run of the graph reads now: one object, read once."""
        state = self._states.get(name)
        if state is None:
            with self._lock:
                state = self._states.setdefault(name, self._initial_state(name))
        return state

    def _initial_state(self, name: str) -> GraphState:
        """The graph's updateable tensors as the context stores them (views of the mapping), no section.

        They are fed to the backend with each run: replacing them never rebuilds it.
        """
        store = self._require_store()
        entry = store.file.graphs[name]
        return GraphState({t: store.weight_view(entry.weights[t]) for t in entry.updateable})

    def _run(
        self,
        name: str,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray] | None = None,
        release_scratch: bool = False,
    ) -> list[np.ndarray]:
        store = self._require_store()
        store.file.check_unchanged()  # a file written in place under a live mapping: refuse, don't crash
        with store.running(name, lambda: self._finalized_graph(store, name)) as executable:
            if release_scratch:
                return executable.run(feeds, bound, out, release_scratch=True)
            return executable.run(feeds, bound, out) if out else executable.run(feeds, bound)

    @contextmanager
    def _repeating(
        self,
        name: str,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
    ) -> Iterator[Callable[[], None]]:
        """`_run(name, feeds, bound, out)` as a function to call many times while only the feeds' values
        change (a generation's decode steps): the graph's executable is held for the whole loop and the
        file checked once, so each call is the backend's run alone where the backend offers one
        (`Repeatable`). Mid-loop, a file changed in place is still rescued by the file guard."""
        store = self._require_store()
        store.file.check_unchanged()
        with store.running(name, lambda: self._finalized_graph(store, name)) as executable:
            if isinstance(executable, Repeatable):
                yield executable.repeater(feeds, bound, out)
                return

            def run() -> None:
                executable.run(feeds, bound, out)

            yield run

    def finalized_graph(self, name: str) -> FinalizedGraph:
        """What the backend is given for this graph on this device (its structure, weight views and tuned
        configuration): tools that prepare variants of it themselves, such as tuning, start here."""
        self.graph(name)
        return self._finalized_graph(self._require_store(), name)

    @staticmethod
    def _finalized_graph(store: Store, name: str) -> FinalizedGraph:
        info = store.info(name)
        entry = store.file.graphs[name]
        weights = {t: store.weight_view(i) for t, i in entry.weights.items() if t not in entry.updateable}
        model = _as_the_backend_gets_it(info.skeleton, entry.updateable)
        tuning = store.tuning.get(name, {})
        prepared = tuple(
            PreparedGraph(
                form.runtime,
                form.source,
                partial(store.prepared_model, name, number),
                {t: store.weight_view(i) for t, i in form.weights.items()},
            )
            for number, form in enumerate(entry.prepared)
        )
        mapped = store.file.mapped_file()
        mapping = (
            MappedFile(*mapped, partial(store.file.is_file_at, mapped[0]), store.file.header_sha256) if mapped else None
        )
        return FinalizedGraph(
            name, model, weights, info.inputs, info.outputs, store.file.file_backed, tuning, prepared, mapping
        )

    def _encodings(self, name: str) -> EncodingSet:
        """The encodings of a graph's quantized tensors, from the values in use now (sections included)."""
        from onnx import numpy_helper

        from quiver.passes.quantized import graph_encodings

        self.graph(name)
        store = self._require_store()
        skeleton, entry, current = store.info(name).skeleton, store.file.graphs[name], self._state(name).values
        inline = {t.name: t for t in skeleton.graph.initializer if t.name not in entry.weights}

        def value_of(tensor: str) -> np.ndarray | None:
            if tensor in current:
                return current[tensor]
            if tensor in entry.weights:
                return store.weight_view(entry.weights[tensor])
            return numpy_helper.to_array(inline[tensor]) if tensor in inline else None

        constants = {*current, *entry.weights, *inline}
        try:
            return graph_encodings(skeleton, constants, value_of)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:  # a damaged skeleton
            raise EncodingsError(
                f"graph {name!r}: its quantization parameters cannot be read ({type(exc).__name__}: {exc}); "
                "the context is damaged: rebuild it"
            ) from None

    def prepare_graph(self, name: str) -> None:
        """Prepares the graph's backend state now rather than at its first run (QNN prepares a graph when
        it is finalized); a graph the backend serves with another's state takes that one."""
        self.graph(name)  # one this context has, enabled
        store = self._require_store()
        with store.running(name, lambda: self._finalized_graph(store, name)):
            pass

    def wait_until_ready(self) -> None:
        """Blocks until the live graphs' background preparation (e.g. weight packing) is done."""
        if self._store is not None:
            self._store.wait_until_ready()

    @property
    def live_graphs(self) -> list[str]:
        """Graphs whose backend state is prepared, least recently used first."""
        return self._store.live_graphs if self._store is not None else []

    def release_graph(self, name: str) -> None:
        """Drops a graph's backend state (runs in flight finish first); it is prepared again on next use."""
        self._require_store().release_graph(name)

    # --- updateable tensors and binary sections ----------------------------------------------------
    def _stage(self, updates: Mapping[str, Mapping[str, object]]) -> None:
        """Stages updates per graph, all checked first: one refused update stages nothing."""
        for graph in updates:
            self.graph(graph)  # known, enabled, finalized
        checked = {graph: sections.checked_update(self.file, graph, values) for graph, values in updates.items()}
        with self._lock:
            for graph, values in checked.items():
                self._staged.setdefault(graph, {}).update(values)

    def _apply_staged(self, graphs: Sequence[str]) -> None:
        with self._lock:
            for graph in graphs:
                self._states[graph] = self._state(graph).updated(self._staged.pop(graph, {}))

    def update_context_tensors(self, values: Mapping[str, object]) -> None:
        """Stages new values for updateable tensors of every graph that has them (QnnTensor_updateContextTensors).

        They take effect at `finalize()`.
        """
        for name in values:
            if not any(name in self.file.graphs[g].updateable for g in self._enabled):
                raise TensorUpdateError(f"no graph of this context has an updateable tensor {name!r}")
        per_graph = {
            graph: {n: v for n, v in values.items() if n in self.file.graphs[graph].updateable}
            for graph in self._enabled
        }
        self._stage({graph: mine for graph, mine in per_graph.items() if mine})

    def updateable_graphs(self) -> list[str]:
        """Enabled graphs that have updateable tensors."""
        return [g for g in self._enabled if self.file.graphs[g].updateable]

    def get_binary_section(self, graph: str | Graph | None = None, metadata: Mapping[str, Any] | None = None) -> bytes:
        """The finalized values of updateable tensors as a `.qsec` (QnnContext_getBinarySection).

        For one graph, or (`graph=None`) for every graph with updateable tensors: a super section that
        stores each distinct tensor once.
        """
        names = self.updateable_graphs() if graph is None else [_graph_name(graph)]
        for name in names:
            self.graph(name)
        if not names:
            raise ContextStateError("no graph of this context has updateable tensors; mark them in add_graph()")
        current = {name: self._state(name).values for name in names}
        return sections.write_section(self.file, current, names, metadata)

    def get_binary_section_size(
        self, graph: str | Graph | None = None, metadata: Mapping[str, Any] | None = None
    ) -> int:
        """The size in bytes of what `get_binary_section` returns for the same arguments now
        (QnnContext_getBinarySectionSize: QNN callers size their buffer with it first)."""
        return len(self.get_binary_section(graph, metadata))  # the section is written to know its size

    def _bind(
        self, section: SectionFile, targets: Sequence[str]
    ) -> tuple[dict[str, sections.Values], LoraStrengths | None]:
        """The section's tensors per target graph and its strengths, every check passed (nothing changes)."""
        for name in targets:
            self.graph(name)  # every graph it would change must be one this context offers
        bound = sections.bind_section(self.file, section, targets)
        strengths = LoraStrengths.from_metadata(section.metadata, section.source)
        if strengths is not None:
            for name in targets:
                strengths.check_fits(name, self.graph(name).inputs, section.source)
        return bound, strengths

    def state_with_sections(self, graph: str, applied: Sequence[SectionFile]) -> GraphState:
        """The state the graph would have with these sections applied, in order, over its own values;
        this handle's state does not change (per-run adapters)."""
        state = self._initial_state(graph)
        for section in applied:
            bound, strengths = self._bind(section, [graph])
            state = state.updated(bound[graph], strengths)
        return state

    def apply_binary_section(
        self,
        graph: str | Graph | None,
        section: str | Path | bytes | bytearray | memoryview | SectionFile,
    ) -> SectionFile:
        """Binds a section's tensors (QnnContext_applyBinarySection): O(tensors), no copy of their bytes.

        `graph=None` applies it to every graph it covers. A section made for another context, for other
        graphs or tensors, or damaged, is refused and nothing changes. Runs in flight finish with the
        state they started with; runs started after see the whole section.
        """
        loaded = sections.load_section(section)
        targets = list(loaded.graphs) if graph is None else [_graph_name(graph)]
        bound, strengths = self._bind(loaded, targets)
        with self._lock:  # every check passed: now swap, one graph's state at a time, each whole
            for name, values in bound.items():
                self._states[name] = self._state(name).updated(values, strengths)
                self._staged.pop(name, None)
        return loaded

    def check_binary_section(
        self,
        graph: str | Graph | None,
        section: str | Path | bytes | bytearray | memoryview | SectionFile,
    ) -> SectionFile:
        """Every check `apply_binary_section` makes (damage, context, graphs, tensors), changing nothing."""
        loaded = sections.load_section(section)
        self._bind(loaded, list(loaded.graphs) if graph is None else [_graph_name(graph)])
        return loaded

    def _set_lora_strength(self, graph: str, adapter: str, value: float) -> None:
        with self._lock:
            state = self._state(graph)
            if state.lora is None:
                raise TensorUpdateError(f"graph {graph!r} has no LoRA section applied; apply one first")
            self._states[graph] = GraphState(state.values, state.lora.with_strength(graph, adapter, value))

    # --- facts ------------------------------------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        return self.file.size

    def weight_stats(self) -> WeightStats:
        file = self.file
        referenced = [i for graph in file.graphs.values() for i in graph.weight_indices]
        return WeightStats(
            unique_bytes=sum(w.length for w in file.weights),
            referenced_bytes=sum(file.weights[i].length for i in referenced),
            unique_count=len(file.weights),
            referenced_count=len(referenced),
        )

    @property
    def file(self) -> ContextFile:
        """The underlying validated binary (for inspection tools)."""
        self.finalize()
        return self._require_store().file

    def close(self) -> None:
        """Lets go of this handle; the weights and prepared graphs go with the last handle."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        self._states = {}
        if store is not None:
            self._detach()  # runs store.detach() once, whoever calls first

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "finalized" if self.finalized else "building"
        return f"Context({state}, backend={self.backend_name!r}, graphs={self.graph_names})"

"""The context (QNN context): graphs over one weight store, built, saved, loaded by mmap and executed."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import numpy_helper

from quiver.backends import Backend, Executable, FinalizedGraph, get_backend
from quiver.errors import (
    ContextStateError,
    DuplicateGraphError,
    InvalidHeaderError,
    TensorUpdateError,
    UnknownGraphError,
)
from quiver.formats._layout import WEIGHT_LOCATION
from quiver.formats.encodings import EncodingSet
from quiver.formats.reader import ContextFile
from quiver.formats.section import SectionFile
from quiver.formats.writer import ContextWriter, copy_atomically, publish, write_atomically
from quiver.ir import dtypes
from quiver.ir.edit import initializers_as_inputs
from quiver.ir.quantized import graph_encodings
from quiver.ir.tensors import TensorInfo, TensorType, info_of_value
from quiver.runtime import sections
from quiver.runtime.graph import Graph

if TYPE_CHECKING:  # converting models (onnx.reference, the inliner...) is for building, not loading
    from quiver.passes.convert import InputShapes


@dataclass(frozen=True)
class WeightStats:
    unique_bytes: int  # bytes stored once in the weight region
    referenced_bytes: int  # bytes all graphs reference, counted once per graph
    unique_count: int
    referenced_count: int


def _parse_skeleton(file: ContextFile, name: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(file.skeleton(name))
    except Exception as exc:  # protobuf's DecodeError and friends
        raise InvalidHeaderError(
            f"{file.source}: graph {name!r} is not a valid ONNX structure ({exc}); rebuild the context"
        ) from None
    placeholders = {t.name: t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    mapping = file.graphs[name].weights
    if set(placeholders) != set(mapping):
        raise InvalidHeaderError(
            f"{file.source}: graph {name!r} weight map does not match its initializers; rebuild the context"
        )
    for tensor_name, index in mapping.items():
        tensor, weight = placeholders[tensor_name], file.weights[index]
        if (
            tensor.data_type != dtypes.onnx_of(weight.dtype)
            or tuple(tensor.dims) != weight.shape
            or [(e.key, e.value) for e in tensor.external_data] != [("location", WEIGHT_LOCATION)]
        ):
            raise InvalidHeaderError(
                f"{file.source}: graph {name!r} initializer {tensor_name!r} does not match weight {index}; "
                "rebuild the context"
            )
    return model


@dataclass
class LoraStrengths:
    """The `lora_alpha` feed a section's metadata sets: one strength per adapter (Genie's LoRA strengths)."""

    alpha_input: str
    adapters: list[str]
    alphas: np.ndarray
    active: list[str]  # the adapters the section holds weights for (its use case); the others are zero

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> LoraStrengths | None:
        lora = metadata.get("lora")
        if not isinstance(lora, dict):
            return None
        try:
            alphas = np.asarray(lora["alphas"], dtype=np.float32)
            adapters = [str(a) for a in lora["adapters"]]
            if alphas.shape != (len(adapters),):
                return None
            # sections written before "active" existed: the adapters their use case gives a strength
            active = [str(a) for a in lora.get("active", [a for a, v in zip(adapters, alphas) if v != 0])]
            return cls(str(lora["alpha_input"]), adapters, alphas, active)
        except (KeyError, TypeError, ValueError):
            return None

    def copy(self) -> LoraStrengths:
        return LoraStrengths(self.alpha_input, list(self.adapters), self.alphas.copy(), list(self.active))


def _graph_name(graph: str | Graph) -> str:
    return graph.name if isinstance(graph, Graph) else graph


class Context:
    """A set of graphs sharing one content-addressed weight store, on one backend.

    Build: `Context.create()`, `add_graph(...)`, `finalize()`, `save()`. Load: `Context.from_binary(...)`.
    Graphs are prepared on first use; with `memory_limit_hint_mb` the least recently used graph's
    backend state is released when the live graphs' estimated backend memory (`Executable.private_bytes`;
    for the cpu backend, the weight bytes ORT packs for the graph) exceeds the hint. Weights are
    in memory once (mapped from the binary), whichever graphs are live.
    """

    def __init__(self, backend: str | Backend = "cpu") -> None:
        self._backend = get_backend(backend)
        self._writer: ContextWriter | None = None
        self._workdir: Path | None = None
        self._file: ContextFile | None = None
        self._temp_path: Path | None = None
        self._enabled: list[str] = []
        self._skeletons: dict[str, onnx.ModelProto] = {}
        self._graphs: dict[str, Graph] = {}
        self._live: OrderedDict[str, Executable] = OrderedDict()
        # graph -> values of its updateable tensors in use; an update replaces the dict, never mutates it
        # (runs in flight and backends keep using the one they were given)
        self._current: dict[str, sections.Values] = {}
        self._staged: dict[str, sections.Values] = {}  # graph -> updates waiting for finalize()
        self._lora: dict[str, LoraStrengths] = {}  # graph -> adapter strengths from the applied section
        self._weight_views: dict[int, np.ndarray] = {}
        self.memory_limit_hint_mb: float | None = None

    # --- building ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, backend: str | Backend = "cpu", workdir: str | Path | None = None) -> Context:
        """An empty context to add graphs to; `workdir` is where the binary is spooled (default: temp dir)."""
        context = cls(backend)
        context._workdir = Path(workdir) if workdir is not None else None
        return context

    @property
    def finalized(self) -> bool:
        return self._file is not None

    def add_graph(
        self,
        name: str,
        model: str | Path | onnx.ModelProto,
        input_shapes: InputShapes | None = None,
        updateable: Sequence[str] = (),
    ) -> None:
        """Converts an ONNX model (path or ModelProto); streams its weights in, each distinct one stored once."""
        if self.finalized:
            raise ContextStateError("the context is finalized; create a new context to add graphs")
        if not name:
            raise ContextStateError("graph names must not be empty")
        if self._writer is None:
            self._writer = ContextWriter(self._workdir)
            weakref.finalize(self, self._writer.abort)
        if name in self._enabled:
            raise DuplicateGraphError(f"graph {name!r} is already in the context; give each graph a unique name")
        from quiver.passes.convert import convert

        converted = convert(model, input_shapes=input_shapes, label=name, updateable=updateable)
        mapping = {
            tensor: self._writer.add_weight(src.dtype, src.shape, src.chunks(), converted.encodings.get(tensor))
            for tensor, src in converted.weights.items()
        }
        self._writer.add_graph(name, converted.skeleton.SerializeToString(), mapping, updateable)
        self._enabled.append(name)

    def finalize(self) -> Context:
        """Writes the binary (QnnGraph_finalize for all graphs) and maps it; the context is then executable."""
        if self.finalized:
            self._apply_staged(list(self._staged))
            return self
        if self._writer is None:
            raise ContextStateError("the context has no graphs; add at least one with add_graph() before finalize()")
        path = self._writer.finish()
        self._temp_path = path
        weakref.finalize(self, path.unlink, missing_ok=True)
        self._attach(ContextFile.open(path), None)
        return self

    def save(self, path: str | Path) -> Path:
        """Writes the context binary to `path` atomically (finalizing first if needed)."""
        self.finalize()
        destination = Path(path)
        assert self._file is not None
        if self._temp_path is not None:
            publish(self._temp_path, destination)  # the mapping stays valid: same file, new name
            self._temp_path = None
        elif Path(self._file.source).is_file():
            if Path(self._file.source).resolve() != destination.resolve():
                copy_atomically(Path(self._file.source), destination)
        else:
            write_atomically(destination, self._file._buffer)
        return destination

    def get_binary(self) -> bytes:
        """The context binary as bytes (QnnContext_getBinary)."""
        self.finalize()
        assert self._file is not None
        return bytes(self._file._buffer)

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

        `persistent=True` maps the file (or keeps a view of the bytes) and uses weights in place; it
        must not change while the context lives. `persistent=False` copies it into private memory.
        `enable_graphs` limits which graphs can be retrieved, in priority order.
        """
        context = cls(backend)
        if isinstance(source, (bytes, bytearray, memoryview)):
            file = ContextFile(source if persistent else bytes(source))
        else:
            file = ContextFile.open(source, persistent=persistent)
        context.memory_limit_hint_mb = memory_limit_hint_mb
        context._attach(file, enable_graphs)
        return context

    def _attach(self, file: ContextFile, enable_graphs: Sequence[str] | None) -> None:
        self._file = file
        if enable_graphs is None:
            self._enabled = list(file.graphs)
        else:
            unknown = [g for g in enable_graphs if g not in file.graphs]
            if unknown:
                raise UnknownGraphError(f"cannot enable {unknown}: the context holds {list(file.graphs)}")
            self._enabled = list(dict.fromkeys(enable_graphs))

    # --- graphs -----------------------------------------------------------------------------------
    @property
    def graph_names(self) -> list[str]:
        return list(self._enabled)

    @property
    def backend_name(self) -> str:
        return self._backend.name

    def graph(self, name: str) -> Graph:
        """The graph of that name (QnnGraph_retrieve)."""
        if name in self._graphs:
            return self._graphs[name]
        if name not in self._enabled:
            raise UnknownGraphError(f"no graph {name!r} in this context; its graphs are {self.graph_names}")
        if self._file is None:
            raise ContextStateError(f"graph {name!r} is not finalized yet; call finalize() first")
        model = _parse_skeleton(self._file, name)
        self._skeletons[name] = model
        entry = self._file.graphs[name]
        # Every initializer, stored or inline, is a static tensor of the graph.
        static = tuple(
            TensorInfo(
                t.name,
                dtypes.name_of_onnx(t.data_type),
                tuple(t.dims),
                TensorType.UPDATEABLE_STATIC if t.name in entry.updateable else TensorType.STATIC,
            )
            for t in model.graph.initializer
        )
        # Updateable tensors are fed to the backend with each run: replacing them never rebuilds it.
        self._current[name] = {t: self._weight_view(entry.weights[t]) for t in entry.updateable}
        graph = Graph(
            self,
            name,
            tuple(info_of_value(v, TensorType.APP_WRITE) for v in model.graph.input),
            tuple(info_of_value(v, TensorType.APP_READ) for v in model.graph.output),
            static,
        )
        self._graphs[name] = graph
        return graph

    def graphs(self) -> Iterable[Graph]:
        return (self.graph(name) for name in self._enabled)

    def _encodings(self, name: str) -> EncodingSet:
        """The encodings of a graph's quantized tensors, from the values in use now (sections included)."""
        self.graph(name)
        assert self._file is not None
        skeleton, entry, current = self._skeletons[name], self._file.graphs[name], self._current[name]
        inline = {t.name: t for t in skeleton.graph.initializer if t.name not in entry.weights}

        def value_of(tensor: str) -> np.ndarray | None:
            if tensor in current:
                return current[tensor]
            if tensor in entry.weights:
                return self._weight_view(entry.weights[tensor])
            return numpy_helper.to_array(inline[tensor]) if tensor in inline else None

        constants = {*current, *entry.weights, *inline}
        return graph_encodings(skeleton, constants, value_of)

    def _weight_view(self, index: int) -> np.ndarray:
        if index not in self._weight_views:
            assert self._file is not None
            self._weight_views[index] = self._file.weight_array(index)
        return self._weight_views[index]

    def _executable(self, name: str) -> Executable:
        """The backend state of a graph, prepared on first use; evicts least recently used graphs over the hint."""
        if name in self._live:
            self._live.move_to_end(name)
            return self._live[name]
        graph = self.graph(name)
        assert self._file is not None
        entry = self._file.graphs[name]
        weights = {t: self._weight_view(i) for t, i in entry.weights.items() if t not in entry.updateable}
        model = self._skeletons[name]
        if entry.updateable:  # fed with each run, so replacing them never rebuilds the backend state
            model = initializers_as_inputs(model, entry.updateable)
        executable = self._backend.prepare(
            FinalizedGraph(name, model, weights, graph.inputs, graph.outputs, self._file.file_backed)
        )
        self._live[name] = executable
        self._evict_over_limit()
        return executable

    def _evict_over_limit(self) -> None:
        if self.memory_limit_hint_mb is None:
            return
        limit = self.memory_limit_hint_mb * 1024 * 1024
        while len(self._live) > 1 and sum(e.private_bytes for e in self._live.values()) > limit:
            _, oldest = self._live.popitem(last=False)
            oldest.release()

    def wait_until_ready(self) -> None:
        """Blocks until the live graphs' background preparation (e.g. weight packing) is done."""
        for executable in list(self._live.values()):
            executable.wait_until_ready()

    @property
    def live_graphs(self) -> list[str]:
        """Graphs whose backend state is prepared, least recently used first."""
        return list(self._live)

    def release_graph(self, name: str) -> None:
        """Drops a graph's backend state; it is prepared again on next use."""
        executable = self._live.pop(name, None)
        if executable is not None:
            executable.release()

    # --- updateable tensors and binary sections ----------------------------------------------------
    def _stage(self, updates: Mapping[str, Mapping[str, object]]) -> None:
        """Stages updates per graph, all checked first: one refused update stages nothing."""
        for graph in updates:
            self.graph(graph)  # known, enabled, finalized
        checked = {graph: sections.checked_update(self.file, graph, values) for graph, values in updates.items()}
        for graph, values in checked.items():
            self._staged.setdefault(graph, {}).update(values)

    def _apply_staged(self, graphs: Sequence[str]) -> None:
        for graph in graphs:
            self._current[graph] = {**self._current[graph], **self._staged.pop(graph, {})}

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
        return sections.write_section(self.file, self._current, names, metadata)

    def apply_binary_section(
        self,
        graph: str | Graph | None,
        section: str | Path | bytes | bytearray | memoryview | SectionFile,
    ) -> SectionFile:
        """Binds a section's tensors (QnnContext_applyBinarySection): O(tensors), no copy of their bytes.

        `graph=None` applies it to every graph it covers. A section made for another context, for other
        graphs or tensors, or damaged, is refused and nothing changes.
        """
        loaded = sections.load_section(section)
        targets = list(loaded.graphs) if graph is None else [_graph_name(graph)]
        for name in targets:
            self.graph(name)  # every graph it would change must be one this context offers
        bound = sections.bind_section(self.file, loaded, targets)
        strengths = LoraStrengths.from_metadata(loaded.metadata)
        for name, values in bound.items():  # every check passed: now swap
            self._current[name] = {**self._current[name], **values}
            self._staged.pop(name, None)
            if strengths is not None:
                self._lora[name] = strengths.copy()
        return loaded

    # --- facts ------------------------------------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        self.finalize()
        assert self._file is not None
        return self._file.size

    def weight_stats(self) -> WeightStats:
        self.finalize()
        assert self._file is not None
        referenced = [i for name in self._file.graphs for i in self._file.graphs[name].weights.values()]
        return WeightStats(
            unique_bytes=sum(w.length for w in self._file.weights),
            referenced_bytes=sum(self._file.weights[i].length for i in referenced),
            unique_count=len(self._file.weights),
            referenced_count=len(referenced),
        )

    @property
    def file(self) -> ContextFile:
        """The underlying validated binary (for inspection tools)."""
        self.finalize()
        assert self._file is not None
        return self._file

    def close(self) -> None:
        for name in list(self._live):
            self.release_graph(name)
        self._weight_views.clear()
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "finalized" if self.finalized else "building"
        return f"Context({state}, backend={self.backend_name!r}, graphs={self.graph_names})"

"""The cpu backend: ONNX Runtime's CPU execution provider over the context's mapped weights, without copies."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from quiver.backends.base import FinalizedGraph
from quiver.errors import BackendError
from quiver.formats._layout import WEIGHT_LOCATION

# ORT insists that an external-data initializer's file exists even when `add_initializer` supplies the data,
# so placeholders name this empty file. ORT executes on the supplied arrays and never reads it, unless one
# of its graph optimizers wants a weight's bytes; then the session is made again with in-memory files.
_PLACEHOLDER_FOLDER = str(Path(__file__).with_name("_ort_folder"))
_EXTERNAL_READ_FAILURE = "can not be read in full"

_PREPACKED_OPS = {"MatMul", "Gemm"}


def _prepacked_bytes(graph: FinalizedGraph) -> int:
    """Bytes ORT copies when it prepacks constant MatMul/Gemm weights (one packed copy per session)."""
    names = {
        node.input[1]
        for node in graph.model.graph.node
        if node.op_type in _PREPACKED_OPS and node.domain in ("", "ai.onnx") and len(node.input) > 1
    }
    return sum(graph.weights[n].nbytes for n in names if n in graph.weights)


def _with_in_memory_weights(graph: FinalizedGraph, options: ort.SessionOptions) -> onnx.ModelProto:
    """Points each placeholder at an in-memory "file" holding the weight's mapped bytes.

    ORT's graph optimizers (constant folding, fusions) read initializers through the TensorProto, not
    through `add_initializer`; this lets them see the real bytes. It costs ORT a read of every weight.
    """
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    locations: dict[int, str] = {}
    buffers: list[np.ndarray] = []
    for tensor in model.graph.initializer:
        array = graph.weights.get(tensor.name)
        if array is None:
            continue
        if id(array) not in locations:
            locations[id(array)] = f"{WEIGHT_LOCATION}-{len(locations)}"
            buffers.append(array)
        del tensor.external_data[:]
        for key, value in (("location", locations[id(array)]), ("offset", "0"), ("length", str(array.nbytes))):
            tensor.external_data.add(key=key, value=value)
    if buffers:
        options.add_external_initializers_from_files_in_memory(
            list(locations.values()), buffers, [b.nbytes for b in buffers]
        )
    return model


class CpuExecutable:
    def __init__(self, graph: FinalizedGraph, backend: CpuBackend) -> None:
        self._output_names = [o.name for o in graph.outputs]
        # The OrtValues wrap the read-only mapped arrays; they must outlive the session.
        self._ort_values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in graph.weights.items()}
        self._prepacked = _prepacked_bytes(graph) if backend.prepack else 0
        try:
            self._session: ort.InferenceSession | None = self._create(graph, backend, in_memory=False)
        except Exception as exc:
            if _EXTERNAL_READ_FAILURE not in str(exc):
                raise BackendError(f"cpu backend (ONNX Runtime) cannot prepare graph {graph.name!r}: {exc}") from None
            try:
                self._session = self._create(graph, backend, in_memory=True)
            except Exception as exc:
                raise BackendError(f"cpu backend (ONNX Runtime) cannot prepare graph {graph.name!r}: {exc}") from None

    def _create(self, graph: FinalizedGraph, backend: CpuBackend, in_memory: bool) -> ort.InferenceSession:
        options = backend.session_options()
        for name, value in self._ort_values.items():
            options.add_initializer(name, value)
        model = _with_in_memory_weights(graph, options) if in_memory else graph.model
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if self._session is None:
            raise BackendError("this executable was released; prepare the graph again")
        try:
            return list(self._session.run(self._output_names, dict(feeds)))
        except Exception as exc:
            raise BackendError(f"cpu backend (ONNX Runtime) failed: {exc}") from None

    @property
    def private_bytes(self) -> int:
        return self._prepacked

    def release(self) -> None:
        self._session = None
        self._ort_values = {}


class CpuBackend:
    """ONNX Runtime CPU EP.

    `prepack=True` (default) lets ORT repack MatMul/Gemm weights for speed: each live graph then holds
    a private packed copy of those weights. `prepack=False` keeps every weight only in the mapping
    (each added graph costs its unique bytes) at a latency cost; docs/BENCHMARKS.md has both.
    """

    name = "cpu"

    def __init__(
        self,
        intra_op_num_threads: int = 0,
        prepack: bool = True,
        graph_optimization_level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    ) -> None:
        self.intra_op_num_threads = intra_op_num_threads
        self.prepack = prepack
        self.graph_optimization_level = graph_optimization_level

    def session_options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_num_threads
        options.graph_optimization_level = self.graph_optimization_level
        options.log_severity_level = 3  # errors only: ORT's warnings about old opsets are not the user's business
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", _PLACEHOLDER_FOLDER)
        if not self.prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        return options

    def prepare(self, graph: FinalizedGraph) -> CpuExecutable:
        for tensor in graph.model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.name not in graph.weights:
                raise BackendError(f"graph {graph.name!r}: no weight supplied for initializer {tensor.name!r}")
        return CpuExecutable(graph, self)

"""ONNX Runtime's optimized form of a graph, made when a context is built, so opening skips ORT's fusions.

ORT spends most of a session's creation on its graph transformers (on MiniLM, ~4.5 of ~9 ms). Quiver
runs them once, at build, at ORT's "extended" level (the fusions that do not depend on the processor),
and stores the optimized skeleton next to the portable one, its weights mapped to the context's own
(a fusion's new tensors, such as a constant-folded slice, are stored too, within a small budget). A
session made from it still runs at the configured level, so the processor-specific "all" transformers
run where the graph is opened. It is used only by the ORT version that made it, and only for the same
session model: anywhere else the portable skeleton is prepared as before. A graph with no layout-sensitive
node is then opened with ORT's optimizers off: what they would do was done at build.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from quiver.backends.base import FinalizedGraph, PreparedGraph
from quiver.formats._layout import INLINE_LIMIT, WEIGHT_LOCATION
from quiver.ir import dtypes
from quiver.ir.proto import ModelProto, TensorProto

RUNTIME = f"onnxruntime {ort.__version__}"
# What a prepared form may add to the context (its skeleton and the new tensors of its fusions), as a
# share of the graph's weight bytes: more, and the form is not kept. A fusion that rewrites weights (ORT's
# 8-bit MatMulNBits fusion) would store them twice, and a small quantized graph's skeleton (its scales
# inline) weighs as much as a tenth of its weights: both are left to the open, as before.
_ADDED_BYTES_BUDGET = 0.01
_EXTENDED = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED


def source_digest(model: bytes, accuracy_level: int) -> str:
    """What a prepared form was made from: the session model and the setting that changes ORT's fusions."""
    return hashlib.sha256(model + f"\0accuracy_level={accuracy_level}".encode()).hexdigest()


def usable_form(graph: FinalizedGraph, source: str, level: ort.GraphOptimizationLevel) -> PreparedGraph | None:
    """The graph's prepared form for this ORT and this session model, if it has one and `level` runs at
    least the transformers it already ran."""
    if int(level) < int(_EXTENDED):
        return None
    return next((f for f in graph.prepared if f.runtime == RUNTIME and f.source == source), None)


# The nodes ORT's layout transformers (the "all" level beyond "extended": NCHWc and NHWC layouts, and the
# Conv + Add + activation fusion) start from. A prepared form without any has nothing left for ORT to
# optimize at open, so its sessions skip the transformers' passes (~1.5 ms on MiniLM, measured).
_LAYOUT_OPS = frozenset(
    {"AveragePool", "BatchNormalization", "Conv", "ConvInteger", "ConvTranspose", "FusedConv", "GlobalAveragePool",
     "GlobalLpPool", "GlobalMaxPool", "LpPool", "MaxPool", "NhwcConv", "QLinearAveragePool", "QLinearConv",
     "QLinearGlobalAveragePool", "Resize", "Upsample"}
)  # fmt: skip


def open_level(model: ModelProto, level: str) -> str:
    """The optimization level (a SessionSettings name) a session over the prepared `model` is made at."""
    return level if any(node.op_type in _LAYOUT_OPS for node in model.graph.node) else "disabled"


def prepare(
    graph: FinalizedGraph, model: bytes, source: str, config: Mapping[str, str], log_severity: int
) -> PreparedGraph | None:
    """ORT's "extended" optimization of `model` (the session model of `graph`), its large initializers
    mapped back to the graph's weights; None if ORT cannot save it or it would add too many bytes."""
    with tempfile.TemporaryDirectory(prefix="quiver-prepare-") as folder:
        target = Path(folder) / "prepared.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = _EXTENDED
        options.intra_op_num_threads = 1
        options.log_severity_level = log_severity
        options.optimized_model_filepath = str(target)
        entries = {
            **config,
            "session.disable_prepacking": "1",
            "session.optimized_model_external_initializers_file_name": "prepared.data",
            "session.optimized_model_external_initializers_min_size_in_bytes": str(INLINE_LIMIT),
        }
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        # every weight readable: the optimizers may fold or fuse any of them, as they do on a plain .onnx
        values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in graph.weights.items()}
        if values:
            options.add_external_initializers(list(values), list(values.values()))
        try:
            ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            prepared = ModelProto.FromString(target.read_bytes())
        except Exception:  # noqa: BLE001 - what ORT cannot prepare now it prepares at open, as before
            return None
        data_path = Path(folder) / "prepared.data"  # absent when no initializer is large enough to go there
        size = data_path.stat().st_size if data_path.exists() else 0
        with open(data_path if size else os.devnull, "rb") as file:
            data = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) if size else b""
            weights = _map_weights(prepared, data, graph.weights)
            del data
    if weights is None:
        return None
    stored = {id(array) for array in graph.weights.values()}
    added = prepared.ByteSize() + sum(a.nbytes for a in weights.values() if id(a) not in stored)
    if added > _ADDED_BYTES_BUDGET * sum(a.nbytes for a in graph.weights.values()):
        return None
    return PreparedGraph(RUNTIME, source, lambda: prepared, weights)


def _map_weights(
    prepared: ModelProto, data: mmap.mmap | bytes, originals: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray] | None:
    """The prepared model's external initializers as the graph's own weight arrays where ORT left the
    bytes as they were (whatever it named them) or as new arrays; each becomes a placeholder."""
    by_layout: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}
    for array in originals.values():
        by_layout.setdefault((array.dtype.str, array.shape), []).append(array)
    weights: dict[str, np.ndarray] = {}
    for tensor in prepared.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        where = {entry.key: entry.value for entry in tensor.external_data}
        offset, length = int(where.get("offset", 0)), int(where["length"])
        try:
            dtype = dtypes.numpy_of(dtypes.name_of_onnx(tensor.data_type))
        except Exception:  # noqa: BLE001 - a type Quiver does not store as a weight
            return None
        shape = tuple(tensor.dims)
        if dtype.itemsize * int(np.prod(shape, dtype=np.int64)) != length or offset + length > len(data):
            return None  # packed sub-byte types: not stored this way
        raw = np.frombuffer(data, np.uint8, length, offset)
        candidates = by_layout.get((dtype.str, shape), [])
        named = originals.get(tensor.name)
        if named is not None:
            candidates = [named, *candidates]
        same = next((a for a in candidates if np.array_equal(a.reshape(-1).view(np.uint8), raw)), None)
        weights[tensor.name] = raw.copy().view(dtype).reshape(shape) if same is None else same
        del tensor.external_data[:]
        tensor.external_data.add(key="location", value=WEIGHT_LOCATION)
    return weights

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
import os
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from quiver.backends.base import AheadOfTimeForm, FinalizedGraph, PreparedGraph, WeightFile
from quiver.backends.cpu.capi import fork_waits
from quiver.backends.cpu.native_ops import register_python
from quiver.formats.layout import INLINE_LIMIT, WEIGHT_LOCATION
from quiver.ir import dtypes, proto
from quiver.ir.edit import iter_nodes
from quiver.ir.quiver_ops import QUIVER_DOMAIN
from quiver.ort_package import onnxruntime as ort

RUNTIME = f"onnxruntime {ort.__version__}"
# What a prepared form may add to the context (its skeleton and the new tensors of its fusions), as a
# share of the graph's weight bytes: more, and the form is not kept. A fusion that rewrites weights (ORT's
# 8-bit MatMulNBits fusion, on pairs `quiver build` has not rewritten itself) would store them twice, and
# a small quantized graph's skeleton (its scales inline) weighs as much as a tenth of its weights: both
# are left to the open, as before.
_ADDED_BYTES_BUDGET = 0.01
# ORT writes the optimized graph's every weight out again while it prepares it (a copy of this size in the
# system's temporary folder, for as long as the preparation takes). Larger graphs are prepared at open.
_LARGEST_PREPARED = 4 << 30
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


def open_level(model: proto.ModelProto, level: str) -> str:
    """The optimization level (a SessionSettings name) a session over the prepared `model` is made at."""
    return level if any(node.op_type in _LAYOUT_OPS for node in iter_nodes(model.graph)) else "disabled"


def prepare(
    model: proto.ModelProto, stored: WeightFile, source: str, config: Mapping[str, str], log_severity: int
) -> AheadOfTimeForm | None:
    """ORT's "extended" optimization of `model` (a graph's session model), its large initializers mapped
    back to the graph's weights; None if ORT cannot save it or it would add too many bytes.

    ORT reads the weights from the file being written, as external data of a copy of `model` (given as
    arrays instead, ORT copies them all: measured, 2.5x the model's size in memory at build).
    """
    import tempfile  # building only: opening a context does not pay for it (~3 ms of imports)

    if sum(where.length for where in stored.weights.values()) > _LARGEST_PREPARED:
        return None
    readable = proto.ModelProto()
    readable.CopyFrom(model)
    layouts = {}
    for tensor in readable.graph.initializer:
        where = stored.weights.get(tensor.name)
        if tensor.data_location == proto.TensorProto.EXTERNAL and where is not None:
            layouts[tensor.name] = (tensor.data_type, tuple(tensor.dims))
            del tensor.external_data[:]
            for key, value in (("location", stored.path.name), ("offset", where.offset), ("length", where.length)):
                tensor.external_data.add(key=key, value=str(value))
    with tempfile.TemporaryDirectory(prefix="quiver-prepare-") as folder:
        target = Path(folder) / "prepared.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = _EXTENDED
        options.intra_op_num_threads = 1
        options.log_severity_level = log_severity
        options.optimized_model_filepath = str(target)
        entries = {
            **config,
            "session.model_external_initializers_file_folder_path": str(stored.path.parent),
            "session.disable_prepacking": "1",
            "session.optimized_model_external_initializers_file_name": "prepared.data",
            "session.optimized_model_external_initializers_min_size_in_bytes": str(INLINE_LIMIT),
        }
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        skeleton = readable.SerializeToString()
        register_python(options, skeleton)
        try:
            with fork_waits():  # a server may build contexts on a thread while another forks
                ort.InferenceSession(skeleton, options, providers=["CPUExecutionProvider"])
            prepared = _without_unused_quiver_opset(proto.ModelProto.FromString(target.read_bytes()))
        except Exception:  # noqa: BLE001 - what ORT cannot prepare now it prepares at open, as before
            return None
        data_path = Path(folder) / "prepared.data"  # absent when no initializer is large enough to go there
        budget = _ADDED_BYTES_BUDGET * sum(w.length for w in stored.weights.values()) - prepared.ByteSize()
        if budget < 0:
            return None  # its skeleton alone weighs too much (a small quantized graph's, scales inline)
        with open(data_path if data_path.exists() else os.devnull, "rb") as data, open(stored.path, "rb") as weights:
            mapped = _map_weights(prepared, data, _Originals(weights, stored, layouts), budget)
    if mapped is None:
        return None
    reused, added = mapped
    return AheadOfTimeForm(RUNTIME, source, prepared, reused, added)


def _without_unused_quiver_opset(model: proto.ModelProto) -> proto.ModelProto:
    """ORT writes the opset of every custom-op domain its process has met into an optimized model: a graph
    without Quiver's own operators keeps no `ai.quiver` import (its form is the same whatever ran before)."""
    if any(o.domain == QUIVER_DOMAIN for o in model.opset_import) and not any(
        node.domain == QUIVER_DOMAIN for node in iter_nodes(model.graph)
    ):
        kept = [o for o in model.opset_import if o.domain != QUIVER_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return model


class _Originals:
    """The graph's weights in the file being written: found by name, or by content where ORT renamed one."""

    def __init__(self, file: BinaryIO, stored: WeightFile, layouts: Mapping[str, tuple[int, tuple[int, ...]]]) -> None:
        self._file, self._stored, self._layouts = file, stored, layouts
        self._by_sha = {where.sha256: name for name, where in stored.weights.items() if name in layouts}

    def same_as(self, name: str, layout: tuple[int, tuple[int, ...]], data: bytes) -> str | None:
        """The original initializer holding exactly `data` with this (ONNX type, dims), if any."""
        candidate = name if name in self._layouts else self._by_sha.get(hashlib.sha256(data).hexdigest())
        if candidate is None or self._layouts[candidate] != layout:
            return None
        where = self._stored.weights[candidate]
        same = where.length == len(data) and os.pread(self._file.fileno(), where.length, where.offset) == data
        return candidate if same else None


def _map_weights(
    prepared: proto.ModelProto, data: BinaryIO, originals: _Originals, budget: float
) -> tuple[dict[str, str], dict[str, np.ndarray]] | None:
    """The prepared model's external initializers as the graph's own weights where ORT left their bytes
    as they were, or as new tensors (None once those pass `budget` bytes); each becomes a placeholder.
    Tensors are read one at a time, not mapped: a build's memory stays bounded by one model plus a tensor."""
    size = os.fstat(data.fileno()).st_size
    reused: dict[str, str] = {}
    added: dict[str, np.ndarray] = {}
    for tensor in prepared.graph.initializer:
        if tensor.data_location != proto.TensorProto.EXTERNAL:
            continue
        where = {entry.key: entry.value for entry in tensor.external_data}
        offset, length = int(where.get("offset", 0)), int(where["length"])
        try:
            dtype = dtypes.numpy_of(dtypes.name_of_onnx(tensor.data_type))
        except Exception:  # noqa: BLE001 - a type Quiver does not store as a weight
            return None
        shape = tuple(tensor.dims)
        if dtype.itemsize * int(np.prod(shape, dtype=np.int64)) != length or offset + length > size:
            return None  # packed sub-byte types: not stored this way
        raw = os.pread(data.fileno(), length, offset)
        same = originals.same_as(tensor.name, (tensor.data_type, shape), raw)
        if same is None:
            budget -= length
            if budget < 0:
                return None  # a fusion that rewrites weights: not worth storing them twice
            added[tensor.name] = np.frombuffer(raw, dtype).reshape(shape)
        else:
            reused[tensor.name] = same
        del tensor.external_data[:]
        tensor.external_data.add(key="location", value=WEIGHT_LOCATION)
    return reused, added

"""ONNX model -> Quiver graph: inline, check operators, fix shapes, fold, infer shapes, split weights out."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.inliner
from onnx import numpy_helper

from quiver.errors import ConversionError, UnsupportedOperatorError
from quiver.formats.layout import INLINE_LIMIT
from quiver.ir.deferred import Deferred
from quiver.ir.edit import initializers_as_inputs
from quiver.ir.ops import iter_nodes, schema_checkable, unsupported_operators
from quiver.ir.tensors import TensorInfo, TensorType, info_of_value
from quiver.passes.fold import fold_constants
from quiver.passes.load import TensorSource, load_model, placeholder, tensor_source
from quiver.passes.nbits import to_matmul_nbits
from quiver.passes.quantized import weight_encodings
from quiver.passes.transposed_weights import fuse_transposed_weights

InputShapes = Mapping[str, Sequence[int | str]]


@dataclass
class ConvertedGraph:
    """A graph's structure (large initializers as data-less placeholders) plus where their bytes are."""

    skeleton: onnx.ModelProto
    weights: dict[str, TensorSource]
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    folded_nodes: int = 0
    encodings: dict[str, dict[str, Any]] = field(default_factory=dict)  # quantized weights: how they are read


def check_operators(model: onnx.ModelProto, label: str = "model") -> None:
    """Raises one error naming every unsupported operator of the model."""
    missing = unsupported_operators(model)
    if missing:
        listed = ", ".join(f"{op} (x{count})" for op, count in sorted(missing.items()))
        raise UnsupportedOperatorError(
            f"{label} uses operators Quiver does not support: {listed}; replace them before export "
            "or run `quiver check` for the full list",
            sorted(missing),
        )


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """A Constant node's value as an initializer named after its output (None: a sparse or string form)."""
    attr = node.attribute[0] if len(node.attribute) == 1 else None
    if attr is None:
        return None
    if attr.name == "value":  # a sparse tensor under this name (some exporters write one) stays a node
        if attr.type != onnx.AttributeProto.TENSOR:
            return None
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attr.t)  # as it is: no round trip through numpy
        tensor.name = node.output[0]
        return tensor
    simple = {
        "value_float": (attr.f, np.float32),
        "value_floats": (list(attr.floats), np.float32),
        "value_int": (attr.i, np.int64),
        "value_ints": (list(attr.ints), np.int64),
    }
    if attr.name in simple:
        value, dtype = simple[attr.name]
        return numpy_helper.from_array(np.asarray(value, dtype=dtype), node.output[0])
    return None


def _is_small(tensor: onnx.TensorProto) -> bool:
    length = len(tensor.raw_data) if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).nbytes
    return length < INLINE_LIMIT


def _lift_constants(graph: onnx.GraphProto, into: onnx.GraphProto | None = None) -> None:
    """Constant nodes become initializers of the main graph, so large ones are shared like any weight.

    In a subgraph (an If branch, a Loop or Scan body: silero-vad keeps all its weights there) only
    large ones move, and only where their name is new: the subgraph reads them from the outer scope.
    """
    main = into if into is not None else graph
    # taken: names already outer ones, or this subgraph's outputs (an output stays the subgraph's own)
    taken = {t.name for t in main.initializer} | {o.name for o in graph.output} if into is not None else set()
    kept = []
    for node in graph.node:
        tensor = _constant_tensor(node) if node.op_type == "Constant" and node.domain in ("", "ai.onnx") else None
        if into is not None and tensor is not None and (node.output[0] in taken or _is_small(tensor)):
            tensor = None
        if tensor is None:
            kept.append(node)
        else:
            main.initializer.append(tensor)
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                _lift_subgraph_initializers(sub, main)
                _lift_constants(sub, main)
    del graph.node[:]
    graph.node.extend(kept)


def _lift_subgraph_initializers(graph: onnx.GraphProto, main: onnx.GraphProto) -> None:
    """A subgraph's large initializers move to the main graph (read from the outer scope), to be shared."""
    taken = {t.name for t in main.initializer}
    kept = []
    for tensor in graph.initializer:
        if tensor.name not in taken and not _is_small(tensor):
            main.initializer.append(tensor)
        else:
            kept.append(tensor)
    del graph.initializer[:]
    graph.initializer.extend(kept)


def fix_input_shapes(graph: onnx.GraphProto, input_shapes: InputShapes) -> None:
    """Gives the named inputs of `graph` these shapes (a str dim stays symbolic), checking names and ranks."""
    inputs = {i.name: i for i in graph.input}
    for name, dims in input_shapes.items():
        if name not in inputs:
            raise ConversionError(f"cannot fix the shape of {name!r}: the graph's inputs are {sorted(inputs)}")
        shape = inputs[name].type.tensor_type.shape
        if shape.dim and len(shape.dim) != len(dims):
            raise ConversionError(
                f"input {name!r} has rank {len(shape.dim)}; the fixed shape {list(dims)} has rank {len(dims)}"
            )
        del shape.dim[:]
        for d in dims:
            shape.dim.add(**({"dim_value": d} if isinstance(d, int) else {"dim_param": str(d)}))


def _negative_dims_as_dynamic(graph: onnx.GraphProto) -> None:
    """A negative dim (Paddle exports declare `[-1, 3, -1, -1]`) is dynamic to ONNX Runtime: make it an
    unknown dim, as ORT reads it, so that shape inference and every run take any size there."""
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.HasField("dim_value") and dim.dim_value < 0:
                    dim.ClearField("dim_value")


def _is_placeholder(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _infer_shapes(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """Shape inference with data propagation; placeholders (data not at hand) are seen as typed inputs.

    onnx >= 1.18 tries to read an external initializer that data propagation reaches and fails on it.
    """
    probe = initializers_as_inputs(model, _is_placeholder)
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=True, data_prop=True)
    except Exception as exc:
        # onnx's inference of some function bodies (MeanVarianceNormalization's) fails where ORT runs the
        # model: what it cannot infer stays unknown, as ORT's own inference leaves it
        try:
            inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False, data_prop=True)
        except Exception:
            # value_info is the producer's hint, not the graph: some exporters write one that contradicts
            # what a node gives (onnxruntime-genai's builder: a rank-0 hint on a [1] Constant), which ORT
            # ignores; inferred again without the hints
            del probe.graph.value_info[:]
            try:
                inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False, data_prop=True)
            except Exception:
                raise ConversionError(f"{label}: shape inference failed: {str(exc).strip().splitlines()[-1]}") from None
    del inferred.graph.input[len(model.graph.input) :]
    del inferred.graph.initializer[:]
    inferred.graph.initializer.extend(model.graph.initializer)
    return inferred


def _strip_node_metadata(graph: onnx.GraphProto) -> None:
    """Exporters' per-node notes (dynamo: stack traces, module paths, FX nodes; ~0.5 MB for a small BERT)
    are for debugging the export; nothing runs on them, and every graph would store and parse its own."""
    for node in iter_nodes(graph):
        del node.metadata_props[:]
        node.doc_string = ""


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for node in iter_nodes(graph) for name in node.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


FOLD_INPUT_LIMIT = 4 * 1024 * 1024  # weights constant folding may read (a position table, position ids)


class _FoldableValues(dict):  # type: ignore[type-arg]
    """Small constants, plus weights up to FOLD_INPUT_LIMIT read on demand: a Slice of a position table
    under fixed shapes folds at build time instead of making ONNX Runtime read the weight at load."""

    def __init__(self, small: dict[str, np.ndarray], weights: dict[str, TensorSource]) -> None:
        super().__init__(small)
        self._weights = weights

    def __contains__(self, name: object) -> bool:
        source = self._weights.get(name) if isinstance(name, str) else None
        return super().__contains__(name) or (source is not None and source.nbytes <= FOLD_INPUT_LIMIT)

    def __missing__(self, name: str) -> np.ndarray:
        if name not in self:
            raise KeyError(name)
        value = self[name] = self._weights[name].to_array()
        return value


def convert(
    source: str | Path | onnx.ModelProto,
    input_shapes: InputShapes | None = None,
    label: str | None = None,
    updateable: Collection[str] = (),
    external_data_folder: Path | None = None,
    fold: bool = True,
    deferred: Mapping[str, Deferred] | None = None,
) -> ConvertedGraph:
    """Turns an ONNX file (with or without external data) or ModelProto into a Quiver graph.

    `updateable` names initializers that stay weights whatever their size (they can be replaced at
    run time), and that constant folding leaves alone. `external_data_folder`: where a ModelProto's
    external data lies (a file's is beside it). `fold=False` leaves constant subgraphs to the runtime
    (ONNX Runtime folds the same at its basic level, and none with its optimizations off). `deferred`: the
    values of the model's placeholders a streaming export made (`passes.load.deferred_placeholder`), made
    when the context stores them.
    """
    loaded, base = load_model(source, external_data_folder)
    label = label or (str(source) if not isinstance(source, onnx.ModelProto) else (loaded.graph.name or "model"))
    if isinstance(source, onnx.ModelProto):  # the caller's object: work on a copy
        model = onnx.ModelProto()
        model.CopyFrom(loaded)
    else:
        model = loaded
    if model.ir_version < 4:
        # IR 3 lists initializers as graph inputs; exporters of that age (and ORT) do not insist, and the
        # skeleton lists them as weights, never inputs: IR 4 is what it is, in every other respect the same.
        model.ir_version = 4
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    to_matmul_nbits(model, base, keep=updateable)  # before the dtype checks: 4-bit weights leave as packed uint8
    check_operators(model, label)
    graph = model.graph
    _negative_dims_as_dynamic(graph)
    _strip_node_metadata(graph)
    _lift_constants(graph)
    fuse_transposed_weights(model)

    weights: dict[str, TensorSource] = {}
    known: dict[str, np.ndarray] = {}
    inline = []
    for tensor in graph.initializer:
        src = tensor_source(tensor, base, deferred)
        if src.nbytes >= INLINE_LIMIT or tensor.name in updateable:
            weights[tensor.name] = src
            inline.append(placeholder(tensor.name, tensor.data_type, tensor.dims))
        else:  # small: inline in the skeleton (read from external data if it lives there)
            known[tensor.name] = array = src.to_array()
            inline.append(tensor if src.array is not None else numpy_helper.from_array(array, tensor.name))
    del graph.initializer[:]
    graph.initializer.extend(inline)
    missing = sorted(set(updateable) - set(weights))
    if missing:
        raise ConversionError(f"{label}: updateable tensors {missing} are not initializers of the model")
    # Initializers listed as inputs (IR < 4 style) are weights here, not inputs.
    initializer_names = {t.name for t in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in initializer_names]
    del graph.input[:]
    graph.input.extend(real_inputs)
    if input_shapes:
        fix_input_shapes(graph, input_shapes)

    model = _infer_shapes(model, label)
    foldable = _FoldableValues(known, {n: w for n, w in weights.items() if n not in updateable})
    folded = fold_constants(model, foldable) if fold else 0
    if folded:
        _drop_unused_initializers(model.graph)
        del model.graph.value_info[:]
        model = _infer_shapes(model, label)
    try:
        onnx.checker.check_model(  # placeholders' data is not on disk: let the checker see them as inputs
            schema_checkable(initializers_as_inputs(model, _is_placeholder))
        )
    except onnx.checker.ValidationError as exc:
        raise ConversionError(f"{label} is not a valid ONNX model: {str(exc).strip().splitlines()[0]}") from None
    kept_weights = {t.name for t in model.graph.initializer}
    constants = {t.name: t for t in model.graph.initializer}

    def value_of(name: str) -> np.ndarray | None:
        if name in weights:  # a deferred one is not made for its encoding: made once, when it is stored
            return weights[name].to_array() if weights[name].deferred is None else None
        return numpy_helper.to_array(constants[name]) if name in constants else None

    encodings = weight_encodings(model, set(weights) & kept_weights, value_of)
    return ConvertedGraph(
        skeleton=model,
        weights={name: src for name, src in weights.items() if name in kept_weights},
        inputs=[info_of_value(v, TensorType.APP_WRITE) for v in model.graph.input],
        outputs=[info_of_value(v, TensorType.APP_READ) for v in model.graph.output],
        folded_nodes=folded,
        encodings=encodings,
    )

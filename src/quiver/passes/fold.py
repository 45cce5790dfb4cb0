"""Constant folding where it is safe: small results of deterministic nodes whose inputs are all known."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from quiver.ir.ops import MS_DOMAIN

FOLD_LIMIT = 64 * 1024  # bytes; folding must never grow the model much
_NEVER_FOLD = {
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "Dropout",
    "If",
    "Loop",
    "Scan",
    "QuantizeLinear",
    "DequantizeLinear",
}


def _static_shape(value: onnx.ValueInfoProto | None) -> list[int] | None:
    if value is None or not value.type.tensor_type.HasField("shape"):
        return None
    dims = value.type.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return [d.dim_value for d in dims]


def fold_constants(model: onnx.ModelProto, known: dict[str, np.ndarray]) -> int:
    """Replaces foldable nodes of the main graph by initializers; `known` holds small constant values.

    Returns the number of nodes folded. Shape nodes over fully static inputs are folded too, which is
    what makes fixed-shape graphs lose their shape arithmetic.
    """
    graph = model.graph
    value_info = {v.name: v for v in list(graph.value_info) + list(graph.input) + list(graph.output)}
    graph_outputs = {o.name for o in graph.output}
    opsets = list(model.opset_import)
    kept, folded = [], 0
    for node in graph.node:
        values = _try_fold(node, known, value_info, opsets)
        if values is None or any(name in graph_outputs for name in node.output):
            kept.append(node)
            continue
        for name, value in zip(node.output, values):
            known[name] = value
            graph.initializer.append(numpy_helper.from_array(value, name))
        folded += 1
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
    return folded


def _try_fold(
    node: onnx.NodeProto,
    known: dict[str, np.ndarray],
    value_info: dict[str, onnx.ValueInfoProto],
    opsets: list[onnx.OperatorSetIdProto],
) -> list[np.ndarray] | None:
    if node.domain in (MS_DOMAIN,) or node.op_type in _NEVER_FOLD or not node.output:
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    if node.op_type == "Shape" and len(node.input) == 1:
        shape = _static_shape(value_info.get(node.input[0]))
        if shape is None:
            return None
        bounds = {a.name: int(a.i) for a in node.attribute}  # opset 15: start/end, Python-slice style
        return [np.asarray(shape[bounds.get("start", 0) : bounds.get("end", len(shape))], dtype=np.int64)]
    inputs = [name for name in node.input if name]
    if not inputs or any(name not in known for name in inputs):
        return None
    single = onnx.helper.make_model(
        onnx.helper.make_graph(
            [node],
            "fold",
            [
                onnx.helper.make_tensor_value_info(
                    n, onnx.helper.np_dtype_to_tensor_dtype(known[n].dtype), known[n].shape
                )
                for n in dict.fromkeys(inputs)
            ],
            [onnx.helper.make_empty_tensor_value_info(o) for o in node.output if o],
        ),
        opset_imports=opsets,
    )
    try:
        from onnx.reference import ReferenceEvaluator  # 20 ms to import: only when something folds

        results = ReferenceEvaluator(single).run(None, {n: known[n] for n in inputs})
    except Exception:
        return None  # not foldable here; the backend will compute it
    arrays = [np.asarray(r) for r in results]
    if (
        len(arrays) != len(node.output)
        or sum(a.nbytes for a in arrays) > FOLD_LIMIT
        or any(a.dtype == object for a in arrays)
    ):
        return None
    return arrays

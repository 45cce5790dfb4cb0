"""Small structural edits of ONNX models that several layers need."""

from __future__ import annotations

from collections.abc import Callable, Collection

import onnx


def initializers_as_inputs(
    model: onnx.ModelProto, names: Collection[str] | Callable[[onnx.TensorProto], bool]
) -> onnx.ModelProto:
    """A copy in which the chosen initializers (by name, or by predicate) are typed graph inputs instead."""
    chosen = names if callable(names) else (lambda tensor: tensor.name in names)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    moved = [t for t in graph.initializer if chosen(t)]
    kept = [t for t in graph.initializer if not chosen(t)]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in moved)
    return copy

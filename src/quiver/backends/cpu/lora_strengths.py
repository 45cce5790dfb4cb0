"""LoRA strengths folded into the up-projection weights, so ORT runs a branch as two MatMuls and an Add.

A LoRA graph scales each rank column by its adapter's strength: ``Mul(x·Aᵀ, Gather(lora_alpha, index))``,
then multiplies by B. Scaling the columns of x·Aᵀ equals scaling the rows of B, and B, the index and
the strengths change only when a section is applied or a strength is set, not from run to run. So the
cpu backend hands ORT B with its rows already scaled and drops the Gather and the Mul: two small nodes
per branch, about 1 % of a run of the benchmark transformer. The reference backend runs the graph
as written.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from quiver.errors import BackendError
from quiver.ir import proto

_FOLDED_SUFFIX = ".scaled_by_strength"
_RECENT = 8  # adapter/strength combinations whose scaled weights are kept


@dataclass(frozen=True)
class _Fold:
    """One branch: `weight` (B, updateable) scaled along `axis` by `strengths[index]` becomes `folded`."""

    weight: str
    index: str
    strengths: str
    axis: int  # 0: a MatMul's B [R, out]; 1: a 1x1 Conv's B [out, R, 1, 1]
    folded: str


class StrengthFolding:
    """The folded branches of one graph, and the scaled weights for the values a run is given."""

    def __init__(self, folds: list[_Fold], constants: Mapping[str, np.ndarray], dropped: set[str]) -> None:
        self._folds = folds
        self._constants = constants  # index vectors that are initializers, not updateable
        self._dropped = dropped  # inputs no node of the rewritten graph reads
        self._watched = list(dict.fromkeys(n for f in folds for n in (f.weight, f.index, f.strengths)))
        self._strength_inputs = {f.strengths for f in folds}
        # key -> (what the key's identities refer to (kept alive, so the ids stay theirs), the bound values
        # for the rewritten graph), the few most recent: switching back to an adapter scales nothing
        # again. Entries are replaced whole, so concurrent runs each use a consistent set.
        self._cache: OrderedDict[tuple[object, ...], tuple[list[np.ndarray], dict[str, np.ndarray]]] = OrderedDict()
        self._lock = threading.Lock()

    def apply(
        self, feeds: Mapping[str, np.ndarray], bound: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The feeds and bound values for the rewritten graph: folded weights join the bound ones.

        The bound values come back as the same dict while nothing changes, so the session can reuse
        what it built for them. Bound arrays stay the same objects until a section is applied or a
        strength set: they are compared by identity. Fed strengths are often new arrays with the same
        values: they are compared by value.
        """
        held = [*bound.values()]
        fed = tuple(feeds[n].tobytes() for n in self._watched if n in feeds)
        # strengths by value (each applied section brings a new vector), everything else by identity
        key = (*bound, *(v.tobytes() if n in self._strength_inputs else id(v) for n, v in bound.items()), *fed)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
        if entry is None:
            values = {**bound, **feeds}
            try:
                scaled = {fold.folded: self._scaled(fold, values) for fold in self._folds}
            except IndexError:
                raise BackendError(
                    "a LoRA adapter index points past the strengths vector; the section does not fit this graph"
                ) from None
            entry = (held, {n: v for n, v in bound.items() if n not in self._dropped} | scaled)
            with self._lock:
                self._cache[key] = entry
                while len(self._cache) > _RECENT:
                    self._cache.popitem(last=False)
        return {n: v for n, v in feeds.items() if n not in self._dropped}, entry[1]

    def _scaled(self, fold: _Fold, values: Mapping[str, np.ndarray]) -> np.ndarray:
        weight = values[fold.weight]
        index = values[fold.index] if fold.index in values else self._constants[fold.index]
        columns = np.take(values[fold.strengths], index).astype(weight.dtype)
        if np.all(columns == 1):
            return weight  # the common case (default strength 1): bind the section's tensor itself
        shape = [1] * weight.ndim
        shape[fold.axis] = -1
        return weight * columns.reshape(shape)


def fold_lora_strengths(model: proto.ModelProto) -> tuple[proto.ModelProto, StrengthFolding | None]:
    """The model with every foldable strength scaling removed, and how to make the scaled weights.

    Folds `Mul(xa, Gather(s, index))` -> `MatMul(·, B)` and `Mul(xa, Reshape(Gather(s, index)))` -> 1x1
    `Conv(·, B)`, where `s` and B are graph inputs (strengths and an updateable weight) and the Mul has
    no other reader. Anything else, quantized branches included, is left as it is.
    """
    graph = model.graph
    inputs = {value.name: value for value in graph.input}
    if not any(node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in inputs for node in graph.node):
        return model, None  # no strengths read from an input: not a LoRA graph (skip the maps on start-up)
    # inline ones only: a weight stored in the context is a data-less placeholder here
    initializers = {t.name: t for t in graph.initializer if t.data_location != proto.TensorProto.EXTERNAL}
    producers = {output: node for node in graph.node for output in node.output}
    readers: dict[str, list[proto.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}

    folds: list[_Fold] = []
    rewrites: dict[int, tuple[str, str]] = {}  # id(consumer) -> (new activation input, folded weight)
    removed: set[int] = set()
    for mul in graph.node:
        if mul.op_type != "Mul" or len(mul.input) != 2 or len(mul.output) != 1:
            continue  # (a malformed node is left for ONNX Runtime to refuse)
        if mul.output[0] in outputs or len(readers.get(mul.output[0], [])) != 1:
            continue
        consumer = readers[mul.output[0]][0]
        match = _strength_side(mul, producers, inputs, initializers)
        if match is None or consumer.input[0] != mul.output[0] or len(consumer.input) < 2:
            continue
        activation, scale_nodes, gather = match
        axis = _weight_axis(consumer, inputs)
        if axis is None or len(readers[consumer.input[1]]) != 1:
            continue  # a weight read twice would need two scaled copies under one name
        if not _fits(inputs[consumer.input[1]], axis, gather.input[1], inputs, initializers):
            continue
        folded = consumer.input[1] + _FOLDED_SUFFIX
        folds.append(_Fold(consumer.input[1], gather.input[1], gather.input[0], axis, folded))
        rewrites[id(consumer)] = (activation, folded)
        removed.add(id(mul))
        removed.update(id(node) for node in scale_nodes)
    if not folds:
        return model, None

    result = proto.ModelProto()
    result.CopyFrom(model)
    marked = []
    for original, node in zip(graph.node, result.graph.node):
        if id(original) in rewrites:
            node.input[0], node.input[1] = rewrites[id(original)]
        marked.append((id(original) in removed, node))
    nodes = _without_unread(marked, outputs)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input} | outputs
    dropped = {name for fold in folds for name in (fold.weight, fold.index, fold.strengths) if name not in read}
    kept = [value for value in result.graph.input if value.name not in dropped]
    for fold in folds:
        value = proto.ValueInfoProto()
        value.CopyFrom(inputs[fold.weight])
        value.name = fold.folded
        kept.append(value)
    del result.graph.input[:]
    result.graph.input.extend(kept)
    constants = {fold.index: _integers(initializers[fold.index]) for fold in folds if fold.index in initializers}
    return result, StrengthFolding(folds, constants, dropped)


def _strength_side(
    mul: proto.NodeProto,
    producers: Mapping[str, proto.NodeProto],
    inputs: Mapping[str, proto.ValueInfoProto],
    initializers: Mapping[str, proto.TensorProto],
) -> tuple[str, list[proto.NodeProto], proto.NodeProto] | None:
    """(the scaled activation, the nodes that make the per-column scale, its Gather) or None."""
    for side in (0, 1):
        scale = producers.get(mul.input[side])
        chain = []
        if scale is not None and scale.op_type == "Reshape" and scale.input:  # the Conv form: [R] -> [1, R, 1, 1]
            chain.append(scale)
            scale = producers.get(scale.input[0])
        if (
            scale is not None
            and scale.op_type == "Gather"
            and len(scale.input) == 2
            and all(a.name != "axis" or a.i == 0 for a in scale.attribute)
            and scale.input[0] in inputs
            and (scale.input[1] in inputs or scale.input[1] in initializers)
        ):
            return mul.input[1 - side], [*chain, scale], scale
    return None


def _weight_axis(consumer: proto.NodeProto, inputs: Mapping[str, proto.ValueInfoProto]) -> int | None:
    """Which axis of the consumer's weight the rank runs along, when the weight is a graph input."""
    if consumer.input[1] not in inputs or consumer.domain not in ("", "ai.onnx"):
        return None
    if consumer.op_type == "MatMul":
        return 0
    if consumer.op_type == "Conv" and all(a.name != "group" or a.i == 1 for a in consumer.attribute):
        return 1
    return None


def _fits(
    weight: proto.ValueInfoProto,
    axis: int,
    index: str,
    inputs: Mapping[str, proto.ValueInfoProto],
    initializers: Mapping[str, proto.TensorProto],
) -> bool:
    """True when the weight's rank axis and the index have the same known length (and the Conv is 1x1)."""
    dims = _static_dims(weight)
    index_dims = list(initializers[index].dims) if index in initializers else _static_dims(inputs[index])
    expected_rank = 2 if axis == 0 else 4
    if len(dims) != expected_rank or len(index_dims) != 1 or dims[axis] is None or dims[axis] != index_dims[0]:
        return False
    return axis == 0 or dims[2:] == [1, 1]


def _integers(tensor: proto.TensorProto) -> np.ndarray:
    """An inline integer initializer (an adapter index vector) as an array, read from its protobuf fields."""
    if tensor.data_type not in (proto.TensorProto.INT64, proto.TensorProto.INT32):
        raise BackendError(f"LoRA index {tensor.name!r} is not an int32 or int64 tensor")
    dtype = np.int64 if tensor.data_type == proto.TensorProto.INT64 else np.int32
    if tensor.raw_data:
        values = np.frombuffer(tensor.raw_data, np.dtype(dtype).newbyteorder("<")).astype(dtype)
    else:
        values = np.asarray(tensor.int64_data if dtype is np.int64 else tensor.int32_data, dtype)
    if values.size != int(np.prod(tensor.dims)):
        raise BackendError(f"LoRA index {tensor.name!r} holds {values.size} values for shape {list(tensor.dims)}")
    return values.reshape(tuple(tensor.dims))


def _static_dims(value: proto.ValueInfoProto) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]


def _without_unread(nodes: list[tuple[bool, proto.NodeProto]], outputs: set[str]) -> list[proto.NodeProto]:
    """The nodes less the removable ones nothing reads any more (a Gather shared with an unfolded Mul stays)."""
    while True:
        read = {name for _, node in nodes for name in node.input} | outputs
        kept = [(removable, node) for removable, node in nodes if not removable or any(o in read for o in node.output)]
        if len(kept) == len(nodes):
            return [node for _, node in kept]
        nodes = kept

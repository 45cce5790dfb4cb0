"""Small structural edits of ONNX models that several layers need."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from quiver.ir import proto


def iter_nodes(graph: proto.GraphProto) -> Iterator[proto.NodeProto]:
    """Every node of a graph and of its subgraphs (If/Loop/Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == proto.AttributeProto.GRAPH:
                yield from iter_nodes(attr.g)
            elif attr.type == proto.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from iter_nodes(sub)


def drop_unread_initializers(graph: proto.GraphProto, candidates: Collection[str]) -> None:
    """Removes the initializers named in `candidates` that no node reads any more (a rewrite replaced them)."""
    read = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name not in candidates or t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def initializers_as_inputs(
    model: proto.ModelProto, names: Collection[str] | Callable[[proto.TensorProto], bool]
) -> proto.ModelProto:
    """A copy in which the chosen initializers (by name, or by predicate) are typed graph inputs instead."""
    chosen = names if callable(names) else (lambda tensor: tensor.name in names)
    copy = proto.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    moved = [t for t in graph.initializer if chosen(t)]
    kept = [t for t in graph.initializer if not chosen(t)]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(_value_info(t) for t in moved)
    return copy


def _value_info(tensor: proto.TensorProto) -> proto.ValueInfoProto:
    """The typed input an initializer becomes (onnx.helper.make_tensor_value_info, without importing onnx)."""
    value = proto.ValueInfoProto(name=tensor.name)
    value.type.tensor_type.elem_type = tensor.data_type
    shape = value.type.tensor_type.shape
    shape.SetInParent()  # a scalar has a shape too: present, with no dims
    for dim in tensor.dims:
        shape.dim.add().dim_value = dim
    return value


def quantized_io(model: proto.ModelProto) -> proto.ModelProto:
    """The model with its I/O quantization left to the caller (QNN EP's offload_graph_io_quantization=0).

    A float input whose only consumer is a QuantizeLinear becomes an input of the quantized type, and a
    float output made by a DequantizeLinear becomes that node's quantized input; the Q/DQ nodes go.
    """
    result = proto.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    constants = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[proto.NodeProto]] = {}
    producers = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    dropped: list[proto.NodeProto] = []
    renames: dict[str, str] = {}
    for value in graph.input:
        users = consumers.get(value.name, [])
        if len(users) == 1 and users[0].op_type == "QuantizeLinear" and len(users[0].input) > 2:
            quantize = users[0]
            if quantize.input[2] in constants:
                value.type.tensor_type.elem_type = constants[quantize.input[2]].data_type
                renames[quantize.output[0]] = value.name
                dropped.append(quantize)
    for value in graph.output:
        node = producers.get(value.name)
        if (
            node is not None
            and node.op_type == "DequantizeLinear"
            and len(node.input) > 2
            and node.input[2] in constants
        ):
            if len(consumers.get(value.name, [])) == 0:
                value.type.tensor_type.elem_type = constants[node.input[2]].data_type
                renames[node.input[0]] = value.name
                dropped.append(node)
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
        node.output[:] = [renames.get(name, name) for name in node.output]
    kept = [n for n in graph.node if not any(n is d for d in dropped)]
    del graph.node[:]
    graph.node.extend(kept)
    return result

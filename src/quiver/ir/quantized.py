"""The encoding each quantized weight is read with (its DequantizeLinear's or MatMulNBits' scales and zero points).

Two graphs may share a quantized weight only when its bytes *and* its encoding match (QNN's weight
sharing rule): the same integers under another scale are another tensor.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Container
from typing import Any

import numpy as np
import onnx

from quiver.formats.encodings import Encoding, EncodingSet

SMALL_ENCODING = 8  # scales listed in the descriptor up to this count; larger ones only by hash
QUANTIZED_SUFFIX = "_quantized"  # ORT's name for a weight's integers: <float name>_quantized
_OUTPUT_RENAME_SUFFIX = "_QuantizeLinear_Input"  # ORT renames the producer of a quantized graph output


def _descriptor(op: str, scale: np.ndarray, zero: np.ndarray | None, axis: int | None, block: int | None) -> dict:
    digest = hashlib.sha256()
    digest.update(json.dumps([op, axis, block, str(scale.dtype), list(scale.shape)]).encode())
    digest.update(np.ascontiguousarray(scale).tobytes())
    if zero is not None:
        digest.update(str(zero.dtype).encode() + np.ascontiguousarray(zero).tobytes())
    descriptor: dict[str, Any] = {"op": op, "scales": int(scale.size)}
    if axis is not None:
        descriptor["axis"] = axis
    if block:
        descriptor["block_size"] = block
    if scale.size <= SMALL_ENCODING:
        descriptor["scale"] = [float(s) for s in scale.ravel()]
        if zero is not None and zero.size == scale.size:
            descriptor["zero_point"] = [int(z) for z in zero.ravel()]
    descriptor["sha256"] = digest.hexdigest()
    return descriptor


def weight_encodings(
    model: onnx.ModelProto, weights: set[str], value_of: Callable[[str], np.ndarray | None]
) -> dict[str, dict[str, Any]]:
    """Encoding descriptors of the `weights` that a DequantizeLinear or MatMulNBits reads as integers.

    `value_of` gives a constant's array (None when it is not a constant): scales and zero points may be
    inline in the skeleton or weights themselves.
    """
    result: dict[str, dict[str, Any]] = {}
    for node in model.graph.node:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "DequantizeLinear" and node.input[0] in weights and len(node.input) > 1:
            name, scale_name = node.input[0], node.input[1]
            zero_name = node.input[2] if len(node.input) > 2 else ""
            block = int(attributes.get("block_size", 0) or 0)
            axis: int | None = int(attributes.get("axis", 1))
        elif node.op_type == "MatMulNBits" and len(node.input) > 2 and node.input[1] in weights:
            name, scale_name = node.input[1], node.input[2]
            zero_name = node.input[3] if len(node.input) > 3 else ""
            block, axis = int(attributes.get("block_size", 0)), None
        else:
            continue
        scale = value_of(scale_name)
        if scale is None:
            continue  # scales computed at run time: nothing to key on
        zero = value_of(zero_name) if zero_name else None
        if scale.size == 1:
            axis = None  # per tensor: the axis attribute means nothing
        result[name] = _descriptor(node.op_type, scale, zero, axis, block or None)
    return result


def _encoding_at(node: onnx.NodeProto, kind: str, value_of: Callable[[str], np.ndarray | None]) -> Encoding | None:
    if len(node.input) < 3:
        return None
    scale, zero = value_of(node.input[1]), value_of(node.input[2])
    if scale is None or zero is None:
        return None
    dtype = zero.dtype.name
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    zero_points = tuple(int(z) for z in zero.astype(np.int64).ravel())
    return Encoding(
        dtype,
        tuple(float(s) for s in scale.astype(np.float64).ravel()),
        zero_points,
        symmetric=dtype.startswith("int") and not any(zero_points),
        axis=int(attributes.get("axis", 1)) if scale.size > 1 else None,
        block_size=int(attributes["block_size"]) if attributes.get("block_size") else None,
        kind=kind,
    )


def graph_encodings(
    model: onnx.ModelProto, constants: Container[str], value_of: Callable[[str], np.ndarray | None]
) -> EncodingSet:
    """The encodings of a QDQ graph: weights by their float names, activations by the tensors quantized.

    `constants` names the graph's constant tensors; `value_of` gives one's current value: scales and zero
    points may be inline, weights, or updateable tensors replaced by a binary section.
    """
    result = EncodingSet(version="1.0.0")
    for node in model.graph.node:
        if not node.input:
            continue  # malformed: the backend refuses the graph; there is no encoding to read
        if node.op_type == "DequantizeLinear" and node.input[0] in constants:
            name, kind = node.input[0].removesuffix(QUANTIZED_SUFFIX), "param"
        elif node.op_type == "QuantizeLinear" and node.input[0] not in constants:
            name, kind = node.input[0].removesuffix(_OUTPUT_RENAME_SUFFIX), "activation"
        else:
            continue
        if name not in result.tensors and (encoding := _encoding_at(node, kind, value_of)) is not None:
            result.tensors[name] = encoding
    return result

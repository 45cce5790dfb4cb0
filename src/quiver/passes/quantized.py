"""The encoding each quantized weight is read with (its DequantizeLinear's or MatMulNBits' scales and zero points).

Two graphs may share a quantized weight only when its bytes *and* its encoding match (QNN's weight
sharing rule): the same integers under another scale are another tensor.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from quiver.formats.encodings import Encoding, EncodingSet
from quiver.ir.nibbles import unpack_bits

SMALL_ENCODING = 8  # scales listed in the descriptor up to this count; larger ones only by hash
QUANTIZED_SUFFIX = "_quantized"  # ORT's name for a weight's integers: <float name>_quantized
NBITS_SUFFIX = ".nbits"  # a weight's integers in MatMulNBits' layout (passes/nbits.py): <integers' name>.nbits
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
            # keyed on the encoding as the DequantizeLinear it replaced read it: one scale, or one per
            # column, stays short enough to list (its scales are stored repeated per block)
            reading = _nbits_reading(node, value_of)
            if reading is not None:
                result[node.input[1]] = _descriptor(
                    node.op_type, reading.scales, reading.zeros, reading.axis, reading.block
                )
            continue
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
        if node.op_type == "MatMulNBits" and node.input[1] in constants:
            name = node.input[1].removesuffix(NBITS_SUFFIX).removesuffix(QUANTIZED_SUFFIX)
            if name not in result.tensors and (encoding := _nbits_encoding(node, value_of)) is not None:
                result.tensors[name] = encoding
            continue
        if node.op_type == "DequantizeLinear" and node.input[0] in constants:
            name, kind = node.input[0].removesuffix(QUANTIZED_SUFFIX), "param"
        elif node.op_type == "QuantizeLinear" and node.input[0] not in constants:
            name, kind = node.input[0].removesuffix(_OUTPUT_RENAME_SUFFIX), "activation"
        else:
            continue
        if name not in result.tensors and (encoding := _encoding_at(node, kind, value_of)) is not None:
            result.tensors[name] = encoding
    return result


@dataclass(frozen=True)
class _NBitsReading:
    """How a MatMulNBits reads its weight, in the terms of the DequantizeLinear it replaced (weight [K, N])."""

    dtype: str
    scales: np.ndarray  # one; one per column (axis 1); or [blocks, N] (axis 0, per block)
    zeros: np.ndarray  # the same shape
    axis: int | None
    block: int | None


def _nbits_reading(node: onnx.NodeProto, value_of: Callable[[str], np.ndarray | None]) -> _NBitsReading | None:
    """One scale, a scale per column where every block of a column has the same, else per block along K;
    signed and symmetric where every zero point is the default, 2^(bits-1) (an unsigned weight with
    that zero point reads the same)."""
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    bits, n, block = int(attributes.get("bits", 4)), int(attributes.get("N", 0)), int(attributes.get("block_size", 0))
    scale = value_of(node.input[2])
    if bits not in (2, 4, 8) or n <= 0 or scale is None or scale.size % n:
        return None  # a malformed node: no encoding to read; the backend refuses the graph with ORT's reason
    scales = scale.astype(np.float32).reshape(n, -1)  # [N, blocks]
    middle = 1 << (bits - 1)
    zero_name = node.input[3] if len(node.input) > 3 else ""
    packed = value_of(zero_name) if zero_name else None
    if zero_name and packed is None:
        return None
    if packed is None:
        zeros = np.full(scales.shape, middle, np.int64)
    else:
        if packed.size % n or packed.size // n * (8 // bits) < scales.shape[1]:
            return None  # fewer zero points than blocks
        zeros = unpack_bits(packed.reshape(n, -1), bits)[:, : scales.shape[1]].astype(np.int64)
    symmetric = bool((zeros == middle).all())
    if symmetric:
        zeros = np.zeros_like(zeros)
    dtype = f"int{bits}" if symmetric else f"uint{bits}"
    if (scales == scales[:, :1]).all() and (zeros == zeros[:, :1]).all():
        if (scales == scales.flat[0]).all() and (zeros == zeros.flat[0]).all():
            return _NBitsReading(dtype, scales[:1, 0], zeros[:1, 0], None, None)
        return _NBitsReading(dtype, scales[:, 0], zeros[:, 0], 1, None)
    return _NBitsReading(dtype, scales.T, zeros.T, 0, block)  # the DequantizeLinear's layout: [blocks, N]


def _nbits_encoding(node: onnx.NodeProto, value_of: Callable[[str], np.ndarray | None]) -> Encoding | None:
    """A MatMulNBits weight's encoding; none where a scale is negative (ORT's MatMulNBitsQuantizer writes
    such, flipping the integers' sign): an encoding's scales are positive."""
    reading = _nbits_reading(node, value_of)
    if reading is None or not (reading.scales > 0).all():
        return None
    return Encoding(
        reading.dtype,
        tuple(float(s) for s in reading.scales.ravel()),
        tuple(int(z) for z in reading.zeros.ravel()),
        symmetric=reading.dtype.startswith("int"),
        axis=reading.axis,
        block_size=reading.block,
        kind="param",
    )

"""4-bit block-quantized MatMul weights (DequantizeLinear-21 of int4/uint4, blocks along K) -> MatMulNBits.

A context stores the 4-bit values packed two per byte as plain uint8 tensors, and the cpu backend runs
ONNX Runtime's MatMulNBits kernel on them instead of dequantizing every weight on every run. Layout
(ORT's contrib op): B [N, k_blocks, block_size / 2] with element k of a block in the low nibble when k
is even; q counted from 0 (q + 8 for int4), zero point 8 unless given; scales [N, k_blocks].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor

from quiver.ir import nibbles
from quiver.ir.nibbles import pack_nibbles
from quiver.ir.ops import MS_DOMAIN

_FOUR_BIT = {onnx.TensorProto.INT4: 8, onnx.TensorProto.UINT4: 0}  # shift that makes q unsigned


def _array(tensor: onnx.TensorProto, base: Path | None) -> np.ndarray:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        load_external_data_for_tensor(copy, str(base or "."))
        tensor = copy
    if tensor.data_type in _FOUR_BIT and tensor.HasField("raw_data"):
        return unpack_nibbles(tensor)
    return numpy_helper.to_array(tensor)


def unpack_nibbles(tensor: onnx.TensorProto) -> np.ndarray:
    """An INT4/UINT4 tensor's values (int8/uint8), from ONNX's packing: two per byte, the first low.

    onnx's own `to_array` unpacks 4-bit tensors element by element in Python before onnx 1.18 (40 s for
    MiniLM's weights); this is the same unpacking, vectorized.
    """
    count = int(np.prod(tensor.dims, dtype=np.int64))
    packed = np.frombuffer(tensor.raw_data, np.uint8)
    return nibbles.unpack_nibbles(packed, count, tensor.data_type == onnx.TensorProto.INT4).reshape(tuple(tensor.dims))


def _attributes(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: int(a.i) for a in node.attribute if a.type == onnx.AttributeProto.INT}


def to_matmul_nbits(model: onnx.ModelProto, base: Path | None = None) -> int:
    """Rewrites each 4-bit DQ -> MatMul(B) pair in place; returns how many weights were rewritten."""
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    removed: set[str] = set()
    rewritten = 0
    for dq in list(graph.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in constants:
            continue
        weight = constants[dq.input[0]]
        attributes = _attributes(dq)
        users = consumers.get(dq.output[0], [])
        fits = (
            weight.data_type in _FOUR_BIT
            and len(weight.dims) == 2
            and attributes.get("axis", 1) == 0
            and attributes.get("block_size", 0) >= 16
            and len(dq.input) >= 2
            and all(name in constants for name in dq.input[1:])
            and users
            and all(u.op_type == "MatMul" and u.input[1] == dq.output[0] and u.input[0] != dq.output[0] for u in users)
            and dq.output[0] not in {o.name for o in graph.output}
        )
        if not fits:
            continue
        block = attributes["block_size"]
        k, n = weight.dims
        blocks = -(-k // block)
        shift = _FOUR_BIT[weight.data_type]
        q = _array(weight, base).astype(np.int16) + shift  # [K, N], now 0..15
        scale = _array(constants[dq.input[1]], base).astype(np.float32).reshape(blocks, n)
        zero = (
            _array(constants[dq.input[2]], base).astype(np.int16).reshape(blocks, n) + shift
            if len(dq.input) > 2 and dq.input[2]
            else np.full((blocks, n), shift, np.int16)
        )
        padded = np.full((blocks * block, n), 8, np.int16)
        padded[:k] = q
        packed = pack_nibbles(padded.T.reshape(n, blocks, block))  # [N, blocks, block / 2]
        stem = dq.input[0]
        inputs = [f"{stem}.nbits", f"{stem}.nbits_scales"]
        new_tensors = [
            numpy_helper.from_array(packed, inputs[0]),
            numpy_helper.from_array(np.ascontiguousarray(scale.T), inputs[1]),
        ]
        if (zero != 8).any():  # MatMulNBits' default zero point is 8
            zero_t = np.full((n, blocks + blocks % 2), 8, np.int16)
            zero_t[:, :blocks] = zero.T
            inputs.append(f"{stem}.nbits_zero_points")
            new_tensors.append(numpy_helper.from_array(pack_nibbles(zero_t).reshape(-1), inputs[2]))
        graph.initializer.extend(new_tensors)
        for user in users:
            replacement = helper.make_node(
                "MatMulNBits",
                [user.input[0], *inputs],
                list(user.output),
                name=user.name or None,
                domain=MS_DOMAIN,
                K=k,
                N=n,
                bits=4,
                block_size=block,
            )
            user.CopyFrom(replacement)
        graph.node.remove(dq)
        removed.update(name for name in dq.input if name)
        rewritten += 1
    if rewritten:
        still_used = {name for node in graph.node for name in node.input}
        kept = [t for t in graph.initializer if t.name not in removed or t.name in still_used]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return rewritten

"""Quantized MatMul weights -> ONNX Runtime's MatMulNBits, at build time.

Two patterns: 4-bit blocks along K (DequantizeLinear-21 of int4/uint4), and 8-bit weights with a scale
per output column or one in all (int8/uint8, as per-channel quantizers make them). A context stores the
values in MatMulNBits' layout as plain uint8 tensors, and the cpu backend runs ORT's kernel on them
instead of dequantizing every weight on every run (ORT 1.32 fuses the 8-bit pairs itself when a session
is made, older versions do not: done here, every version runs the same kernel, and a graph opens
without that rewrite). Layout (ORT's contrib op): B [N, k_blocks, block_size * bits / 8], values
packed from each byte's low bits up; q counted from 0 (q + 8 for int4, q + 128 for int8); zero point
2^(bits-1) unless given; scales [N, k_blocks]. MatMuls reading an 8-bit activation keep their
DequantizeLinear: ORT runs those in integers (its QDQ fusions).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor

from quiver.ir import nibbles
from quiver.ir.edit import drop_unread_initializers
from quiver.ir.nibbles import pack_nibbles
from quiver.ir.ops import MS_DOMAIN, use_microsoft_domain
from quiver.passes.quantized import NBITS_SUFFIX

_FOUR_BIT: dict[int, int] = {onnx.TensorProto.INT4: 8, onnx.TensorProto.UINT4: 0}  # shift that makes q unsigned
_EIGHT_BIT: dict[int, int] = {onnx.TensorProto.INT8: 128, onnx.TensorProto.UINT8: 0}
_EIGHT_BIT_BLOCK = 32  # ORT's block for the 8-bit pairs it fuses itself (session.qdq_matmulnbits_block_size)


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


def to_matmul_nbits(model: onnx.ModelProto, base: Path | None = None, keep: Collection[str] = ()) -> int:
    """Rewrites each fitting DQ -> MatMul(B) pair in place; returns how many weights were rewritten.

    `keep`: tensors that must stay as they are (updateable ones: sections and updates give their values
    in the source's layout)."""
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    producers: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
        for name in node.output:
            producers[name] = node
    graph_outputs = {o.name for o in graph.output}
    removed: set[str] = set()
    written: set[str] = set()  # the MatMulNBits tensors made so far
    rewritten = 0
    for dq in list(graph.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in constants or any(i in keep for i in dq.input):
            continue
        users = consumers.get(dq.output[0], [])
        if (
            not users
            or dq.output[0] in graph_outputs
            or not all(name in constants for name in dq.input[1:] if name)
            or not all(
                u.op_type == "MatMul" and u.input[1] == dq.output[0] and u.input[0] != dq.output[0] for u in users
            )
        ):
            continue
        weight = constants[dq.input[0]]
        if weight.data_type in _FOUR_BIT:
            found = _four_bit_blocks(dq, weight, constants, base)
        elif weight.data_type in _EIGHT_BIT and not any(
            _from_8_bit_quantizer(u.input[0], producers, constants) for u in users
        ):
            found = _eight_bit_columns(dq, weight, constants, base)
        else:
            continue
        if found is None:
            continue
        bits, block, packed, scales, zeros = found
        k, n = weight.dims
        stem = dq.input[0]
        inputs = [f"{stem}{NBITS_SUFFIX}", f"{stem}{NBITS_SUFFIX}_scales"]
        if inputs[0] in written or inputs[0] in constants:
            continue  # the same integers read by another DequantizeLinear too, rewritten already
        written.add(inputs[0])
        new_tensors = [numpy_helper.from_array(packed, inputs[0]), numpy_helper.from_array(scales, inputs[1])]
        if zeros is not None:
            inputs.append(f"{stem}{NBITS_SUFFIX}_zero_points")
            new_tensors.append(numpy_helper.from_array(zeros, inputs[2]))
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
                bits=bits,
                block_size=block,
            )
            user.CopyFrom(replacement)
        graph.node.remove(dq)
        removed.update(name for name in dq.input if name)
        rewritten += 1
    if rewritten:
        drop_unread_initializers(graph, removed)
        use_microsoft_domain(model)
    return rewritten


_NBits = tuple[int, int, np.ndarray, np.ndarray, np.ndarray | None]  # bits, block, B, scales, zero points


def _four_bit_blocks(
    dq: onnx.NodeProto, weight: onnx.TensorProto, constants: dict[str, onnx.TensorProto], base: Path | None
) -> _NBits | None:
    """int4/uint4 blocks along K (DequantizeLinear-21's block_size) as MatMulNBits' 4-bit layout."""
    attributes = _attributes(dq)
    if len(weight.dims) != 2 or attributes.get("axis", 1) != 0 or attributes.get("block_size", 0) < 16:
        return None
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
    zeros = None
    if (zero != 8).any():  # MatMulNBits' default zero point is 8
        zero_t = np.full((n, blocks + blocks % 2), 8, np.int16)
        zero_t[:, :blocks] = zero.T
        zeros = pack_nibbles(zero_t).reshape(-1)
    return 4, block, packed, np.ascontiguousarray(scale.T), zeros


def _eight_bit_columns(
    dq: onnx.NodeProto, weight: onnx.TensorProto, constants: dict[str, onnx.TensorProto], base: Path | None
) -> _NBits | None:
    """int8/uint8 weights with a scale per column (or one in all) as MatMulNBits' 8-bit layout, in
    blocks of 32 along K with each column's scale repeated: what ONNX Runtime (1.32) makes of the same
    pair at session creation, so it computes the same numbers, and older versions do too."""
    attributes = _attributes(dq)
    scale = _array(constants[dq.input[1]], base)
    if len(weight.dims) != 2 or "block_size" in attributes or scale.dtype != np.float32:
        return None
    k, n = weight.dims
    if scale.size != 1 and (scale.shape != (n,) or attributes.get("axis", 1) not in (1, -1)):
        return None  # scales along K, or a shape MatMulNBits has no place for
    blocks = -(-k // _EIGHT_BIT_BLOCK)
    shift = _EIGHT_BIT[weight.data_type]
    zero = (
        _array(constants[dq.input[2]], base).astype(np.int16).reshape(-1) + shift
        if len(dq.input) > 2 and dq.input[2]
        else np.full(1, shift, np.int16)
    )
    padded = np.empty((blocks * _EIGHT_BIT_BLOCK, n), np.uint8)
    padded[:k] = (_array(weight, base).astype(np.int16) + shift).astype(np.uint8)  # [K, N], now 0..255
    padded[k:] = np.broadcast_to(zero.astype(np.uint8), (n,))  # padding dequantizes to 0
    packed = np.ascontiguousarray(padded.T.reshape(n, blocks, _EIGHT_BIT_BLOCK))
    scales = np.repeat(np.broadcast_to(scale.reshape(-1), (n,)), blocks).astype(np.float32)  # [N * blocks]
    zeros = None
    if (zero != 128).any():  # MatMulNBits' default zero point at 8 bits is 128
        zeros = np.repeat(np.broadcast_to(zero, (n,)), blocks).astype(np.uint8)
    return 8, _EIGHT_BIT_BLOCK, packed, scales, zeros


def _from_8_bit_quantizer(
    name: str, producers: dict[str, onnx.NodeProto], constants: dict[str, onnx.TensorProto]
) -> bool:
    """Whether a MatMul input is an 8-bit activation (DequantizeLinear of int8/uint8): ORT runs such a
    MatMul in integers (its QDQ fusions), which a MatMulNBits would take away."""
    producer = producers.get(name)
    if producer is None or producer.op_type != "DequantizeLinear":
        return False
    zero = constants.get(producer.input[2]) if len(producer.input) > 2 and producer.input[2] else None
    return zero is None or zero.data_type in _EIGHT_BIT  # no zero point: uint8

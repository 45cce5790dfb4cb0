"""Small helpers shared by tests that look inside a loaded context."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import quiver


def matmul_nbits_model(
    weights: list[onnx.TensorProto], k: int, n: int, bits: int, block: int, batch: int, **attributes: int
) -> onnx.ModelProto:
    """y [batch, N] = com.microsoft::MatMulNBits(x [batch, K], *weights): B, scales[, zero points]."""
    node = helper.make_node(
        "MatMulNBits",
        ["x", *(w.name for w in weights)],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        **attributes,
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, n])],
        weights,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def executables(context: quiver.Context) -> dict[str, Any]:
    """The prepared backend state of each live graph, by graph name."""
    assert context._store is not None
    return {name: live.executable for name, live in context._store._live.items()}


@functools.cache
def ort_fuses_8_bit_weights() -> bool:
    """Whether this ONNX Runtime turns a DequantizeLinear(int8, a scale per column) -> MatMul pair into
    MatMulNBits itself (1.32 does, 1.24 does not). Where it does, ORT on a QDQ file computes as Quiver's
    context (which has that rewrite built in) at the same accuracy level; where it does not, ORT computes
    the pair in float32 at any level, and only level 0 gives Quiver's numbers."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.integers(-128, 128, (64, 8)).astype(np.int8), "w"),
        numpy_helper.from_array((rng.random(8) * 0.01).astype(np.float32), "s"),
        numpy_helper.from_array(np.zeros(8, np.int8), "z"),
    ]
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wf"], axis=1),
         helper.make_node("MatMul", ["x", "wf"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], weights,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    x = rng.standard_normal((1, 64)).astype(np.float32)
    outputs = []
    for level in (0, 4):  # at level 4 a MatMulNBits quantizes x to int8: another result than float32
        options = ort.SessionOptions()
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
        outputs.append(ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0])
    return not np.array_equal(*outputs)


def sequence_input_model(opset: int = 17) -> onnx.ModelProto:
    """A model ORT runs and Quiver does not take on: a sequence at its edge (`n = SequenceLength(s)`)."""
    sequence = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    graph = helper.make_graph(
        [helper.make_node("SequenceLength", ["s"], ["n"])],
        "sequence",
        [helper.make_value_info("s", sequence)],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])

"""Quantized MatMul weights rewritten to MatMulNBits at build: same numbers, same encodings, and left
alone where ORT computes in integers or the weight is updateable."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import quiver
from quiver.backends.cpu import CpuBackend
from quiver.passes.quantized import NBITS_SUFFIX
from tests.support.helpers import matmul_nbits_model

K, N = 70, 24  # K not a multiple of the 32-value block: the last block is padded


def _weight_model(
    weight: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, activation_bits: int = 0
) -> onnx.ModelProto:
    """x [2, K] (through a Q/DQ pair of `activation_bits` if given) · DequantizeLinear(weight [K, N])."""
    tensors = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(scale, "w_scale")]
    dq_inputs = ["w", "w_scale"]
    if zero is not None:
        tensors.append(numpy_helper.from_array(zero, "w_zero"))
        dq_inputs.append("w_zero")
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["wf"], axis=1)]
    a = "x"
    if activation_bits:
        zero_type = np.uint8 if activation_bits == 8 else np.uint16
        tensors += [
            numpy_helper.from_array(np.float32(0.02), "x_scale"),
            numpy_helper.from_array(zero_type(100), "x_zero"),
        ]
        nodes[:0] = [
            helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"]),
        ]
        a = "xd"
    nodes.append(helper.make_node("MatMul", [a, "wf"], ["y"]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])], tensors,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


_RNG = np.random.default_rng(0)


def _scales() -> np.ndarray:
    return (_RNG.random(N) * 0.01 + 0.001).astype(np.float32)


_CASES = {  # what per-channel and per-tensor quantizers write: weight [K, N], scale, zero point
    "int8 per column": (_RNG.integers(-128, 128, (K, N)).astype(np.int8), _scales(), np.zeros(N, np.int8)),
    "uint8 per column, zero points": (
        _RNG.integers(0, 256, (K, N)).astype(np.uint8),
        _scales(),
        _RNG.integers(90, 160, N).astype(np.uint8),
    ),
    "uint8 per tensor": (_RNG.integers(0, 256, (K, N)).astype(np.uint8), np.float32(0.004), np.uint8(131)),
    "int8 per column, no zero point": (_RNG.integers(-128, 128, (K, N)).astype(np.int8), _scales(), None),
}


def _skeleton_ops(context: quiver.Context) -> list[str]:
    return [n.op_type for n in context._require_store().info("g").skeleton.graph.node]


@pytest.mark.parametrize("case", list(_CASES))
def test_8_bit_weights_become_matmul_nbits_and_compute_the_same(case: str) -> None:
    weight, scale, zero = _CASES[case]
    x = np.random.default_rng(1).standard_normal((2, K)).astype(np.float32)
    real = (weight.astype(np.float64) - (0 if zero is None else zero)) * scale  # what DequantizeLinear gives
    expected = x.astype(np.float64) @ real
    for backend in (CpuBackend(accuracy_level=0), "reference"):  # float arithmetic on both
        with quiver.Context.create(backend) as context:
            context.add_graph("g", _weight_model(weight, scale, zero))
            context.finalize()
            assert _skeleton_ops(context) == ["MatMulNBits"]
            ours = context.graph("g").execute({"x": x})["y"]
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.parametrize("case", list(_CASES))
def test_a_rewritten_weight_keeps_its_encoding(case: str) -> None:
    weight, scale, zero = _CASES[case]
    with quiver.Context.create("cpu") as context:
        context.add_graph("g", _weight_model(weight, scale, zero))
        context.finalize()
        tensors = context.graph("g").encodings().tensors
    assert list(tensors) == ["w"]  # the source's name: ".nbits" taken off
    ours = tensors["w"]
    zeros = np.zeros(np.shape(scale), np.int64) if zero is None else zero.astype(np.int64)
    assert ours.dtype == weight.dtype.name and ours.symmetric == (weight.dtype == np.int8)
    assert ours.scale == pytest.approx(np.ravel(scale).tolist()) and ours.zero_point == tuple(np.ravel(zeros).tolist())
    assert ours.axis == (None if np.size(scale) == 1 else 1) and ours.block_size is None


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_a_matmul_on_8_bit_activations_keeps_its_dequantize(activation_bits: int) -> None:
    model = _weight_model(*_CASES["int8 per column"], activation_bits=activation_bits)
    with quiver.Context.create("cpu") as context:
        context.add_graph("g", model)
        context.finalize()
        ops = _skeleton_ops(context)
    # 8-bit activations: ORT's QDQ fusions compute the MatMul in integers; 16-bit ones it cannot
    assert ("MatMulNBits" in ops) == (activation_bits == 16) and ("MatMul" in ops) == (activation_bits == 8)


def test_an_updateable_weight_keeps_its_layout() -> None:
    model = _weight_model(*_CASES["int8 per column"])
    with quiver.Context.create("cpu") as context:
        context.add_graph("g", model, updateable=["w"])
        context.finalize()
        assert "MatMulNBits" not in _skeleton_ops(context)
        assert not any(t.name.endswith(NBITS_SUFFIX) for t in context.graph("g").static_tensors)


def test_a_4_bit_block_weight_keeps_its_encoding_too() -> None:
    block, blocks = 32, -(-K // 32)
    values = _RNG.integers(-8, 8, (K, N))
    scale = (_RNG.random((blocks, N)) * 0.01 + 0.001).astype(np.float32)
    tensors = [
        helper.make_tensor("w", TensorProto.INT4, [K, N], values.ravel().tolist()),
        numpy_helper.from_array(scale, "w_scale"),
    ]
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w", "w_scale"], ["wf"], axis=0, block_size=block),
         helper.make_node("MatMul", ["x", "wf"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])], tensors,
    )  # fmt: skip
    with quiver.Context.create("cpu") as context:
        context.add_graph("g", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
        context.finalize()
        assert _skeleton_ops(context) == ["MatMulNBits"]
        ours = context.graph("g").encodings().tensors["w"]
    assert (ours.dtype, ours.symmetric, ours.axis, ours.block_size) == ("int4", True, 0, block)
    assert ours.scale == pytest.approx(scale.ravel().tolist()) and not any(ours.zero_point)


def test_integers_read_by_two_dequantizers_are_rewritten_once() -> None:
    weight, scale, zero = _CASES["int8 per column"]
    tensors = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(zero, "z"),
               numpy_helper.from_array(scale, "s1"), numpy_helper.from_array(scale * 2, "s2")]  # fmt: skip
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s1", "z"], ["w1"], axis=1),
        helper.make_node("DequantizeLinear", ["w", "s2", "z"], ["w2"], axis=1),
        helper.make_node("MatMul", ["x", "w1"], ["y1"]),
        helper.make_node("MatMul", ["x", "w2"], ["y2"]),
        helper.make_node("Add", ["y1", "y2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])], tensors,
    )  # fmt: skip
    x = np.random.default_rng(2).standard_normal((2, K)).astype(np.float32)
    expected = x.astype(np.float64) @ (weight.astype(np.float64) * scale * 3)  # s1 + s2 = 3 s1
    with quiver.Context.create(CpuBackend(accuracy_level=0)) as context:
        context.add_graph("g", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
        context.finalize()
        assert sorted(_skeleton_ops(context)) == ["Add", "DequantizeLinear", "MatMul", "MatMulNBits"]
        ours = context.graph("g").execute({"x": x})["y"]
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.parametrize(
    ("bits", "zero_points"),
    [(3, 2 * 64 * 256), (4, 5)],  # a width ORT does not have; fewer zero points than blocks
)
def test_a_malformed_matmul_nbits_builds_and_is_refused_when_prepared(bits: int, zero_points: int) -> None:
    k, n, block = 4096, 64, 16  # B large enough to be stored as a weight, so its encoding is read
    blocks = k // block
    tensors = [
        numpy_helper.from_array(np.zeros((n, blocks, block * bits // 8), np.uint8), "B"),
        numpy_helper.from_array(np.ones(n * blocks, np.float32), "S"),
        numpy_helper.from_array(np.zeros(zero_points, np.uint8), "Z"),
    ]
    model = matmul_nbits_model(tensors, k, n, bits, block, batch=1)
    context = quiver.Context.create("cpu")
    context.add_graph("g", model)  # no encoding can be read from it, and building says nothing
    context.finalize()
    assert context.graph("g").encodings().tensors == {}
    with pytest.raises(quiver.BackendError):
        context.graph("g").execute({"x": np.ones((1, k), np.float32)})
    context.close()

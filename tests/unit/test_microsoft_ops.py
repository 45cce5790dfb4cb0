"""The com.microsoft operators of the QNN list run on both backends and agree with ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import quiver
from tests.support.helpers import matmul_nbits_model


def _model() -> onnx.ModelProto:
    ms = "com.microsoft"
    nodes = [
        helper.make_node("Gelu", ["x"], ["g"], domain=ms),
        helper.make_node("QuantizeLinear", ["g", "scale", "zero"], ["q"], domain=ms),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"], domain=ms),
    ]
    initializers = [
        numpy_helper.from_array(np.array(0.02, np.float32), "scale"),
        numpy_helper.from_array(np.array(10, np.uint8), "zero"),
    ]
    graph = helper.make_graph(
        nodes,
        "ms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_gelu_and_quantize_dequantize_match_onnxruntime(backend: str) -> None:
    model = _model()
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert np.unique(expected).size > 10  # the quantization grid is really exercised
    with quiver.Context.create(backend) as context:
        context.add_graph("ms", model)
        ours = context.finalize().graph("ms").execute({"x": x})["y"]
    # one quantization step: Gelu's rounding may land a value on the neighbouring grid point
    np.testing.assert_allclose(ours, expected, atol=0.02 + 1e-6, rtol=0)


def _matmul_nbits(bits: int, k: int, zero_points: bool) -> onnx.ModelProto:
    """A MatMulNBits of ORT's layout, with random packed bytes: every bit of every byte is a value."""
    n, block = 24, 32
    blocks = -(-k // block)
    rng = np.random.default_rng(bits * 100 + k)
    weights = [
        numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8), "b"),
        numpy_helper.from_array((rng.random(n * blocks) * 0.01).astype(np.float32), "scales"),
    ]
    if zero_points:
        weights.append(numpy_helper.from_array(rng.integers(0, 256, n * -(-blocks * bits // 8), dtype=np.uint8), "z"))
    # accuracy level 0: float32 arithmetic in ORT too, the reference's dequantized weights
    return matmul_nbits_model(weights, k, n, bits, block, batch=3, accuracy_level=0)


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("k", [64, 70])  # whole blocks, and a last block padded
@pytest.mark.parametrize("bits", [2, 4, 8])  # 8: t2t's LM head; 4: its projections
def test_matmul_nbits_on_the_reference_backend_matches_onnxruntime(bits: int, k: int, zero_points: bool) -> None:
    model = _matmul_nbits(bits, k, zero_points)
    x = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    with quiver.Context.create("reference") as context:
        context.add_graph("nbits", model)
        ours = context.finalize().graph("nbits").execute({"x": x})["y"]
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))

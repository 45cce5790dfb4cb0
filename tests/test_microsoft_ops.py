"""The com.microsoft operators of the QNN list run on both backends and agree with ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import quiver


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

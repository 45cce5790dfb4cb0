"""Block weights by round-to-nearest and GPTQ (`quiver.passes.gptq`), checked against plain numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from quiver.errors import QuantizationError
from quiver.passes.gptq import input_moments, quantize_blocks


def _on_grid(k: int, n: int, block: int, seed: int = 0) -> np.ndarray:
    """A weight whose every block and column is s (q - z) with q spanning 0..15: an asymmetric 4-bit grid."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n))
    q[::block], q[1::block] = 0, 15  # each block reaches both ends
    blocks = k // block
    scales = rng.uniform(0.01, 0.1, (blocks, n))
    zeros = rng.integers(1, 15, (blocks, n))
    rows = np.arange(k) // block
    return (scales[rows] * (q - zeros[rows])).astype(np.float32)


@pytest.mark.parametrize("moments", [False, True])
def test_weights_on_an_asymmetric_grid_come_back_exactly(moments: bool) -> None:
    weight = _on_grid(96, 24, 32)
    x = np.random.default_rng(1).standard_normal((200, 96))
    blocks = quantize_blocks(weight, 4, 32, symmetric=False, moments=x.T @ x if moments else None)
    np.testing.assert_allclose(blocks.dequantized(), weight, rtol=0, atol=1e-6)
    assert blocks.q.max() == 15 and blocks.q.min() == 0


def test_symmetric_blocks_round_to_nearest_on_max_over_seven() -> None:
    weight = np.random.default_rng(2).standard_normal((64, 10)).astype(np.float32)
    blocks = quantize_blocks(weight, 4, 16, symmetric=True)
    peaks = np.abs(weight.reshape(4, 16, 10)).max(axis=1)
    np.testing.assert_allclose(blocks.scales, peaks / 7, rtol=1e-6)
    assert (blocks.zeros == 8).all()
    expected = np.clip(np.rint(weight / np.repeat(peaks / 7, 16, axis=0)), -8, 7) + 8
    np.testing.assert_array_equal(blocks.q, expected)


def test_gptq_keeps_the_layer_output_closer_than_rounding_on_correlated_inputs() -> None:
    rng = np.random.default_rng(3)
    k, n = 128, 64
    x = rng.standard_normal((512, 16)) @ rng.standard_normal((16, k)) + 0.1 * rng.standard_normal((512, k))
    weight = rng.standard_normal((k, n)).astype(np.float32)
    error = {}
    for name, moments in (("rtn", None), ("gptq", x.T @ x)):
        blocks = quantize_blocks(weight, 4, 32, symmetric=False, moments=moments)
        error[name] = np.linalg.norm(x @ (blocks.dequantized() - weight))
    assert error["gptq"] < 0.5 * error["rtn"]


def test_moments_are_the_sums_of_products_of_the_models_own_tensor() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])
    double = numpy_helper.from_array(np.full((1, 3), 2, np.float32), "two")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                              "g", [x], [y], [double])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    samples = [{"x": np.array([[1, -2, 3]], np.float32)}, {"x": np.array([[0, 1, 1], [2, 2, 2]], np.float32)}]
    got = input_moments(model, samples, ["h"])["h"]
    rows = 2 * np.array([[1, -2, 3], [0, 1, 1], [2, 2, 2]], np.float64)
    np.testing.assert_allclose(got, rows.T @ rows)
    assert [o.name for o in model.graph.output] == ["y"]  # the probe's outputs went to a copy


def test_a_weight_that_is_not_a_matrix_is_refused() -> None:
    with pytest.raises(QuantizationError, match="2-d weight"):
        quantize_blocks(np.zeros(8, np.float32), 4, 32, symmetric=True)

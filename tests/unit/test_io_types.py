"""Graph inputs and outputs of the types weights cannot have: float8 (all four), int4/uint4, strings."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import quiver
import quiver.ort

VALUES = np.array([-3.0, -1.0, 0.0, 2.0, 7.0], np.float32)
FLOAT8 = {
    TensorProto.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn,
    TensorProto.FLOAT8E4M3FNUZ: ml_dtypes.float8_e4m3fnuz,
    TensorProto.FLOAT8E5M2: ml_dtypes.float8_e5m2,
    TensorProto.FLOAT8E5M2FNUZ: ml_dtypes.float8_e5m2fnuz,
    TensorProto.INT4: ml_dtypes.int4,
}


def _cast(source: int, target: int, opset: int = 21) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", source, [5])
    y = helper.make_tensor_value_info("y", target, [5])
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=target)], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(backend: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The first output and one after the background packing: both must be the same."""
    with quiver.Context.create(backend) as context:
        context.add_graph("g", model)
        context.finalize()
        first = context.graph("g").execute(feeds)["y"]
        context.wait_until_ready()
        return [first, context.graph("g").execute(feeds)["y"]]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("element", list(FLOAT8), ids=lambda e: TensorProto.DataType.Name(e))
def test_float8_and_int4_outputs_come_back_as_ml_dtypes_arrays(backend: str, element: int) -> None:
    expected = VALUES.astype(FLOAT8[element])  # ml_dtypes' own rounding, not Quiver's
    for output in _run(backend, _cast(TensorProto.FLOAT, element), {"x": VALUES}):
        assert output.dtype == expected.dtype
        np.testing.assert_array_equal(output.astype(np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("element", [*FLOAT8, TensorProto.UINT4], ids=lambda e: TensorProto.DataType.Name(e))
def test_float8_and_4_bit_inputs_are_fed_as_ml_dtypes_arrays(backend: str, element: int) -> None:
    dtype = FLOAT8.get(element, ml_dtypes.uint4)
    values = np.abs(VALUES) if element == TensorProto.UINT4 else VALUES
    feed = values.astype(dtype)
    for output in _run(backend, _cast(element, TensorProto.FLOAT), {"x": feed}):
        np.testing.assert_array_equal(output, feed.astype(np.float32))
    with pytest.raises(quiver.FeedDTypeError, match="expects"):
        _run(backend, _cast(element, TensorProto.FLOAT), {"x": values})  # float32 is not silently reinterpreted


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_string_tensors_pass_through(backend: str) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.STRING, [3])
    y = helper.make_tensor_value_info("y", TensorProto.STRING, [3])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    for output in _run(backend, model, {"x": np.array(["a", "bc", "é"])}):  # a str array, as ORT takes it
        assert output.tolist() == ["a", "bc", "é"]


def test_ort_sessions_report_these_types_as_onnx_runtime_does(tmp_path: Path) -> None:
    onnx.save(_cast(TensorProto.FLOAT8E4M3FN, TensorProto.INT4), str(tmp_path / "m.onnx"))
    session = quiver.ort.InferenceSession(str(tmp_path / "m.onnx"))
    assert [a.type for a in session.get_inputs()] == ["tensor(float8e4m3fn)"]
    assert [a.type for a in session.get_outputs()] == ["tensor(int4)"]
    out = session.run(None, {"x": VALUES.astype(ml_dtypes.float8_e4m3fn)})[0]
    np.testing.assert_array_equal(out.astype(np.float32), VALUES)

"""ONNX -> Quiver graph: weights split out by size, external data, constants, shapes, operator checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import quiver
from quiver.commands.check import check_model
from quiver.formats.layout import INLINE_LIMIT
from quiver.passes.convert import convert


def _matmul_model(weight: np.ndarray, as_constant: bool = False) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    initializers = [numpy_helper.from_array(weight, "w")]
    if as_constant:
        nodes.insert(0, helper.make_node("Constant", [], ["w"], value=initializers.pop()))
    graph = helper.make_graph(
        nodes,
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", weight.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_large_initializers_become_weights_and_small_ones_stay_inline(family: dict) -> None:
    converted = convert(family["base"])
    inline = [t for t in converted.skeleton.graph.initializer if t.data_location != TensorProto.EXTERNAL]
    assert converted.weights and inline
    assert all(src.nbytes >= INLINE_LIMIT for src in converted.weights.values())
    assert all(len(t.raw_data) < INLINE_LIMIT for t in inline)
    assert converted.outputs[0].shape == ("batch", "sequence", 128)


def test_the_callers_model_is_not_modified(family: dict) -> None:
    before = family["base"].SerializeToString()
    convert(family["base"], input_shapes={"input_ids": [1, 8]})
    assert family["base"].SerializeToString() == before


def test_large_constant_nodes_are_lifted_to_shareable_weights() -> None:
    weight = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)
    converted = convert(_matmul_model(weight, as_constant=True))
    assert list(converted.weights) == ["w"]
    np.testing.assert_array_equal(converted.weights["w"].to_array(), weight)


def test_fixed_input_shapes_fold_shape_arithmetic(family: dict) -> None:
    dynamic = convert(family["base"])
    fixed = convert(family["base"], input_shapes={"input_ids": [1, 16]})
    assert fixed.folded_nodes > 0
    assert len(fixed.skeleton.graph.node) < len(dynamic.skeleton.graph.node)
    assert fixed.outputs[0].shape == (1, 16, 128)


def test_fixing_an_unknown_input_names_the_real_ones(family: dict) -> None:
    with pytest.raises(quiver.ConversionError, match="input_ids"):
        convert(family["base"], input_shapes={"ids": [1, 16]})


def test_models_with_external_data_convert_without_loading_it(tmp_path: Path) -> None:
    weight = np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32)
    onnx.save(
        _matmul_model(weight),
        str(tmp_path / "m.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="m.data",
        size_threshold=0,
    )
    converted = convert(tmp_path / "m.onnx")
    source = converted.weights["w"]
    assert source.array is None and source.path == (tmp_path / "m.data").resolve()
    np.testing.assert_array_equal(source.to_array(), weight)


def test_external_data_outside_the_model_folder_is_refused(tmp_path: Path) -> None:
    model = _matmul_model(np.ones((64, 64), np.float32))
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../../etc/passwd")
    (tmp_path / "sub").mkdir()
    onnx.save(model, str(tmp_path / "sub" / "m.onnx"))
    with pytest.raises(quiver.ModelLoadError, match="leaves the model's folder"):
        convert(tmp_path / "sub" / "m.onnx")


def test_external_data_shorter_than_the_tensor_is_refused(tmp_path: Path) -> None:
    onnx.save(
        _matmul_model(np.ones((64, 64), np.float32)),
        str(tmp_path / "m.onnx"),
        save_as_external_data=True,
        location="m.data",
        size_threshold=0,
    )
    (tmp_path / "m.data").write_bytes(b"\0" * 100)
    with pytest.raises(quiver.ModelLoadError, match="do not fit"):
        convert(tmp_path / "m.onnx")


def test_all_unsupported_operators_are_reported_at_once() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Hardmaxx", ["a"], ["b"]),
        helper.make_node("Dett", ["b"], ["c"]),
        helper.make_node("Hardmaxx", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(quiver.UnsupportedOperatorError) as info:
        convert(model)
    assert info.value.operators == ["Dett", "Hardmaxx"]
    assert "Dett (x1), Hardmaxx (x2)" in str(info.value)
    report = check_model(model)
    assert not report.ok and report.unsupported == ["Dett", "Hardmaxx"] and report.operators["Relu"] == 1


def test_a_file_that_is_not_onnx_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(quiver.ModelLoadError):
        convert(tmp_path / "junk.onnx")


def test_initializers_listed_as_inputs_are_treated_as_weights() -> None:
    weight = np.ones((32, 32), np.float32)
    model = _matmul_model(weight)
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [32, 32]))
    converted = convert(model)
    assert [i.name for i in converted.inputs] == ["x"]


def test_a_graph_with_shared_and_inline_weights_matches_onnxruntime(family: dict) -> None:
    weight = np.random.default_rng(2).standard_normal((16, 16)).astype(np.float32)
    model = _matmul_model(weight)
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    with quiver.Context.create("cpu") as context:
        context.add_graph("mm", model)
        ours = context.finalize().graph("mm").execute({"x": x})["y"]
    theirs = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_small_tensors_in_external_data_are_inlined_like_any_small_tensor(tmp_path: Path) -> None:
    weight = np.random.default_rng(4).standard_normal((64, 16)).astype(np.float32)
    model = _matmul_model(weight)
    model.graph.node.append(helper.make_node("Add", ["y", "b"], ["z"]))
    model.graph.initializer.append(numpy_helper.from_array(np.arange(16, dtype=np.float32), "b"))
    model.graph.output[0].name = "z"
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    converted = convert(tmp_path / "m.onnx")
    assert list(converted.weights) == ["w"]
    inline = {t.name: t for t in converted.skeleton.graph.initializer}
    assert inline["b"].data_location == TensorProto.DEFAULT
    np.testing.assert_array_equal(numpy_helper.to_array(inline["b"]), np.arange(16, dtype=np.float32))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_an_ir_3_model_with_unlisted_initializers_and_prelu_runs_as_onnx_runtime_runs_it(backend: str) -> None:
    weight = numpy_helper.from_array(np.arange(2048, dtype=np.float32).reshape(32, 64) / 1000, "W")
    slope = numpy_helper.from_array(np.full(64, 0.1, np.float32), "slope")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("PRelu", ["h", "slope"], ["y"])],
        "ir3",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 32])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 64])],
        [weight, slope],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    model.ir_version = 3  # initializers should be graph inputs in IR 3; ORT runs it without
    x = np.random.default_rng(0).normal(size=(2, 32)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    context = quiver.Context.create(backend)
    context.add_graph("ir3", model)
    context.finalize()
    np.testing.assert_allclose(context.graph("ir3").execute({"x": x})["y"], expected, rtol=1e-6, atol=1e-6)
    assert (expected < 0).any()  # PRelu's negative side is exercised


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_matmul_by_a_transposed_weight_reads_the_weight_as_stored(backend: str) -> None:
    table = np.random.default_rng(2).standard_normal((256, 64)).astype(np.float32)  # a tied embedding, 64 KB
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["hidden"]),
            helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
            helper.make_node("MatMul", ["hidden", "table_t"], ["logits"]),
        ],
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 5, 256])],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    converted = convert(model)
    ops = [n.op_type for n in converted.skeleton.graph.node]
    assert "Transpose" not in ops and "FusedMatMul" in ops  # no transposed copy of the table anywhere
    assert list(converted.weights) == ["table"]
    ids = np.array([[3, 1, 4, 1, 5]], np.int64)
    context = quiver.Context.create(backend)
    context.add_graph("tied", model)
    context.finalize()
    expected = table[ids].astype(np.float64) @ table.T  # float32 sums in another order: an absolute allowance
    np.testing.assert_allclose(context.graph("tied").execute({"ids": ids})["logits"], expected, rtol=1e-5, atol=1e-5)

"""The streaming export: weights as deferred arrays, made one at a time when the context stores them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import quiver
from quiver.errors import ExportResourceError
from quiver.ir.deferred import Deferred, made_together
from quiver.t2t import export as export_module
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.quantizers import quantize_weights
from tests.support.tiny_llm import tiny_adapter, tiny_decoder


def test_deferred_arrays_compute_what_numpy_computes() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((3, 6)).astype(np.float32)
    da, db = Deferred.of(a), Deferred.of(b)
    order = np.array([5, 0, 3])
    cases = [
        (da.T, a.T),
        (da.take(order, axis=1), a[:, order]),
        (Deferred.concat([da, db]), np.concatenate([a, b])),
        (Deferred.stack([da, da], axis=1), np.stack([a, a], axis=1)),
        (da.map(lambda w: w + 1), a + 1),
        (da.reshape(6, 4), a.reshape(6, 4)),
    ]
    for deferred, expected in cases:
        assert deferred.shape == expected.shape  # known before anything is made
        np.testing.assert_array_equal(deferred.compute(), expected)


def test_an_item_of_a_stack_is_made_alone() -> None:
    """One expert of a layer's stack is quantized at a time: the others are not made for it."""
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(4)]
    made: list[int] = []

    def counted(index: int) -> Deferred:
        return Deferred((3, 5), np.float32, lambda: made.append(index) or arrays[index])

    stack = Deferred.stack([counted(i) for i in range(4)])
    np.testing.assert_array_equal(stack.item(2).compute(), arrays[2])
    assert made == [2]
    transposed = Deferred.of(np.stack(arrays)).item(1)  # not a stack: sliced from the whole
    np.testing.assert_array_equal(transposed.compute(), arrays[1])


def test_parts_made_together_are_made_once_and_let_go_when_each_was_taken() -> None:
    calls = []

    def make() -> list[np.ndarray]:
        calls.append(1)
        return [np.zeros(2, np.float32), np.ones(3, np.float32)]

    first, second = made_together([((2,), np.float32), ((3,), np.float32)], make)
    np.testing.assert_array_equal(second.compute(), np.ones(3))
    np.testing.assert_array_equal(first.compute(), np.zeros(2))
    assert len(calls) == 1
    first.compute()  # asked again after both were taken: made again, nothing kept meanwhile
    assert len(calls) == 2


def test_a_deferred_array_that_makes_another_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="not float32"):
        Deferred((2, 2), np.float32, lambda: np.zeros((2, 3), np.float32)).compute()


def _one_matmul(k: int = 128, n: int = 96) -> onnx.ModelProto:
    weight = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="/m/MatMul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_round_to_nearest_writes_what_onnx_runtimes_quantizer_writes() -> None:
    """In blocks other than Quiver's kernel's (32), ORT's own nodes and tensors, as its quantizer writes them."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    ours = quantize_weights(_one_matmul(), 4, 64, quantizer="rtn-asym")
    theirs = MatMulNBitsQuantizer(_one_matmul(), bits=4, block_size=64, is_symmetric=False)
    theirs.process()
    expected = {t.name: numpy_helper.to_array(t) for t in theirs.model.model.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in ours.graph.initializer}
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    (node,) = ours.graph.node
    (their_node,) = theirs.model.model.graph.node
    assert (node.op_type, list(node.input), node.name) == (their_node.op_type, list(their_node.input), their_node.name)
    assert {a.name: a for a in node.attribute} == {a.name: a for a in their_node.attribute}


def _ours_and_ort_quantizers(
    symmetric: bool,
) -> tuple[onnx.ModelProto, onnx.NodeProto, dict[str, np.ndarray], onnx.NodeProto, dict[str, np.ndarray]]:
    """`rtn` (or `rtn-asym`) in blocks of 32 and ORT's own quantizer on the same weight: our model, its one
    node (checked to be Quiver's MatMul4Bits, named as ORT names its node) and tensors; ORT's node and
    tensors."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    ours = quantize_weights(_one_matmul(), 4, 32, quantizer="rtn" if symmetric else "rtn-asym")
    theirs = MatMulNBitsQuantizer(_one_matmul(), bits=4, block_size=32, is_symmetric=symmetric)
    theirs.process()
    expected = {t.name: numpy_helper.to_array(t) for t in theirs.model.model.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in ours.graph.initializer}
    (node,) = ours.graph.node
    (their_node,) = theirs.model.model.graph.node
    assert (node.domain, node.op_type, node.name) == ("ai.quiver", "MatMul4Bits", their_node.name)
    return ours, node, got, their_node, expected


def test_symmetric_round_to_nearest_is_onnx_runtimes_blocks_on_quivers_kernel() -> None:
    """`rtn`: ORT's quantizer's blocks as a MatMul4Bits node, its scales float16 (the minimum -8 s); where the
    kernel is not built, the node is ORT's own again, on the same blocks and those scales."""
    from quiver.backends.cpu.native_ops import lowered

    ours, node, got, their_node, expected = _ours_and_ort_quantizers(symmetric=True)
    blocks, scales = their_node.input[1:3]
    np.testing.assert_array_equal(got[node.input[1]], expected[blocks])
    halves = got[node.input[2]]
    np.testing.assert_array_equal(halves[:, 0], expected[scales].astype(np.float16))
    np.testing.assert_array_equal(halves[:, 1].astype(np.float32), -8 * halves[:, 0].astype(np.float32))
    (matmul,) = [n for n in lowered(ours).graph.node if n.op_type.startswith("MatMul")]
    assert (matmul.op_type, matmul.input[1]) == ("MatMulNBits", node.input[1])
    assert {a.name: a for a in matmul.attribute} == {a.name: a for a in their_node.attribute}


def test_round_to_nearest_with_zero_points_is_onnx_runtimes_blocks_on_quivers_kernel() -> None:
    """`rtn-asym` in blocks of 32: ORT's quantizer's blocks as a MatMul4Bits node, each block's scale in float16
    and its minimum -z s (z its zero point, unpacked); where the kernel is not built, ORT's MatMulNBits on the
    same blocks, plus each block's sum of the input times m + 8 s."""
    from quiver.backends.cpu.native_ops import lowered

    ours, node, got, their_node, expected = _ours_and_ort_quantizers(symmetric=False)
    assert {a.name: a.i for a in node.attribute}["symmetric"] == 0
    blocks, scales, points = their_node.input[1:4]
    np.testing.assert_array_equal(got[node.input[1]], expected[blocks])
    halves = got[node.input[2]]
    scale = expected[scales].reshape(halves.shape[0], -1).astype(np.float16)
    zeros = np.stack([expected[points] & 15, expected[points] >> 4], axis=-1).reshape(len(scale), -1)
    np.testing.assert_array_equal(halves[:, 0], scale)
    minimum = (-zeros[:, : scale.shape[1]].astype(np.float32) * scale.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(halves[:, 1], minimum)
    (matmul,) = [n for n in lowered(ours).graph.node if n.op_type == "MatMulNBits"]
    assert matmul.input[1] == node.input[1]


@pytest.mark.parametrize("quantizer", ["rtn", "rtn-min"])
def test_deferred_quantization_makes_the_weights_eager_quantization_makes(quantizer: str) -> None:
    model = _one_matmul()
    eager = quantize_weights(_one_matmul(), 4, 32, quantizer=quantizer)
    weight = numpy_helper.to_array(model.graph.initializer[0])
    deferred = {"w": Deferred.of(weight)}
    from quiver.passes.load import deferred_placeholder

    model.graph.initializer[0].CopyFrom(deferred_placeholder("w", deferred["w"]))
    lazy = quantize_weights(model, 4, 32, quantizer=quantizer, deferred=deferred)
    for tensor in eager.graph.initializer:
        placeholder = next(t for t in lazy.graph.initializer if t.name == tensor.name)
        value = deferred[tensor.name].compute() if tensor.name in deferred else numpy_helper.to_array(placeholder)
        np.testing.assert_array_equal(value, numpy_helper.to_array(tensor), err_msg=tensor.name)
    assert placeholder.data_location == TensorProto.EXTERNAL or placeholder.raw_data


def test_an_export_makes_each_weight_once_for_all_its_graphs(tmp_path: Path) -> None:
    weights = tiny_decoder(tmp_path / "model")
    tiny_adapter(tmp_path / "adapter", weights, 4, ["q_proj", "v_proj"], seed=3)
    made: list[str] = []
    options = ExportOptions(context_size=64, weight_bits=4)
    export(tmp_path / "model", tmp_path / "out", {"a": tmp_path / "adapter"}, options=options, on_weight=made.append)
    assert made and len(made) == len(set(made))  # prefill, decode and the batched graph share every weight
    with quiver.Context.from_binary(tmp_path / "out" / "model.qctx", backend="reference") as context:
        assert {"prefill", "decode", "batch"} <= set(context.graph_names)


def test_an_export_the_machine_has_no_room_for_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_decoder(tmp_path / "model")
    monkeypatch.setattr(export_module.portable, "available_memory", lambda: 1 << 20)
    with pytest.raises(ExportResourceError, match="needs about .* GB of memory .* available"):
        export(tmp_path / "model", tmp_path / "out", options=ExportOptions(context_size=64))
    assert not (tmp_path / "out" / "model.qctx").exists()


def test_an_export_the_disk_has_no_room_for_is_refused_before_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    tiny_decoder(tmp_path / "model")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(export_module.shutil, "disk_usage", lambda _: usage._replace(free=1 << 20))
    with pytest.raises(ExportResourceError, match="needs about .* GB on disk and 0.0 GB are free"):
        export(tmp_path / "model", tmp_path / "out", options=ExportOptions(context_size=64))
    assert not (tmp_path / "out" / "model.qctx").exists()


def test_a_disk_that_fills_up_mid_export_ends_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from quiver.formats import writer

    tiny_decoder(tmp_path / "model")
    real = writer.TensorFileWriter.add_weight

    def full(self: writer.TensorFileWriter, *args: object, **kwargs: object) -> int:
        if len(self.weights) >= 3:  # a few weights in, the disk is full (what the OS says then)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer.TensorFileWriter, "add_weight", full)
    with pytest.raises(ExportResourceError, match="the disk filled up; the context needs about"):
        export(tmp_path / "model", tmp_path / "out", options=ExportOptions(context_size=64))
    assert not list((tmp_path / "out").glob("*.qctx*"))  # nothing half-written left behind

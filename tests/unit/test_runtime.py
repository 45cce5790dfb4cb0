"""The runtime API: build, save, load, execute, graph switching, typed errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import quiver
from quiver.ir.tensors import TensorType
from quiver.testing.family import BENCH, TransformerShape, make_family, sample_input_ids


def _ort(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids}
    )[0]


@pytest.mark.parametrize("backend", ["cpu", "reference", "cpu-noprepack"])
def test_every_graph_matches_onnxruntime_on_its_source_model(
    family: dict, family_context: Path, backend: str, input_ids: np.ndarray
) -> None:
    with quiver.Context.from_binary(family_context, backend=backend) as context:
        assert context.graph_names == list(family)
        for name, model in family.items():
            ours = context.graph(name).execute({"input_ids": input_ids})["last_hidden_state"]
            np.testing.assert_allclose(ours, _ort(model, input_ids), atol=1e-4, rtol=0)


def test_fine_tunes_really_differ_so_the_comparison_means_something(family: dict, input_ids: np.ndarray) -> None:
    base, tuned = _ort(family["base"], input_ids), _ort(family["finetune_1"], input_ids)
    assert np.abs(base - tuned).max() > 1e-3


def test_shared_weights_are_stored_once(family: dict, family_context: Path) -> None:
    with quiver.Context.from_binary(family_context) as context:
        stats = context.weight_stats()
        large = [t for model in family.values() for t in model.graph.initializer if len(t.raw_data) >= 1024]
        by_content = {(t.data_type, tuple(t.dims), hashlib.sha256(t.raw_data).digest()): len(t.raw_data) for t in large}
        assert stats.referenced_bytes == sum(len(t.raw_data) for t in large)
        assert stats.unique_bytes == sum(by_content.values())
        assert stats.unique_bytes < 0.6 * stats.referenced_bytes  # the fine-tunes share most weights
        assert context.size_bytes < 1.05 * stats.unique_bytes


def test_graphs_use_the_same_memory_for_shared_weights(family_context: Path, input_ids: np.ndarray) -> None:
    with quiver.Context.from_binary(family_context, backend="reference") as context:
        context.graph("base").execute({"input_ids": input_ids})
        context.graph("finetune_1").execute({"input_ids": input_ids})
        file = context.file
        shared = set(file.graphs["base"].weights.values()) & set(file.graphs["finetune_1"].weights.values())
        assert shared
        for index in shared:
            view = context._store.weight_view(index)  # type: ignore[union-attr]
            assert np.shares_memory(view, np.frombuffer(file._buffer, np.uint8))


def test_loading_from_bytes_and_from_a_private_copy_give_the_same_outputs(
    family_context: Path, input_ids: np.ndarray
) -> None:
    data = family_context.read_bytes()
    outputs = []
    for source, persistent in ((family_context, True), (family_context, False), (data, True), (data, False)):
        with quiver.Context.from_binary(source, persistent=persistent) as context:
            outputs.append(context.graph("finetune_2").execute({"input_ids": input_ids})["last_hidden_state"])
    for other in outputs[1:]:
        np.testing.assert_array_equal(outputs[0], other)


def test_get_binary_is_the_saved_file(family: dict, family_context: Path, tmp_path: Path) -> None:
    context = quiver.Context.create("cpu")
    for name, model in family.items():
        context.add_graph(name, model)
    assert context.get_binary() == family_context.read_bytes()
    loaded = quiver.Context.from_binary(family_context)
    loaded.save(tmp_path / "copy.qctx")
    assert (tmp_path / "copy.qctx").read_bytes() == family_context.read_bytes()
    quiver.Context.from_binary(family_context.read_bytes()).save(tmp_path / "from-bytes.qctx")
    assert (tmp_path / "from-bytes.qctx").read_bytes() == family_context.read_bytes()


def test_tensors_describe_themselves_with_qnn_roles(family_context: Path) -> None:
    graph = quiver.Context.from_binary(family_context).graph("base")
    assert [(t.name, t.dtype, t.shape, t.tensor_type) for t in graph.inputs] == [
        ("input_ids", "int64", ("batch", "sequence"), TensorType.APP_WRITE)
    ]
    assert graph.outputs[0].tensor_type is TensorType.APP_READ
    assert graph.static_tensors and all(t.tensor_type is TensorType.STATIC for t in graph.static_tensors)


def test_unknown_graphs_name_the_real_ones(family_context: Path) -> None:
    context = quiver.Context.from_binary(family_context)
    with pytest.raises(quiver.UnknownGraphError, match="finetune_1"):
        context.graph("nope")
    with pytest.raises(quiver.UnknownGraphError):
        quiver.Context.from_binary(family_context, enable_graphs=["base", "nope"])


def test_enable_graphs_limits_and_orders_the_graphs(family_context: Path) -> None:
    context = quiver.Context.from_binary(family_context, enable_graphs=["finetune_2", "base"])
    assert context.graph_names == ["finetune_2", "base"]
    with pytest.raises(quiver.UnknownGraphError, match="finetune_2"):
        context.graph("finetune_1")


def test_graphs_are_prepared_on_first_use_and_evicted_least_recently_used_first(
    family_context: Path, input_ids: np.ndarray
) -> None:
    context = quiver.Context.from_binary(family_context, memory_limit_hint_mb=0.000001)
    assert context.live_graphs == []
    feeds = {"input_ids": input_ids}
    first = context.graph("base").execute(feeds)["last_hidden_state"]
    context.graph("finetune_1").execute(feeds)
    assert context.live_graphs == ["finetune_1"]  # the hint is tiny: only the graph in use stays live
    again = context.graph("base").execute(feeds)["last_hidden_state"]
    assert context.live_graphs == ["base"]
    np.testing.assert_array_equal(first, again)


def test_without_a_hint_all_used_graphs_stay_live(family_context: Path, input_ids: np.ndarray) -> None:
    context = quiver.Context.from_binary(family_context)
    for name in ("finetune_2", "base", "finetune_1"):
        context.graph(name).execute({"input_ids": input_ids})
    context.graph("finetune_2").execute({"input_ids": input_ids})
    assert context.live_graphs == ["base", "finetune_1", "finetune_2"]


def test_bad_feeds_are_refused_with_what_to_do(family_context: Path, input_ids: np.ndarray) -> None:
    graph = quiver.Context.from_binary(family_context).graph("base")
    with pytest.raises(quiver.FeedNameError, match=r"unknown \['ids'\].*missing \['input_ids'\]"):
        graph.execute({"ids": input_ids})
    with pytest.raises(quiver.FeedDTypeError, match=r"astype\(np.int64\)"):
        graph.execute({"input_ids": input_ids.astype(np.int32)})
    with pytest.raises(quiver.FeedShapeError, match="expects shape"):
        graph.execute({"input_ids": input_ids[0]})
    assert isinstance(quiver.FeedShapeError("x"), quiver.InvalidFeedError)


def test_fixed_shapes_are_enforced(family: dict) -> None:
    with quiver.Context.create("cpu") as context:
        context.add_graph("fixed", family["base"], input_shapes={"input_ids": [1, 8]})
        graph = context.finalize().graph("fixed")
        assert graph.inputs[0].shape == (1, 8)
        with pytest.raises(quiver.FeedShapeError):
            graph.execute({"input_ids": np.zeros((1, 9), np.int64)})
        assert graph.execute({"input_ids": np.zeros((1, 8), np.int64)})["last_hidden_state"].shape == (1, 8, 128)


def test_context_state_errors(family: dict) -> None:
    with pytest.raises(quiver.ContextStateError, match="add at least one"):
        quiver.Context.create().finalize()
    context = quiver.Context.create()
    context.add_graph("base", family["base"])
    with pytest.raises(quiver.DuplicateGraphError):
        context.add_graph("base", family["finetune_1"])
    context.finalize()
    with pytest.raises(quiver.ContextStateError, match="finalized"):
        context.add_graph("late", family["finetune_1"])


def test_unknown_backend_lists_the_available_ones() -> None:
    with pytest.raises(quiver.UnknownBackendError, match="cpu, cpu-noprepack, reference"):
        quiver.Context.create("htp")


@pytest.mark.parametrize("backend", [None, 42, object()])
def test_a_backend_that_is_neither_a_name_nor_a_backend_is_refused_up_front(backend: object) -> None:
    # it failed at the first run with an AttributeError ('NoneType' object has no attribute 'prepare')
    with pytest.raises(quiver.UnknownBackendError, match="a backend's name .*cpu.* or a backend object"):
        quiver.Context.create(backend)  # type: ignore[arg-type]


def test_a_runtime_failure_is_a_backend_error(tmp_path: Path) -> None:
    # Reshape to a shape that does not fit the data only fails at run time.
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Reshape", ["x", "s"], ["y"])],
        "r",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"]),
            onnx.helper.make_tensor_value_info("s", onnx.TensorProto.INT64, [1]),
        ],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    for backend in ("cpu", "reference"):
        with quiver.Context.create(backend) as context:
            context.add_graph("r", model)
            with pytest.raises(quiver.BackendError):
                context.finalize().graph("r").execute({"x": np.ones(6, np.float32), "s": np.array([4])})


def test_a_real_shaped_family_builds_within_one_percent_of_its_unique_weights(tmp_path: Path) -> None:
    shape = TransformerShape(vocab=4000, hidden=256, heads=4, ffn=1024, layers=4, max_positions=256)
    family = make_family(shape, count=3, tuned_layers=1, seed=11)
    context = quiver.Context.create("cpu", workdir=tmp_path)
    for name, model in family.items():
        context.add_graph(name, model)
    context.save(tmp_path / "real.qctx")
    stats = context.weight_stats()
    assert context.size_bytes <= 1.01 * stats.unique_bytes
    ids = sample_input_ids(shape, batch=1, seq=64)
    for name, model in family.items():
        ours = context.graph(name).execute({"input_ids": ids})["last_hidden_state"]
        np.testing.assert_allclose(ours, _ort(model, ids), atol=1e-4, rtol=0)
    assert BENCH.hidden > shape.hidden  # the benchmark family is larger still


def test_a_context_has_no_graph_limit(family: dict) -> None:
    # QNN stops at 64 graphs per context; Quiver has no limit.
    with quiver.Context.create("reference") as context:
        for index in range(80):
            context.add_graph(f"variant_{index:02d}", family["base"])
        context.finalize()
        assert len(context.graph_names) == 80
        stats = context.weight_stats()
        assert stats.referenced_bytes == 80 * stats.unique_bytes
        ids = np.zeros((1, 4), np.int64)
        first = context.graph("variant_00").execute({"input_ids": ids})["last_hidden_state"]
        last = context.graph("variant_79").execute({"input_ids": ids})["last_hidden_state"]
        np.testing.assert_array_equal(first, last)


def test_saved_files_get_the_mode_a_plain_open_would_give(family: dict, tmp_path: Path) -> None:
    import os
    import stat

    mask = os.umask(0o027)
    try:
        context = quiver.Context.create("reference", workdir=tmp_path)
        context.add_graph("base", family["base"])
        path = context.save(tmp_path / "family.qctx")
        context.close()
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # not mkstemp's 0600


def test_a_graph_can_be_prepared_before_its_first_run(family_context: Path, input_ids: np.ndarray) -> None:
    context = quiver.Context.from_binary(family_context)
    context.prepare_graph("finetune_1")
    assert context.live_graphs == ["finetune_1"]
    context.graph("finetune_1").execute({"input_ids": input_ids})
    assert context.live_graphs == ["finetune_1"]  # prepared once
    with pytest.raises(quiver.UnknownGraphError, match="nope"):
        context.prepare_graph("nope")

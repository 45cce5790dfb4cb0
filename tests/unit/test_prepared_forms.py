"""Graphs prepared ahead for ONNX Runtime (`backends/cpu/prepared.py`): stored by `save()`, used only by the
ORT that made them from the same session model, and never at the cost of a graph that would not open."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import quiver
from quiver.backends import cpu
from quiver.backends.cpu import prepared as cpu_prepared
from quiver.formats.layout import PREAMBLE_SIZE, Preamble
from quiver.formats.reader import ContextFile
from tests.fuzz.harness import reseal
from tests.support.helpers import executables


def _save(family: dict[str, onnx.ModelProto], path: Path, prepare_ahead: bool = True) -> Path:
    with quiver.Context.create("cpu", workdir=path.parent) as context:
        for name, model in family.items():
            context.add_graph(name, model)
        context.save(path, prepare_ahead=prepare_ahead)
    return path


def _run(path: Path | bytes, ids: np.ndarray, backend: Any = "cpu") -> tuple[dict[str, np.ndarray], dict[str, bool]]:
    """Each graph's first output, and whether its sessions came from the prepared form."""
    with quiver.Context.from_binary(path, backend=backend) as context:
        outputs = {n: context.graph(n).execute({"input_ids": ids})["last_hidden_state"] for n in context.graph_names}
        used = {name: executable.prepared for name, executable in executables(context).items()}
    return outputs, used


def test_a_saved_context_stores_onnx_runtimes_form_of_each_graph(family_context: Path) -> None:
    file = ContextFile.open(family_context)
    assert all([f.runtime for f in g.prepared] == [cpu_prepared.RUNTIME] for g in file.graphs.values())
    assert file.verify() == []


def test_finalize_alone_or_save_without_preparing_stores_no_prepared_form(family: dict, tmp_path: Path) -> None:
    with quiver.Context.create("cpu", workdir=tmp_path) as context:
        for name, model in family.items():
            context.add_graph(name, model)
        context.finalize()
        assert all(not g.prepared for g in context.file.graphs.values())
    saved = ContextFile.open(_save(family, tmp_path / "plain.qctx", prepare_ahead=False))
    assert all(not g.prepared for g in saved.graphs.values())


def test_the_prepared_form_answers_as_the_portable_skeleton_and_as_onnx_runtime(
    family: dict, family_context: Path, input_ids: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared, used = _run(family_context, input_ids)
    assert all(used.values())
    monkeypatch.setattr(cpu_prepared, "RUNTIME", "onnxruntime 0.0.1")  # a form another ORT made: not used
    portable, used = _run(family_context, input_ids)
    assert not any(used.values())
    for name, ours in prepared.items():
        theirs = ort.InferenceSession(family[name].SerializeToString()).run(None, {"input_ids": input_ids})[0]
        np.testing.assert_allclose(ours, portable[name], rtol=0, atol=1e-5 * np.abs(theirs).max())
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_a_level_below_the_one_the_form_was_made_at_uses_the_portable_skeleton(
    family_context: Path, input_ids: np.ndarray
) -> None:
    basic = cpu.CpuBackend(graph_optimization_level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    _, used = _run(family_context, input_ids, backend=basic)
    assert not any(used.values())


def test_a_prepared_form_onnx_runtime_refuses_falls_back_to_the_portable_skeleton(
    family: dict, tmp_path: Path, input_ids: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = cpu_prepared.prepare

    def refused_at_open(*args: Any, **kwargs: Any) -> Any:
        form = made(*args, **kwargs)
        graph = form.model.graph
        graph.node.append(onnx.helper.make_node("NoSuchOp", [graph.input[0].name], ["unused"]))
        return form

    monkeypatch.setattr(cpu_prepared, "prepare", refused_at_open)
    path = _save(family, tmp_path / "refused.qctx")
    monkeypatch.undo()
    outputs, used = _run(path, input_ids)
    assert not any(used.values())
    theirs = ort.InferenceSession(family["base"].SerializeToString()).run(None, {"input_ids": input_ids})[0]
    np.testing.assert_allclose(outputs["base"], theirs, rtol=0, atol=1e-4)


def test_a_prepared_form_mapped_to_a_weight_of_another_shape_is_refused(
    family_context: Path, input_ids: np.ndarray
) -> None:
    data = family_context.read_bytes()
    _, preamble = Preamble.unpack(data[:PREAMBLE_SIZE])
    header = json.loads(data[preamble.header_offset :])
    weights = header["graphs"][0]["prepared"][0]["weights"]
    first = next(iter(weights))
    shapes = [w["shape"] for w in header["weights"]]
    weights[first] = next(i for i, shape in enumerate(shapes) if shape != shapes[weights[first]])
    damaged = reseal(data, json.dumps(header).encode())
    with pytest.raises(quiver.InvalidHeaderError, match="prepared form 0 initializer .* does not match weight"):
        _run(damaged, input_ids)


def test_only_a_form_with_layout_sensitive_nodes_keeps_onnx_runtimes_layout_pass() -> None:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 4, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    for op, level in (("Conv", "all"), ("MaxPool", "all"), ("MatMul", "disabled"), ("Relu", "disabled")):
        node = onnx.helper.make_node(op, ["x", "x"][: 2 if op in ("Conv", "MatMul") else 1], ["y"])
        model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y]))
        assert cpu_prepared.open_level(model, "all") == level, op
    conv = onnx.helper.make_graph([onnx.helper.make_node("Conv", ["x", "x"], ["y"])], "body", [], [y])
    branch = onnx.helper.make_node("If", ["c"], ["y"], then_branch=conv, else_branch=conv)
    nested = onnx.helper.make_model(onnx.helper.make_graph([branch], "g", [x], [y]))
    assert cpu_prepared.open_level(nested, "all") == "all"  # a Conv in a subgraph counts too


def test_a_lora_graphs_prepared_form_follows_sections_and_strengths_as_the_reference_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quiver.lora.create import ALPHA_INPUT, updateable_tensors, use_case_values
    from quiver.lora.peft import load_peft_adapter
    from tests.support.peft_models import BASE_WEIGHTS, CHAIN, ORDER, dynamo_like_model, write_adapter
    from tests.support.peft_models import lora_graph_of as _lora_graph

    modules = {m: (i, o) for m, i, o in CHAIN}
    config = {"lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    first = write_adapter(tmp_path / "a", {**config, "r": 4}, seed=1, modules=modules)
    second = write_adapter(tmp_path / "b", {**config, "r": 2}, seed=2, modules=modules)
    adapters = {ORDER[0]: load_peft_adapter(first), ORDER[1]: load_peft_adapter(second)}
    lora_model, slots = _lora_graph(adapters, dynamo_like_model(BASE_WEIGHTS))
    monkeypatch.setattr(cpu_prepared, "_ADDED_BYTES_BUDGET", 1e6)  # this model is tiny: keep its form anyway
    with quiver.Context.create("cpu", workdir=tmp_path) as context:
        context.add_graph("g", lora_model, updateable=updateable_tensors(slots))
        path = context.save(tmp_path / "lora.qctx")
    assert ContextFile.open(path).graphs["g"].prepared
    x = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    runs: dict[str, list[np.ndarray]] = {}
    for backend in ("cpu", "reference"):
        with quiver.Context.from_binary(path, backend=backend) as loaded:
            graph = loaded.graph("g")
            graph.update_tensors(use_case_values(slots, adapters, ORDER, ORDER))
            graph.finalize()
            strengths = [[1.0, 1.0], [0.5, 0.0], [0.0, 2.0]]
            runs[backend] = [graph.execute({"x": x, ALPHA_INPUT: np.array(s, np.float32)})["y"] for s in strengths]
            if backend == "cpu":
                assert all(e.prepared for e in executables(loaded).values())
    for ours, exact in zip(runs["cpu"], runs["reference"]):
        np.testing.assert_allclose(ours, exact, atol=1e-5, rtol=1e-5)


def test_a_graph_over_the_size_limit_is_left_to_be_prepared_at_open(
    family: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_prepared, "_LARGEST_PREPARED", 1 << 20)  # the family's graphs weigh more
    saved = ContextFile.open(_save(family, tmp_path / "large.qctx"))
    assert all(not g.prepared for g in saved.graphs.values())

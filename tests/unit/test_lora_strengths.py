"""The cpu backend folds LoRA strengths into the up-projection weights: same outputs, fewer nodes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import quiver
from quiver.backends.cpu.lora_strengths import fold_lora_strengths
from quiver.errors import QuiverError
from quiver.ir.edit import initializers_as_inputs
from quiver.lora.create import ALPHA_INPUT, updateable_tensors, use_case_values
from quiver.lora.peft import PeftAdapter, load_peft_adapter
from tests.support.conv_lora import W1, W2, cnn, conv_adapter
from tests.support.peft_models import BASE_WEIGHTS, CHAIN, ORDER, dynamo_like_model, write_adapter
from tests.support.peft_models import lora_graph_of as _lora_graph


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PeftAdapter]:
    """Two adapters of different ranks, the second on the q projections only (named as ORDER)."""
    root = tmp_path_factory.mktemp("adapters")
    modules = {m: (i, o) for m, i, o in CHAIN}
    q_only = {m: shape for m, shape in modules.items() if m.endswith("q_proj")}
    first = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    second = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    return {
        ORDER[0]: load_peft_adapter(write_adapter(root / "first", first, seed=1, modules=modules)),
        ORDER[1]: load_peft_adapter(write_adapter(root / "second", second, seed=2, modules=q_only)),
    }


def _strength_nodes(model: onnx.ModelProto) -> list[str]:
    """Nodes that read the strengths input, and the Muls that scale rank columns."""
    return [n.name for n in model.graph.node if ALPHA_INPUT in n.input or n.name.endswith(".scale")]


def test_every_branch_of_a_linear_graph_is_folded(adapters: dict[str, PeftAdapter]) -> None:
    lora_model, slots = _lora_graph(adapters, dynamo_like_model(BASE_WEIGHTS))
    backend_model = initializers_as_inputs(lora_model, set(updateable_tensors(slots)))
    assert len(_strength_nodes(backend_model)) == 2 * len(slots)

    folded, folding = fold_lora_strengths(backend_model)

    assert folding is not None
    assert _strength_nodes(folded) == []
    assert len(folded.graph.node) == len(backend_model.graph.node) - 2 * len(slots)
    inputs = {i.name for i in folded.graph.input}
    assert ALPHA_INPUT not in inputs and not any(s.b_name in inputs or s.index_name in inputs for s in slots)
    assert all(f"{s.b_name}.scaled_by_strength" in inputs and s.a_name in inputs for s in slots)
    onnx.checker.check_model(folded)


def test_at_strength_one_the_sections_b_is_bound_itself_and_other_strengths_scale_a_copy(
    adapters: dict[str, PeftAdapter],
) -> None:
    lora_model, slots = _lora_graph(adapters, dynamo_like_model(BASE_WEIGHTS))
    _, folding = fold_lora_strengths(initializers_as_inputs(lora_model, set(updateable_tensors(slots))))
    assert folding is not None
    values = use_case_values(slots, adapters, ORDER, ORDER)
    slot = slots[0]
    b = values[slot.b_name]

    _, bound = folding.apply({ALPHA_INPUT: np.ones(2, np.float32)}, values)
    assert bound[f"{slot.b_name}.scaled_by_strength"] is b  # no copy
    assert bound is folding.apply({ALPHA_INPUT: np.ones(2, np.float32)}, values)[1]  # same strengths: reused

    _, bound = folding.apply({ALPHA_INPUT: np.array([0.5, 2.0], np.float32)}, values)
    columns = np.array([0.5, 2.0], np.float32)[values[slot.index_name]]
    np.testing.assert_array_equal(bound[f"{slot.b_name}.scaled_by_strength"], b * columns[:, None])


def test_a_graph_without_lora_branches_is_left_alone() -> None:
    base = dynamo_like_model(BASE_WEIGHTS)
    assert fold_lora_strengths(base) == (base, None)


def _context(tmp_path: Path, model: onnx.ModelProto, slots: list) -> Path:
    path = tmp_path / "lora.qctx"
    with quiver.Context.create("cpu") as context:
        context.add_graph("g", model, updateable=updateable_tensors(slots))
        context.save(path)
    return path


def test_changing_strengths_between_runs_matches_the_reference_backend(
    adapters: dict[str, PeftAdapter], tmp_path: Path
) -> None:
    lora_model, slots = _lora_graph(adapters, dynamo_like_model(BASE_WEIGHTS))
    path = _context(tmp_path, lora_model, slots)
    values = use_case_values(slots, adapters, ORDER, ORDER)
    x = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    runs = {}
    for backend in ("cpu", "reference"):
        context = quiver.Context.from_binary(path, backend=backend)
        graph = context.graph("g")
        graph.update_tensors(values)
        graph.finalize()
        # back and forth: each run must use its own strengths, not the ones folded for the run before
        strengths = [[1.0, 1.0], [0.5, 0.0], [1.0, 1.0], [0.0, 2.0], [0.5, 0.0]]
        runs[backend] = [graph.execute({"x": x, ALPHA_INPUT: np.array(s, np.float32)})["y"] for s in strengths]
        context.close()
    for ours, exact in zip(runs["cpu"], runs["reference"]):
        np.testing.assert_allclose(ours, exact, atol=1e-5, rtol=1e-5)
    assert not np.allclose(runs["cpu"][0], runs["cpu"][1])


def test_conv_branches_are_folded_and_match_the_reference_backend(tmp_path: Path) -> None:
    conv_adapters = {
        "a": load_peft_adapter(conv_adapter(tmp_path / "a", rank=2, seed=1)),
        "b": load_peft_adapter(conv_adapter(tmp_path / "b", rank=3, seed=2)),
    }
    lora_model, slots = _lora_graph(conv_adapters, cnn(W1, W2))
    folded, _ = fold_lora_strengths(initializers_as_inputs(lora_model, {t for s in slots for t in s.tensors}))
    assert _strength_nodes(folded) == []
    path = _context(tmp_path, lora_model, slots)
    x = np.random.default_rng(5).standard_normal((2, 3, 9, 9)).astype(np.float32)
    outputs = {}
    for backend in ("cpu", "reference"):
        context = quiver.Context.from_binary(path, backend=backend)
        graph = context.graph("g")
        graph.update_tensors(use_case_values(slots, conv_adapters, ["a", "b"], ["a", "b"]))
        graph.finalize()
        outputs[backend] = graph.execute({"x": x, ALPHA_INPUT: np.array([0.5, 1.5], np.float32)})["y"]
        context.close()
    np.testing.assert_allclose(outputs["cpu"], outputs["reference"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_an_adapter_index_past_the_strengths_is_a_quiver_error(
    adapters: dict[str, PeftAdapter], tmp_path: Path, backend: str
) -> None:
    lora_model, slots = _lora_graph(adapters, dynamo_like_model(BASE_WEIGHTS))
    path = _context(tmp_path, lora_model, slots)
    values = use_case_values(slots, adapters, ORDER, ORDER)
    values[slots[0].index_name] = np.full_like(values[slots[0].index_name], 7)  # only 2 adapters
    context = quiver.Context.from_binary(path, backend=backend)
    context.graph("g").update_tensors(values)
    context.finalize()
    x = np.zeros((1, 16), np.float32)
    with pytest.raises(QuiverError, match="index"):
        context.graph("g").execute({"x": x, ALPHA_INPUT: np.ones(2, np.float32)})
    context.close()

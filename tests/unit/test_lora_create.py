"""The max-rank LoRA graph serves every use case: outputs equal the merged-weight model, on both backends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import quiver
from quiver.lora.attach import find_attach_points
from quiver.lora.create import ALPHA_INPUT, create_lora_graph, slot_ranks, updateable_tensors, use_case_values
from quiver.lora.peft import PeftAdapter, load_peft_adapter
from tests.support.peft_models import (
    BASE_WEIGHTS,
    CHAIN,
    ORDER,
    dynamo_like_model,
    dynamo_linear,
    merged,
    write_adapter,
)
from tests.support.peft_models import _chain_model as _model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PeftAdapter]:
    root = tmp_path_factory.mktemp("adapters")
    modules = {m: (i, o) for m, i, o in CHAIN}
    q_only = {m: s for m, s in modules.items() if m.endswith("q_proj")}
    return {
        "elementary": load_peft_adapter(
            write_adapter(
                root / "elementary",
                {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                seed=1,
                modules=modules,
            )
        ),
        "long": load_peft_adapter(
            write_adapter(
                root / "long",
                {"r": 2, "lora_alpha": 4, "use_rslora": True, "target_modules": ["q_proj"]},
                seed=2,
                modules=q_only,
            )
        ),
    }


USE_CASES = {"base": [], "elementary": ["elementary"], "long": ["long"], "elementary_long": ["elementary", "long"]}


@pytest.fixture(scope="module")
def lora_context(adapters: dict[str, PeftAdapter], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    base = dynamo_like_model(BASE_WEIGHTS)
    modules = sorted({m for a in adapters.values() for m in a.modules})
    points, missing = find_attach_points(base, modules)
    assert missing == [] and all(p.found_by == "name_scopes" for p in points.values())
    ranks = slot_ranks(adapters, USE_CASES)
    assert ranks["model.layers.0.self_attn.q_proj"] == 6 and ranks["model.layers.0.self_attn.v_proj"] == 4
    lora_model, slots = create_lora_graph(base, points, ranks, len(ORDER))
    path = tmp_path_factory.mktemp("lora") / "lora.qctx"
    with quiver.Context.create("cpu") as context:
        context.add_graph("llama", lora_model, updateable=updateable_tensors(slots))
        context.save(path)
    return path, slots


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("use_case", list(USE_CASES))
@pytest.mark.parametrize("strength", [0.0, 0.5, 1.0])
def test_every_use_case_and_strength_matches_the_merged_weights(
    adapters: dict, lora_context: tuple, backend: str, use_case: str, strength: float
) -> None:
    path, slots = lora_context
    active = USE_CASES[use_case]
    context = quiver.Context.from_binary(path, backend=backend)
    graph = context.graph("llama")
    graph.update_tensors(use_case_values(slots, adapters, active, ORDER))
    graph.finalize()
    alphas = np.array([strength if name in active else 0.0 for name in ORDER], np.float32)
    x = np.random.default_rng(9).standard_normal((5, 16)).astype(np.float32)
    ours = graph.execute({"x": x, ALPHA_INPUT: alphas})["y"]
    expected_model = merged(adapters, {name: strength for name in active})
    theirs = ort.InferenceSession(expected_model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_two_adapters_at_once_take_their_own_strengths(adapters: dict, lora_context: tuple) -> None:
    path, slots = lora_context
    context = quiver.Context.from_binary(path, backend="cpu")
    context.graph("llama").update_tensors(use_case_values(slots, adapters, ["elementary", "long"], ORDER))
    context.finalize()
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    ours = context.graph("llama").execute({"x": x, ALPHA_INPUT: np.array([0.25, 1.5], np.float32)})["y"]
    theirs = ort.InferenceSession(merged(adapters, {"elementary": 0.25, "long": 1.5}).SerializeToString()).run(
        None, {"x": x}
    )[0]
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_an_adapter_for_another_base_model_is_refused(adapters: dict, lora_context: tuple, tmp_path: Path) -> None:
    _, slots = lora_context
    wrong = {m: (3, 3) for m, _, _ in CHAIN}
    other = load_peft_adapter(
        write_adapter(
            tmp_path / "other", {"r": 1, "lora_alpha": 1, "target_modules": ["q_proj", "v_proj"]}, modules=wrong
        )
    )
    with pytest.raises(quiver.AdapterError, match="wrong base model"):
        use_case_values(slots, {"other": other}, ["other"], ["other"])


def test_rank_and_alpha_patterns_and_fan_in_fan_out_match_the_merged_weights(tmp_path: Path) -> None:
    # fan_in_fan_out changes how PEFT stores the *base* weight (Conv1D); A and B, and so the branch, are as usual.
    config = {
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "v_proj"],
        "fan_in_fan_out": True,
        "rank_pattern": {"v_proj": 2},
        "alpha_pattern": {"layers.1.self_attn.q_proj": 16},
    }
    modules = {m: (i, o) for m, i, o in CHAIN}
    ranks = {m: 2 for m in modules if m.endswith("v_proj")}
    adapters = {"patterned": load_peft_adapter(write_adapter(tmp_path / "p", config, ranks, seed=5, modules=modules))}
    base = dynamo_like_model(BASE_WEIGHTS)
    points, _ = find_attach_points(base, sorted(adapters["patterned"].modules))
    lora_model, slots = create_lora_graph(base, points, slot_ranks(adapters, {"p": ["patterned"]}), 1)
    assert {s.attach.module: s.rank for s in slots}["model.layers.0.self_attn.v_proj"] == 2
    with quiver.Context.create("reference") as context:
        context.add_graph("g", lora_model, updateable=updateable_tensors(slots))
        graph = context.finalize().graph("g")
        graph.update_tensors(use_case_values(slots, adapters, ["patterned"], ["patterned"]))
        graph.finalize()
        x = np.random.default_rng(6).standard_normal((3, 16)).astype(np.float32)
        ours = graph.execute({"x": x, ALPHA_INPUT: np.array([1.0], np.float32)})["y"]
    theirs = ort.InferenceSession(merged(adapters, {"patterned": 1.0}).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def _fork_model(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """q, k and v projections of one input, summed: the shape of attention's input projections."""
    nodes = [dynamo_linear("x", f"val_{i}", f"linear_{i}", module) for i, module in enumerate(weights)]
    nodes.append(helper.make_node("Sum", [f"linear_{i}" for i in range(len(weights))], ["y"]))
    initializers = [numpy_helper.from_array(w, f"val_{i}") for i, w in enumerate(weights.values())]
    return _model("fork", nodes, initializers, 16)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_projections_of_one_input_share_one_down_projection(tmp_path: Path, backend: str) -> None:
    fork = [f"model.layers.0.self_attn.{p}_proj" for p in ("q", "k", "v")]
    weights = {m: np.random.default_rng(i).standard_normal((16, 16)).astype(np.float32) for i, m in enumerate(fork)}
    modules = {m: (16, 16) for m in fork}
    wide = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj"]}
    narrow = {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}
    adapters = {
        "wide": load_peft_adapter(write_adapter(tmp_path / "w", wide, seed=7, modules=modules)),
        "narrow": load_peft_adapter(write_adapter(tmp_path / "n", narrow, seed=8, modules={fork[0]: (16, 16)})),
    }
    base = _fork_model(weights)
    points, _ = find_attach_points(base, fork)
    lora_model, slots = create_lora_graph(base, points, slot_ranks(adapters, {"both": ["wide", "narrow"]}), 2)
    assert len({s.a_name for s in slots}) == 1  # q (rank 4 + 2), k and v (4 each) side by side in one A
    assert [n.op_type for n in lora_model.graph.node].count("Split") == 1
    with quiver.Context.create(backend) as context:
        context.add_graph("g", lora_model, updateable=updateable_tensors(slots))
        graph = context.finalize().graph("g")
        graph.update_tensors(use_case_values(slots, adapters, ["wide", "narrow"], ["wide", "narrow"]))
        graph.finalize()
        x = np.random.default_rng(9).standard_normal((3, 16)).astype(np.float32)
        ours = graph.execute({"x": x, ALPHA_INPUT: np.array([0.5, 1.5], np.float32)})["y"]
    exact = x @ sum(weights.values())
    for name, alpha in (("wide", 0.5), ("narrow", 1.5)):
        exact += sum(alpha * (x @ lora.delta().T) for lora in adapters[name].modules.values())
    np.testing.assert_allclose(ours, exact, atol=1e-4, rtol=1e-4)

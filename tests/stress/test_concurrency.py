"""Servers: threads racing switches, per-run adapters, shared sessions, eviction, fork (tests/stress)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import quiver
from quiver.testing.family import BENCH, make_family
from tests.stress import concurrency
from tests.stress.concurrency import LoraProject, X

SECONDS = 3.0  # per race here; `python -m tests.stress.concurrency --seconds 60` for the long one


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> LoraProject:
    return concurrency.make_lora_project(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def valid(project: LoraProject) -> dict[str, np.ndarray]:
    outputs = concurrency.valid_outputs(project)
    distinct = {name: output for name, output in outputs.items() if name != "elementary"}
    for name, output in distinct.items():  # the states must be told apart, or the races prove nothing
        others = [o for n, o in distinct.items() if n != name]
        assert not any(np.allclose(output, other, rtol=1e-5, atol=1e-5) for other in others), name
    return outputs


@pytest.mark.parametrize("bound", [False, True], ids=["execute", "bound-runs"])
def test_runs_racing_section_and_strength_switches_see_only_applied_states(
    project: LoraProject, valid: dict[str, np.ndarray], bound: bool
) -> None:
    report = concurrency.switching_sections(project, SECONDS, bound=bound)
    assert report["runs"] > 100 and report["states_seen"] >= 4
    assert report["invalid"] == 0


def test_concurrent_runs_with_different_per_run_adapters_each_get_their_own(project: LoraProject) -> None:
    report = concurrency.per_run_adapters(project, SECONDS)
    assert report["runs"] > 100 and report["wrong_adapter"] == 0


def test_shared_sessions_keep_their_own_adapters_in_any_order(
    project: LoraProject, valid: dict[str, np.ndarray]
) -> None:
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("ep.share_ep_contexts", "1")
    model = str(project.folder / "model_ctx.onnx")
    plain, adapted = (quiver.ort.InferenceSession(model, options) for _ in range(2))
    adapter = quiver.ort.LoraAdapter()
    adapter.Load(str(project.section("strong")))
    run_options = quiver.ort.RunOptions()
    run_options.add_active_adapter(adapter)
    for order in ([adapted, plain, adapted, plain], [plain, adapted, adapted, plain, plain]):
        for session in order:
            output = session.run(None, {"x": X}, run_options if session is adapted else None)[0]
            np.testing.assert_allclose(output, valid["strong" if session is adapted else "base"], rtol=1e-5, atol=1e-5)
    plain.close()
    adapted.close()


def test_views_share_weights_but_not_applied_sections(project: LoraProject, valid: dict[str, np.ndarray]) -> None:
    with quiver.Context.from_binary(project.context) as context:
        view = context.view()
        assert view._store is context._store
        context.apply_binary_section("model", project.section("strong"))
        view.apply_binary_section("model", project.section("elementary"))
        view.graph("model").set_lora_strength("elementary", 0.0)
        np.testing.assert_allclose(context.graph("model").execute({"x": X})["y"], valid["strong"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(view.graph("model").execute({"x": X})["y"], valid["base"], rtol=1e-5, atol=1e-5)
        assert context.graph("model").lora_strengths == {"elementary": 2.0, "long": 1.0}
        view.close()
        # the context goes on after one of its handles closed; the weights go with the last one
        np.testing.assert_allclose(context.graph("model").execute({"x": X})["y"], valid["strong"], rtol=1e-5, atol=1e-5)
    with pytest.raises(quiver.ContextStateError, match="closed"):
        view.graph("model").execute({"x": X})


def test_eviction_under_threads_never_fails_a_run(family_context: Path) -> None:
    report = concurrency.eviction(family_context, SECONDS)
    assert report["runs"] > 20
    assert report["failures"] == 0, report["first_failures"]


def test_a_child_forked_while_the_parent_packs_runs_and_exits_normally(tmp_path: Path) -> None:
    context = quiver.Context.create("cpu", workdir=tmp_path)
    for name, model in list(make_family(BENCH, count=2).items()):
        context.add_graph(name, model)  # large enough that packing is under way at the fork
    path = context.save(tmp_path / "bench.qctx")
    context.close()
    report = concurrency.fork_after_execute(path)
    forks = len(concurrency.FORK_DELAYS)
    expected = {"hung": False, "forks": forks, "children_ok": forks, "child_exits": [0], "parents_ok": forks}
    assert report == {**expected, "stderr": ""}


def test_a_section_whose_strengths_the_graph_cannot_take_is_refused_and_nothing_changes(
    project: LoraProject, valid: dict[str, np.ndarray], tmp_path: Path
) -> None:
    with quiver.Context.from_binary(project.context) as context:
        context.apply_binary_section("model", project.section("elementary"))
        good = quiver.Context.from_binary(project.context)
        good.apply_binary_section("model", project.section("strong"))
        for lora in (
            {"alpha_input": "not_an_input", "adapters": ["elementary", "long"], "alphas": [1.0, 1.0]},
            {"alpha_input": "lora_alpha", "adapters": ["a", "b", "c"], "alphas": [1.0, 1.0, 1.0]},
            {"alpha_input": "lora_alpha", "adapters": ["elementary", "long"], "alphas": [float("nan"), 1.0]},
            {"alpha_input": "lora_alpha", "adapters": "elementary", "alphas": 1},
        ):
            bad = good.get_binary_section("model", metadata={"lora": lora})
            with pytest.raises(quiver.SectionMismatchError, match="lora metadata"):
                context.apply_binary_section("model", bad)
        good.close()
        np.testing.assert_allclose(
            context.graph("model").execute({"x": X})["y"], valid["elementary"], rtol=1e-5, atol=1e-5
        )

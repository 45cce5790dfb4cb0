"""LoRA on Conv attach points (PEFT's Conv2d LoRA): the branch copies the base conv's geometry; exact math."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import quiver
from quiver.lora.attach import find_attach_points
from quiver.lora.create import ALPHA_INPUT, create_lora_graph, slot_ranks, updateable_tensors, use_case_values
from quiver.lora.peft import load_peft_adapter
from tests.support.conv_lora import W1, W2, cnn, conv_adapter


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_conv_lora_use_cases_match_the_merged_conv_weights(tmp_path: Path, backend: str) -> None:
    adapters = {
        "a": load_peft_adapter(conv_adapter(tmp_path / "a", 2, 1)),
        "b": load_peft_adapter(conv_adapter(tmp_path / "b", 3, 2)),
    }
    base = cnn(W1, W2)
    points, missing = find_attach_points(base, ["features.0", "features.2"])
    assert missing == [] and points["features.0"].op_type == "Conv" and points["features.0"].kernel == (3, 3)
    lora_model, slots = create_lora_graph(base, points, slot_ranks(adapters, {"ab": ["a", "b"]}), 2)
    x = np.random.default_rng(3).standard_normal((2, 3, 9, 9)).astype(np.float32)
    with quiver.Context.create(backend) as context:
        context.add_graph("cnn", lora_model, updateable=updateable_tensors(slots))
        graph = context.finalize().graph("cnn")
        graph.update_tensors(use_case_values(slots, adapters, ["a", "b"], ["a", "b"]))
        graph.finalize()
        ours = graph.execute({"x": x, ALPHA_INPUT: np.array([0.5, 1.0], np.float32)})["y"]
    w1 = W1 + 0.5 * adapters["a"].modules["features.0"].delta() + adapters["b"].modules["features.0"].delta()
    w2 = W2 + 0.5 * adapters["a"].modules["features.2"].delta() + adapters["b"].modules["features.2"].delta()
    theirs = ort.InferenceSession(cnn(w1, w2).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_linear_adapter_on_a_conv_attach_point_is_refused(tmp_path: Path) -> None:
    from tests.support.peft_models import write_adapter

    linear = load_peft_adapter(
        write_adapter(
            tmp_path / "lin", {"r": 2, "lora_alpha": 2, "target_modules": ["0"]}, modules={"features.0": (3, 8)}
        )
    )
    points, _ = find_attach_points(cnn(W1, W2), ["features.0"])
    _, slots = create_lora_graph(cnn(W1, W2), points, {"features.0": 2}, 1)
    with pytest.raises(quiver.AdapterError, match="wrong base model"):
        use_case_values(slots, {"lin": linear}, ["lin"], ["lin"])

"""LoRA on Conv attach points (PEFT's Conv2d LoRA): the branch copies the base conv's geometry; exact math."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

import quiver
from quiver.lora.attach import NAME_SCOPES, find_attach_points
from quiver.lora.create import ALPHA_INPUT, create_lora_graph, slot_ranks, updateable_tensors, use_case_values
from quiver.lora.peft import load_peft_adapter

W1 = (0.3 * np.random.default_rng(0).standard_normal((8, 3, 3, 3))).astype(np.float32)
W2 = (0.3 * np.random.default_rng(1).standard_normal((4, 8, 1, 1))).astype(np.float32)


def cnn(w1: np.ndarray, w2: np.ndarray) -> onnx.ModelProto:
    """features.0: 3x3 conv, stride 2, pad 1; Relu; features.2: 1x1 conv. Module paths as dynamo records them."""
    nodes = [
        helper.make_node("Conv", ["x", "val_1"], ["c1"], name="conv_1", strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "val_2"], ["y"], name="conv_2"),
    ]
    for node, module in ((nodes[0], "features.0"), (nodes[2], "features.2")):
        node.metadata_props.add(key=NAME_SCOPES, value=repr(["", "features", module, "conv2d"]))
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "val_1"), numpy_helper.from_array(w2, "val_2")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def conv_adapter(folder: Path, rank: int, seed: int) -> Path:
    """A PEFT Conv2d LoRA: lora_A is a conv like the base one [r, in, kh, kw], lora_B a 1x1 conv [out, r, 1, 1]."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, weight in (("features.0", W1), ("features.2", W2)):
        out, fan_in, kh, kw = weight.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((rank, fan_in, kh, kw)).astype(
            np.float32
        )
        tensors[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((out, rank, 1, 1)).astype(np.float32)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        f'{{"peft_type": "LORA", "r": {rank}, "lora_alpha": {2 * rank}, "target_modules": ["0", "2"]}}'
    )
    return folder


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
    from tests.test_lora_inputs import write_adapter

    linear = load_peft_adapter(
        write_adapter(
            tmp_path / "lin", {"r": 2, "lora_alpha": 2, "target_modules": ["0"]}, modules={"features.0": (3, 8)}
        )
    )
    points, _ = find_attach_points(cnn(W1, W2), ["features.0"])
    _, slots = create_lora_graph(cnn(W1, W2), points, {"features.0": 2}, 1)
    with pytest.raises(quiver.AdapterError, match="wrong base model"):
        use_case_values(slots, {"lin": linear}, ["lin"], ["lin"])

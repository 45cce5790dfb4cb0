"""A small CNN as torch.onnx (dynamo) exports it, and PEFT Conv2d LoRA adapters for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

from quiver.lora.attach import NAME_SCOPES

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

"""One linear with a LoRA branch as it looks after export (y = x·W + (x·A)·B, A and B zero until an
adapter fills them), adapters for it, and the exact output each gives."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IN, OUT, RANK = 16, 12, 4


RNG = np.random.default_rng(0)


W = RNG.standard_normal((IN, OUT)).astype(np.float32)


def lora_branch_model(name: str = "lora", batch: int | str = "n") -> onnx.ModelProto:
    """y = x·W + (x·A)·B, as a LoRA branch looks after export; A and B start at zero (no adapter)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["base"]),
        helper.make_node("MatMul", ["x", "lora_A"], ["xa"]),
        helper.make_node("MatMul", ["xa", "lora_B"], ["delta"]),
        helper.make_node("Add", ["base", "delta"], ["y"]),
    ]
    initializers = [
        numpy_helper.from_array(W, "W"),
        numpy_helper.from_array(np.zeros((IN, RANK), np.float32), "lora_A"),
        numpy_helper.from_array(np.zeros((RANK, OUT), np.float32), "lora_B"),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, OUT])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def branch_adapter(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "lora_A": rng.standard_normal((IN, RANK)).astype(np.float32),
        "lora_B": rng.standard_normal((RANK, OUT)).astype(np.float32),
    }


def branch_expected(x: np.ndarray, adapter: dict[str, np.ndarray] | None) -> np.ndarray:
    y = x @ W
    return y if adapter is None else y + (x @ adapter["lora_A"]) @ adapter["lora_B"]


BRANCH_X = RNG.standard_normal((3, IN)).astype(np.float32)

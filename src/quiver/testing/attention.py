"""One attention node as a model, Quiver's DecodeAttention or ONNX Runtime's GroupQueryAttention, for the
kernel's tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
from onnx import TensorProto, helper

from quiver.ir.quiver_ops import QUIVER_DOMAIN

# GroupQueryAttention's inputs, in order (DecodeAttention takes the same)
INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos", "sin")
OUTPUTS = ("out", "present_key", "present_value")
_INT32 = {"seqlens_k", "total_sequence_length"}


def attention_model(op: str, domain: str, given: Sequence[str], **attributes: Any) -> onnx.ModelProto:
    """A model of one `op` node (domain `domain`) whose inputs are the names of `given` among `INPUTS` (the
    others left out, as ONNX omits optional inputs), its outputs `OUTPUTS`, with `attributes`."""
    last = max(INPUTS.index(name) for name in given)
    node = helper.make_node(
        op, [name if name in given else "" for name in INPUTS[: last + 1]], list(OUTPUTS), domain=domain, **attributes
    )
    graph = helper.make_graph(
        [node], "attention",
        [helper.make_tensor_value_info(n, TensorProto.INT32 if n in _INT32 else TensorProto.FLOAT, None)
         for n in INPUTS if n in given],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in OUTPUTS],
    )  # fmt: skip
    opsets = [helper.make_opsetid(d, 21 if d == "" else 1) for d in ("", "com.microsoft", QUIVER_DOMAIN)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)

"""Which operators Quiver takes on, and the QNN EP's list (the floor of every backend, DESIGN.md)."""

from __future__ import annotations

from collections import Counter

import onnx

from quiver.ir.edit import iter_nodes
from quiver.ir.quiver_ops import QUIVER_DOMAIN, QUIVER_OPS

# The QNN execution provider's list (DESIGN.md): the floor for every backend.
QNN_EP_OPS = frozenset(
    """
Abs Add And ArgMax ArgMin Asin Atan AveragePool BatchNormalization Cast Clip Concat Conv ConvTranspose Cos
DepthToSpace DequantizeLinear Div Elu Equal Exp Expand Flatten Floor Gather Gelu Gemm GlobalAveragePool Greater
GreaterOrEqual GridSample HardSwish InstanceNormalization LRN LayerNormalization LeakyRelu Less LessOrEqual Log
LogSoftmax LpNormalization MatMul Max MaxPool Min Mul Neg Not Or PRelu Pad Pow QuantizeLinear ReduceMax ReduceMean
ReduceMin ReduceProd ReduceSum Relu Resize Round Sigmoid Sign Sin Slice Softmax SpaceToDepth Split Sqrt Squeeze Sub
Tanh Tile TopK Transpose Unsqueeze Where
""".split()
)

MS_DOMAIN = "com.microsoft"
# Domains whose operators Quiver takes on: ONNX's own (every operator with a schema, control flow and
# sequences included) and ONNX Runtime's contrib domain (its cpu backend refuses, when it prepares a
# graph, an operator it has no kernel for).
_ONNX_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
# ONNX Runtime's kernels registered in ONNX's own domain without an ONNX schema: its fusions write them,
# and so do exporters built on it (onnxruntime-genai's model builder ends a decoder with one).
ORT_ONNX_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def use_microsoft_domain(model: onnx.ModelProto) -> None:
    """Declares ONNX Runtime's contrib opset (com.microsoft, version 1) unless the model does already."""
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=MS_DOMAIN, version=1)


def use_quiver_domain(model: onnx.ModelProto) -> None:
    """Declares Quiver's own opset (ai.quiver, version 1) unless the model does already."""
    if not any(o.domain == QUIVER_DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=QUIVER_DOMAIN, version=1)


def schema_checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (changed in place: give a copy) with ORT's schema-less ONNX-domain operators moved to the
    contrib domain, where ONNX's checker lets operators it has no schema for pass."""
    moved = False
    for node in iter_nodes(model.graph):
        if node.domain in ("", "ai.onnx") and node.op_type in ORT_ONNX_DOMAIN_OPS:
            node.domain, moved = MS_DOMAIN, True
    if moved:
        use_microsoft_domain(model)
    return model


def op_id(node: onnx.NodeProto) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def is_supported(node: onnx.NodeProto) -> bool:
    """An operator of ONNX's (any version), of ONNX Runtime's contrib domain, or one of Quiver's own."""
    if node.domain == MS_DOMAIN or (node.domain == QUIVER_DOMAIN and node.op_type in QUIVER_OPS):
        return True
    domain = "" if node.domain == "ai.onnx" else node.domain
    if domain == "" and node.op_type in ORT_ONNX_DOMAIN_OPS:
        return True
    return node.domain in _ONNX_DOMAINS and onnx.defs.has(node.op_type, domain)


def unsupported_operators(model: onnx.ModelProto) -> Counter[str]:
    """Unsupported operators of a model with their node counts."""
    return Counter(op_id(n) for n in iter_nodes(model.graph) if not is_supported(n))

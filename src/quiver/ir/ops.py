"""The operators every Quiver backend supports: the QNN EP list plus what real exports need."""

from __future__ import annotations

from collections import Counter

import onnx

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

# What `torch.onnx` exports of common transformers and CNNs use besides.
EXPORT_OPS = frozenset(
    """
Reshape Shape Constant Reciprocal IsNaN Range Erf Identity ConstantOfShape Trilu CumSum Einsum ScatterND
Dropout Size Mod GatherElements GatherND ScatterElements Ceil Acos Tan Softplus HardSigmoid Xor IsInf
ReduceL2 ReduceSumSquare ReduceLogSumExp Mean Sum NonZero
""".split()
)

MS_DOMAIN = "com.microsoft"
# MatMulNBits and FusedMatMul: Quiver writes them itself (passes/nbits.py, passes/transposed_weights.py);
# the LLM operators, its text-generation graphs (quiver.t2t.graph), as onnxruntime-genai's builder does.
MICROSOFT_OPS = frozenset(
    {
        "DequantizeLinear",
        "FusedMatMul",
        "Gelu",
        "GroupQueryAttention",
        "MatMulNBits",
        "QuantizeLinear",
        "SkipSimplifiedLayerNormalization",
    }
)

SUPPORTED: dict[str, frozenset[str]] = {
    "": QNN_EP_OPS | EXPORT_OPS,
    "ai.onnx": QNN_EP_OPS | EXPORT_OPS,
    MS_DOMAIN: MICROSOFT_OPS,
}


def op_id(node: onnx.NodeProto) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def is_supported(node: onnx.NodeProto) -> bool:
    return node.op_type in SUPPORTED.get(node.domain, frozenset())


def iter_nodes(graph: onnx.GraphProto):  # type: ignore[no-untyped-def]
    """Every node of a graph and of its subgraphs (If/Loop/Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from iter_nodes(sub)


def unsupported_operators(model: onnx.ModelProto) -> Counter[str]:
    """Unsupported operators of a model with their node counts."""
    return Counter(op_id(n) for n in iter_nodes(model.graph) if not is_supported(n))

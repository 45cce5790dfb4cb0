"""The model ORT is given for a graph: LoRA strengths folded, accuracy level set, and what its operators imply."""

from __future__ import annotations

import numpy as np

from quiver.backends.base import FinalizedGraph
from quiver.backends.cpu.lora_strengths import StrengthFolding, fold_lora_strengths
from quiver.backends.cpu.native_ops import lowered, native_ops, uses_native_ops
from quiver.backends.cpu.settings import SessionSettings
from quiver.errors import BackendError
from quiver.ir import proto
from quiver.ir.edit import iter_nodes
from quiver.ir.quiver_ops import MATMUL_4BITS
from quiver.ort_package import onnxruntime as ort

# Level 4 of ORT's MatMulNBits (see DEFAULT_ACCURACY_LEVEL) runs only on prepacked weights, so a graph
# with such MatMuls gets no unpacked stand-in session (it would compute in float32: another answer).
_INTEGER_MATMUL_OPS = {"MatMulNBits", "QMoE", "DequantizeLinear"}
# Before 1.32, ORT's MatMulNBits cannot keep its packed weights in a shared container (session creation
# fails): such graphs then pack their own copies, through the Python API.
_ORT_VERSION = tuple(int(p) for p in ort.__version__.split(".")[:2])
SHARED_INTEGER_PACKING = _ORT_VERSION >= (1, 32)
# Decoders with ORT's contrib MoE gave other tokens than transformers under 1.24 where the top-k weights
# stay unnormalized (Qwen's MoE; the operator alone matched numpy there: the cause is not found), equal
# ones under 1.32 (tests/integration/test_families.py): older versions are refused rather than trusted
_TRUSTED_MOE = _ORT_VERSION >= (1, 32)
# the nodes whose compute the backend's accuracy level sets: ORT's 4/8-bit MatMul, its quantized experts
# (1.32's QMoE takes MatMulNBits' levels), Quiver's 4-bit MatMul
_LEVELED_OPS = {"MatMulNBits", "QMoE", MATMUL_4BITS}

# (domain, op) of the nodes whose constant B ORT packs: its contrib FusedMatMul (a transposed-weight
# MatMul, as Quiver writes tied LM heads) packs like MatMul (measured: dropping its mapped pages after
# packing saves their RSS and costs no speed)
_PREPACKED_OPS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "FusedMatMul")}


def packable_weights(graph: FinalizedGraph) -> list[np.ndarray]:
    """The weights ORT may pack for this graph: constant B inputs of MatMul/Gemm/FusedMatMul."""
    names = {
        node.input[1]
        for node in graph.model.graph.node
        if (node.domain.replace("ai.onnx", ""), node.op_type) in _PREPACKED_OPS and len(node.input) > 1
    }
    return [graph.weights[n] for n in sorted(names) if n in graph.weights]


def packed_block_weights(graph: FinalizedGraph) -> list[np.ndarray]:
    """The 4/8-bit blocks ORT packs for MatMulNBits (B, scales, zero points): after packing its kernel reads
    its own copy, so the mapped originals' pages may go (read again, they fault back in)."""
    names = {
        name
        for node in graph.model.graph.node
        if node.domain == "com.microsoft" and node.op_type == "MatMulNBits"
        for name in node.input[1:4]
    }
    return [graph.weights[n] for n in sorted(names) if n in graph.weights]


def has_integer_matmuls(model: proto.ModelProto) -> bool:
    return any(n.op_type in _INTEGER_MATMUL_OPS for n in model.graph.node)


# Operators whose packed kernels compute otherwise than their unpacked ones (ORT's recurrent kernels pack
# their weights for another GEMM path: outputs differ in the last bits; integer and contrib kernels pack
# into their own layouts). A graph with one runs packed from its first output, which must equal every
# later one. MatMul, Gemm and FusedMatMul give the same bits either way (checked by the corpus tests).
_PACKING_CHANGES_RESULTS = {"LSTM", "GRU", "RNN", "MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul"}
# Contrib operators that pack nothing of a float graph (the skip norms convert float16 parameters only, GQA
# and rotary embeddings have no weights): a text generator's float graph is made of these and FusedMatMul.
_CONTRIB_PACKING_NOTHING = {
    "FusedMatMul",
    "GroupQueryAttention",
    "RotaryEmbedding",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
}


def packing_changes_results(model: proto.ModelProto) -> bool:
    return any(
        node.op_type in _PACKING_CHANGES_RESULTS
        or (node.domain == "com.microsoft" and node.op_type not in _CONTRIB_PACKING_NOTHING)
        for node in iter_nodes(model.graph)
    )


def _with_accuracy_level(model: proto.ModelProto, level: int) -> proto.ModelProto:
    """MatMulNBits, QMoE and MatMul4Bits nodes at the backend's accuracy level, but for those that set their own
    (as ORT runs them: a float-minimum block that needs float activations, a model exported for a given
    level). Below 4, Quiver's kernel keeps every row's activations at 16 bits (none rounded to 8)."""
    result = proto.ModelProto()
    result.CopyFrom(model)
    for node in result.graph.node:
        leveled = node.op_type in _LEVELED_OPS
        if leveled and not any(a.name == "accuracy_level" for a in node.attribute):
            node.attribute.append(proto.AttributeProto(name="accuracy_level", type=proto.AttributeProto.INT, i=level))
    return result


def _without_trailing_empty_inputs(model: proto.ModelProto) -> proto.ModelProto:
    """The model with omitted trailing optional inputs left out rather than named "" (ONNX allows both).

    ORT 1.24-1.32 crash (SIGSEGV, while creating the session) on a quantized graph whose
    LayerNormalization lists its bias as "" (found by the fuzz harness); without the "" it is fine.
    """
    if not any(node.input and not node.input[-1] for node in model.graph.node):
        return model
    result = proto.ModelProto()
    result.CopyFrom(model)
    for node in result.graph.node:
        while node.input and not node.input[-1]:
            del node.input[-1]
    return result


def session_model(graph: FinalizedGraph, settings: SessionSettings) -> tuple[proto.ModelProto, StrengthFolding | None]:
    """The model ORT is given for this graph: LoRA strengths folded, Quiver's own ops as ORT's where their
    library is not built here (`native_ops`), and Quiver's MatMulNBits at the settings' accuracy level
    (the same at build, for a prepared form, as at open)."""
    model, strengths = fold_lora_strengths(_without_trailing_empty_inputs(graph.model))
    if uses_native_ops(model):
        model = lowered(model) if native_ops().path is None else _with_accuracy_level(model, settings.accuracy_level)
    if not _TRUSTED_MOE and any(n.op_type in ("MoE", "QMoE") for n in model.graph.node):
        raise BackendError(f"graph {graph.name!r} has mixture-of-experts layers, which need onnxruntime >= 1.32 "
                           f"(this is {ort.__version__}, whose MoE kernel gave other tokens in Quiver's tests): "
                           "pip install -U onnxruntime")  # fmt: skip
    if settings.accuracy_level > 0 and any(n.op_type in ("MatMulNBits", "QMoE") for n in model.graph.node):
        model = _with_accuracy_level(model, settings.accuracy_level)
    return model, strengths

"""MatMul(x, Transpose(W)) of a weight -> com.microsoft FusedMatMul(x, W, transB=1): no transposed copy.

Exporters leave tied embeddings this way (the LM head reads the embedding table transposed). ONNX
Runtime's constant folding would materialize Wᵀ, a full copy of the largest weight, in every session;
FusedMatMul reads W as it is stored (and ORT packs it for the GEMM like any MatMul weight).
"""

from __future__ import annotations

import onnx
from onnx import helper

from quiver.ir.ops import MS_DOMAIN, use_microsoft_domain

MIN_BYTES = 64 * 1024  # smaller transposes are cheap to fold


def _is_plain_transpose(node: onnx.NodeProto) -> bool:
    perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
    return node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and perm in ([], [[1, 0]])


def fuse_transposed_weights(model: onnx.ModelProto) -> int:
    """Rewrites the main graph in place; returns how many MatMuls now read their weight transposed."""
    graph = model.graph
    weights = {
        t.name
        for t in graph.initializer
        if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT and t.dims[0] * t.dims[1] * 4 >= MIN_BYTES
    }
    transposed = {n.output[0]: n for n in graph.node if _is_plain_transpose(n) and n.input[0] in weights}
    if not transposed:
        return 0
    rewritten = 0
    for index, node in enumerate(graph.node):
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.input[1] in transposed:
            weight = transposed[node.input[1]].input[0]
            graph.node[index].CopyFrom(
                helper.make_node(
                    "FusedMatMul",
                    [node.input[0], weight],
                    list(node.output),
                    name=node.name,
                    domain=MS_DOMAIN,
                    transB=1,
                )
            )
            rewritten += 1
    if rewritten:
        used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        kept = [
            n
            for n in graph.node
            if not (_is_plain_transpose(n) and n.output[0] in transposed and n.output[0] not in used)
        ]
        del graph.node[:]
        graph.node.extend(kept)
        use_microsoft_domain(model)
    return rewritten

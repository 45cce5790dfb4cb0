"""Weight-only quantization of an LLM graph: MatMul weights to 4 or 8 bits per block (ORT's MatMulNBits).

ONNX Runtime's own quantizer does the work (`MatMulNBitsQuantizer`, symmetric blocks); the LoRA branches
(updateable tensors) and the tied LM head stay in float.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import onnx

from quiver.errors import QuantizationError


def quantize_weights(
    model: onnx.ModelProto, bits: int, block_size: int, exclude: Collection[str] = (), head: str | None = None
) -> onnx.ModelProto:
    """Every MatMul by a constant weight at `bits`, except those reading `exclude`; the node named `head`
    (the LM head) at 8 bits: at 4 it loses most of a small model's greedy agreement (measured)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if bits not in (4, 8) or block_size < 16 or block_size & (block_size - 1):
        raise QuantizationError(
            f"weights quantize to 4 or 8 bits in blocks of a power of two >= 16, not {bits} / {block_size}"
        )
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # per-node INFO
    skipped = [n.name for n in model.graph.node if n.op_type == "MatMul" and set(n.input) & set(exclude)]
    passes = [(bits, {"nodes_to_exclude": [*skipped, *([head] if head else [])]})]
    if head:
        passes.append((8, {"nodes_to_include": [head]}))
    try:
        for width, nodes in passes:
            quantizer = MatMulNBitsQuantizer(model, bits=width, block_size=block_size, is_symmetric=True, **nodes)
            quantizer.process()
            model = quantizer.model.model
    except Exception as exc:  # ORT's quantizer raises plain exceptions
        raise QuantizationError(f"ONNX Runtime's weight quantizer failed: {exc}") from None
    return model

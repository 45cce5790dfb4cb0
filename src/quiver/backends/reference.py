"""The reference backend: ONNX's reference evaluator, the ground truth for numerics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_dequantize_linear import DequantizeLinear_21
from onnx.reference.ops.op_quantize_linear import QuantizeLinear_21

from quiver.backends.base import FinalizedGraph
from quiver.errors import BackendError
from quiver.ir import dtypes
from quiver.ir.edit import initializers_as_inputs
from quiver.ir.nibbles import unpack_bits
from quiver.ir.ops import MS_DOMAIN
from quiver.ir.quiver_ops import DECODE_ATTENTION, MATMUL_4BITS, QUIVER_DOMAIN


def _ms_gelu(self: OpRun, x: np.ndarray, approximate: str | None = None) -> tuple[np.ndarray]:
    # onnx.reference matches the ONNX Gelu schema, so it passes its `approximate` attribute; MS Gelu is exact
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return ((0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(x.dtype),)


def _ms_matmul_nbits(
    self: OpRun, a: np.ndarray, b: np.ndarray, scales: np.ndarray, *rest: Any, **attributes: Any
) -> tuple[np.ndarray]:
    """ORT's MatMulNBits (2, 4 or 8 bits): B [N, blocks, block·bits/8], values packed from each byte's low
    bits up; zero points likewise, [N, ⌈blocks·bits/8⌉] bytes, 2^(bits-1) unless given."""
    k, n, block = int(attributes["K"]), int(attributes["N"]), int(attributes["block_size"])
    bits = int(attributes.get("bits", 4))
    blocks = b.shape[1]
    q = unpack_bits(b, bits).reshape(n, blocks, block).astype(np.float32)
    zero: np.ndarray | float = float(1 << (bits - 1))
    if rest and rest[0] is not None and rest[0].size:
        zero = unpack_bits(rest[0].reshape(n, -1), bits).reshape(n, -1)[:, :blocks, None].astype(np.float32)
    weight = ((q - zero) * scales.reshape(n, blocks, 1).astype(np.float32)).reshape(n, -1)[:, :k]
    return ((a.astype(np.float32) @ weight.T).astype(a.dtype),)


def _quiver_matmul_4bits(
    self: OpRun, a: np.ndarray, b: np.ndarray, halves: np.ndarray, *rest: Any, **attributes: Any
) -> tuple[np.ndarray]:
    """Quiver's MatMul4Bits (`quiver.backends.cpu.native_ops`), exactly: B [N, K/32, 16] as MatMulNBits'
    4 bits, w = s q + m with each block's float16 scale and minimum ([N, 2, K/32]); float activations."""
    k, n = int(attributes["K"]), int(attributes["N"])
    q = unpack_bits(b, 4).reshape(n, k // 32, 32).astype(np.float32)
    scales, minimums = (halves[:, i, :, None].astype(np.float32) for i in (0, 1))
    weight = (q * scales + minimums).reshape(n, k)
    return ((a.astype(np.float32) @ weight.T).astype(a.dtype),)


def _ms_gather_block_quantized(
    self: OpRun, data: np.ndarray, indices: np.ndarray, scales: np.ndarray, *rest: Any, **attributes: Any
) -> tuple[np.ndarray]:
    """ORT's GatherBlockQuantized as Quiver's token tables use it (gather_axis 0, quantize_axis the last):
    uint8 data of 4 (packed from each byte's low bits up) or 8 bits, blocks along each row, zero points
    packed alike (2^(bits-1) unless given); the rows at `indices`, dequantized."""
    bits, block = int(attributes.get("bits", 4)), int(attributes["block_size"])
    if int(attributes.get("gather_axis", 0)) != 0 or int(attributes.get("quantize_axis", 1)) not in (1, -1):
        raise NotImplementedError("GatherBlockQuantized: only gather_axis 0 and quantize_axis 1")
    rows = data[indices.astype(np.int64)]
    width = rows.shape[-1] * 8 // bits
    q = unpack_bits(rows.reshape(-1, rows.shape[-1]), bits).reshape(-1, width // block, block).astype(np.float32)
    zero: np.ndarray | float = float(1 << (bits - 1))
    if rest and rest[0] is not None and rest[0].size:
        packed = rest[0][indices.astype(np.int64)].reshape(q.shape[0], -1)
        zero = unpack_bits(packed, bits)[:, : width // block, None].astype(np.float32)
    step = scales[indices.astype(np.int64)].reshape(q.shape[0], -1, 1).astype(np.float32)
    return (((q - zero) * step).reshape(*indices.shape, width).astype(scales.dtype),)


def _ms_fused_matmul(self: OpRun, a: np.ndarray, b: np.ndarray, **attributes: Any) -> tuple[np.ndarray]:
    """ORT's FusedMatMul: alpha · op(A) · op(B), op transposing the last two axes where asked."""
    if attributes.get("transA"):
        a = np.swapaxes(a, -1, -2)
    if attributes.get("transB"):
        b = np.swapaxes(b, -1, -2)
    alpha = attributes.get("alpha")
    product = np.matmul(a, b)
    return ((product if alpha in (None, 1.0) else product * alpha).astype(a.dtype),)


def _ms_skip_simplified_layer_norm(
    self: OpRun, x: np.ndarray, skip: np.ndarray, gamma: np.ndarray, bias: np.ndarray | None = None, **attributes: Any
) -> tuple[np.ndarray, ...]:
    """ORT's SkipSimplifiedLayerNormalization: RMSNorm(x + skip (+ bias)) · gamma, and the sum (output 3)."""
    total = x + skip + (bias if bias is not None else 0)
    eps = float(attributes.get("epsilon") or 1e-12)
    inv = 1.0 / np.sqrt(np.mean(np.square(total, dtype=np.float32), axis=-1, keepdims=True) + eps)
    return (total * inv * gamma).astype(x.dtype), inv * 0, inv, total.astype(x.dtype)


def _simplified_layer_norm(self: OpRun, x: np.ndarray, gamma: np.ndarray, **attributes: Any) -> tuple[np.ndarray, ...]:
    """ORT's SimplifiedLayerNormalization (ONNX domain, no schema): RMSNorm(x) · gamma over the last axis."""
    eps = float(attributes.get("epsilon") or 1e-5)
    inv = 1.0 / np.sqrt(np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True) + eps)
    return ((x * inv * gamma).astype(x.dtype),)


def _rotate(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotary positions on x's first 2 x cos.shape[1] dimensions (x [heads, seq, dim] at `positions` [seq]):
    the two halves of them against each other, or (`interleaved`) each even dimension against the next."""
    half = cos.shape[-1]
    c, s = cos[positions][None], sin[positions][None]
    turned, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        a, b = turned[..., 0::2], turned[..., 1::2]
        out = np.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(turned.shape)
    else:
        a, b = turned[..., :half], turned[..., half:]
        out = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return np.concatenate([out, rest], axis=-1)


def _ms_group_query_attention(
    self: OpRun,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    past_key: np.ndarray,
    past_value: np.ndarray,
    seqlens_k: np.ndarray,
    total_sequence_length: np.ndarray,
    cos_cache: np.ndarray | None = None,
    sin_cache: np.ndarray | None = None,
    *_: Any,
    **attributes: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ORT's GroupQueryAttention for unpacked q/k/v and a past/present buffer of the cache's full length:
    the new keys and values go at positions [total - seq, total), each query attends causally to what
    precedes it (within the last `local_window_size` keys, its own included), scores capped by `softcap`.
    Rotary positions (do_rotary) count from the start of the cache."""
    heads, kv_heads = int(attributes["num_heads"]), int(attributes["kv_num_heads"])
    batch, seq, width = query.shape
    if key is None or value is None or key.size == 0:  # packed: q, k and v side by side in `query`
        dim = width // (heads + 2 * kv_heads)
        query, key, value = np.split(query, [heads * dim, (heads + kv_heads) * dim], axis=-1)
    dim = query.shape[-1] // heads
    scale = attributes.get("scale") or dim**-0.5
    window, softcap = int(attributes.get("local_window_size", -1)), float(attributes.get("softcap") or 0.0)
    present_key, present_value = past_key.copy(), past_value.copy()
    output = np.empty((batch, seq, heads * dim), query.dtype)
    for b in range(batch):
        total = int(seqlens_k[b]) + 1
        positions = np.arange(total - seq, total)
        q = query[b].reshape(seq, heads, dim).transpose(1, 0, 2)
        k = key[b].reshape(seq, kv_heads, dim).transpose(1, 0, 2)
        if attributes.get("do_rotary") and cos_cache is not None and sin_cache is not None:
            turn = bool(attributes.get("rotary_interleaved"))
            q, k = (_rotate(x, positions, cos_cache, sin_cache, turn) for x in (q, k))
        present_key[b, :, total - seq : total] = k
        present_value[b, :, total - seq : total] = value[b].reshape(seq, kv_heads, dim).transpose(1, 0, 2)
        keys = np.repeat(present_key[b, :, :total], heads // kv_heads, axis=0)
        values = np.repeat(present_value[b, :, :total], heads // kv_heads, axis=0)
        scores = (q @ keys.transpose(0, 2, 1)) * scale
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        at, upto = np.arange(total)[None, None], positions[None, :, None]
        seen = (at <= upto) & ((at > upto - window) if window > 0 else True)
        scores = np.where(seen, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        output[b] = (weights @ values).transpose(1, 0, 2).reshape(seq, heads * dim)
    return output.astype(query.dtype), present_key, present_value


# onnx.reference finds an operator by its class name: these two are named after the op they implement.
# A schema-less class gets the attributes of onnx's newest (De)QuantizeLinear (precision, output_dtype,
# block_size...); the com.microsoft ops have only axis (and saturate for float 8).
class QuantizeLinear(QuantizeLinear_21):
    op_domain = MS_DOMAIN

    def _run(self, *args: Any, axis: int = 1, saturate: bool = True, **_: Any) -> Any:  # type: ignore[override,unused-ignore]
        return super()._run(*args, axis=axis, saturate=saturate)


class DequantizeLinear(DequantizeLinear_21):
    op_domain = MS_DOMAIN

    def _run(self, *args: Any, axis: int = 1, **_: Any) -> Any:  # type: ignore[override,unused-ignore]
        return super()._run(*args, axis=axis)


class GatherElements(OpRun):
    """ONNX GatherElements where onnx.reference is wrong: an index smaller than the data in the other axes
    (transformers' position ids: [1, seq] out of [1, max_positions]) fails its reshape."""

    op_domain = ""

    def _run(self, data: np.ndarray, indices: np.ndarray, axis: int = 0) -> tuple[np.ndarray]:
        axis = axis % data.ndim
        window = tuple(slice(None) if i == axis else slice(0, n) for i, n in enumerate(indices.shape))
        indices = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data[window], indices.astype(np.int64), axis=axis),)


# Fixes of onnx.reference's own operators, applied on every onnx version Quiver supports.
_FIXED_OPS: list[Any] = [GatherElements]

# The others are made with type() under their op type's name.
_MS_OPS: list[Any] = [
    type("Gelu", (OpRun,), {"op_domain": MS_DOMAIN, "_run": _ms_gelu}),
    QuantizeLinear,
    DequantizeLinear,
    type("MatMulNBits", (OpRun,), {"op_domain": MS_DOMAIN, "_run": _ms_matmul_nbits}),
    type(MATMUL_4BITS, (OpRun,), {"op_domain": QUIVER_DOMAIN, "_run": _quiver_matmul_4bits}),
    type("GatherBlockQuantized", (OpRun,), {"op_domain": MS_DOMAIN, "_run": _ms_gather_block_quantized}),
    type("FusedMatMul", (OpRun,), {"op_domain": MS_DOMAIN, "_run": _ms_fused_matmul}),
    type("GroupQueryAttention", (OpRun,), {"op_domain": MS_DOMAIN, "_run": _ms_group_query_attention}),
    type(DECODE_ATTENTION, (OpRun,), {"op_domain": QUIVER_DOMAIN, "_run": _ms_group_query_attention}),
    type(
        "SkipSimplifiedLayerNormalization", (OpRun,), {"op_domain": MS_DOMAIN, "_run": _ms_skip_simplified_layer_norm}
    ),
    type("SimplifiedLayerNormalization", (OpRun,), {"op_domain": "", "_run": _simplified_layer_norm}),
]


def _onnx_custom_types() -> dict[np.dtype, np.dtype]:
    """Before 1.18, onnx.reference computes float8 and 4-bit values in structured dtypes of its own
    (`onnx._custom_element_types`), not ml_dtypes: ml_dtypes dtype -> onnx's, for such versions."""
    try:
        from onnx import _custom_element_types as custom  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return {}
    if tuple(int(p) for p in onnx.__version__.split(".")[:2]) >= (1, 18):
        return {}
    names = ("float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz", "int4", "uint4")
    return {dtypes.numpy_of(name): np.dtype(getattr(custom, name)) for name in names}


_ONNX_CUSTOM_TYPES = _onnx_custom_types()


def _as_onnx_custom(value: np.ndarray) -> np.ndarray:
    custom = _ONNX_CUSTOM_TYPES.get(value.dtype)
    if custom is None:
        return value
    if value.dtype.name.startswith("float8"):
        return value.view(np.uint8).view(custom)  # the same bits
    return value.astype(np.int8 if value.dtype.name == "int4" else np.uint8).view(custom)  # a value per byte


def _as_declared(result: np.ndarray, name: str) -> np.ndarray:
    """The output in the form Quiver exchanges for its declared type: onnx.reference returns bfloat16
    (and, before onnx 1.18, float8 and 4-bit values) in dtypes of its own, strings as str arrays."""
    dtype = dtypes.numpy_of(name)
    if result.dtype == dtype:
        return result
    if name == "bfloat16" and result.dtype.itemsize == dtype.itemsize:
        return result.view(dtype)
    if name in dtypes.IO_DTYPE_NAMES - dtypes.DTYPE_NAMES:
        return dtypes.as_io_array(result, name)
    return result


def _unused_outputs_named(model: onnx.ModelProto) -> onnx.ModelProto:
    """Optional outputs left unnamed ("") get names of their own: onnx.reference stores every output
    under its name, so a value stored as "" would be read by the next node whose optional input is ""."""
    for i, node in enumerate(model.graph.node):
        for j, name in enumerate(node.output):
            if not name:
                node.output[j] = f"quiver::unused/{i}/{j}"
    return model


class ReferenceExecutable:
    def __init__(self, graph: FinalizedGraph) -> None:
        self._weights = graph.weights
        self._output_names = [o.name for o in graph.outputs]
        self._output_types = [o.dtype for o in graph.outputs]
        try:
            self._evaluator = ReferenceEvaluator(
                _unused_outputs_named(initializers_as_inputs(graph.model, graph.weights.keys())),
                new_ops=_MS_OPS + _FIXED_OPS,
            )
        except Exception as exc:
            raise BackendError(f"reference backend cannot prepare graph {graph.name!r}: {exc}") from None

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        release_scratch: bool = False,  # numpy's intermediate values are freed with the run anyway
    ) -> list[np.ndarray]:
        if _ONNX_CUSTOM_TYPES:
            feeds = {name: _as_onnx_custom(value) for name, value in feeds.items()}
        try:
            results = self._evaluator.run(self._output_names, {**self._weights, **(bound or {}), **feeds})
        except Exception as exc:
            raise BackendError(f"reference backend failed: {type(exc).__name__}: {exc}") from None
        arrays = [_as_declared(np.asarray(r), kind) for r, kind in zip(results, self._output_types)]
        for i, name in enumerate(self._output_names):
            if out and name in out:  # every input was read already: writing into one now is safe
                np.copyto(out[name], arrays[i])
                arrays[i] = out[name]
        return arrays

    @property
    def private_bytes(self) -> int:
        return 0

    def release(self) -> None:
        self._evaluator = None  # type: ignore[assignment]

    def wait_until_ready(self) -> None:
        pass


class ReferenceBackend:
    name = "reference"

    def prepare(self, graph: FinalizedGraph) -> ReferenceExecutable:
        return ReferenceExecutable(graph)

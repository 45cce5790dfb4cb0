"""Block weights by GPTQ or round to nearest, symmetric or with zero points, and the input moments GPTQ reads.

GPTQ (Frantar et al., 2022) rounds a weight [K, N] one input row k at a time and spreads each row's
rounding error over the rows not yet rounded, weighted by the inverse of the layer inputs' second moments
H = Σ xᵀx (from calibration inputs): the layer's outputs on inputs like those stay close to float where
round-to-nearest only keeps each weight close. Rows go in act order (the inputs with the largest moments
first) with static groups (each block's scale and zero point per output column set from the float
weights: blocks stay contiguous along K, as MatMulNBits and DequantizeLinear store them), their updates
applied lazily 128 rows at a time, as the reference code (AutoGPTQ's desc_act + static_groups) does.
Every result here is unsigned: w ≈ scale (q - zero), q and zero in [0, 2^bits); symmetric blocks have
zero = 2^(bits-1).
"""

from __future__ import annotations

import tempfile
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from quiver.errors import QuantizationError
from quiver.ir.nibbles import pack_nibbles

if TYPE_CHECKING:  # onnx loads when a model is quantized, not with the CLI that names the quantizers
    import onnx

WEIGHT_QUANTIZERS = ("rtn", "rtn-asym", "gptq", "gptq-asym")
_LAZY_ROWS = 128  # rows whose updates are applied together (the reference implementation's block)


class BlockWeights:
    """A weight [K, N] as unsigned integers q [K, N], scales and zero points [ceil(K / block), N]."""

    def __init__(self, q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block_size: int) -> None:
        self.q, self.scales, self.zeros, self.block_size = q, scales, zeros, block_size

    def int4_initializers(self, q: str, scales: str, zeros: str) -> list[onnx.TensorProto]:
        """As ONNX's blocked DequantizeLinear-21 reads them (axis 0): int4 q - 8 and zero points - 8, the
        scales float32."""
        from onnx import numpy_helper

        return [
            int4_tensor(q, self.q.astype(np.int8) - 8),
            numpy_helper.from_array(self.scales, scales),
            int4_tensor(zeros, self.zeros.astype(np.int8) - 8),
        ]

    def dequantized(self) -> np.ndarray:
        rows = np.arange(self.q.shape[0]) // self.block_size
        return (self.scales[rows] * (self.q.astype(np.float32) - self.zeros[rows])).astype(np.float32)


def int4_tensor(name: str, values: np.ndarray) -> onnx.TensorProto:
    """An INT4 initializer, packed as ONNX stores it: two per byte, the first in the low nibble."""
    from onnx import TensorProto, helper

    flat = values.ravel()
    packed = pack_nibbles(np.append(flat, np.int8(0)) if flat.size % 2 else flat)
    return helper.make_tensor(name, TensorProto.INT4, values.shape, packed.tobytes(), raw=True)


def _grid(rows: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """A block's scale and zero point per output column from its rows [block, N]."""
    top = (1 << bits) - 1
    if symmetric:
        zero = np.full(rows.shape[1], 1 << (bits - 1), np.float64)
        scale = np.abs(rows).max(axis=0) / (top - zero)  # the largest magnitude on the positive end
    else:  # zero kept representable: a block of one sign still dequantizes 0 exactly
        low, high = np.minimum(rows.min(axis=0), 0), np.maximum(rows.max(axis=0), 0)
        scale = (high - low) / top
        zero = np.rint(-low / np.where(scale > 0, scale, 1))
    return np.where(scale > 0, scale, 1.0), zero


def _round(column: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> np.ndarray:
    return np.clip(np.rint(column / scale) + zero, 0, (1 << bits) - 1)


def quantize_blocks(
    weight: np.ndarray,
    bits: int,
    block_size: int,
    symmetric: bool,
    moments: np.ndarray | None = None,
    damping: float = 0.1,
) -> BlockWeights:
    """`weight` [K, N] in blocks of `block_size` rows: by GPTQ with the inputs' `moments` [K, K] (Σ xᵀx),
    else rounded to nearest. `damping`: the share of H's mean diagonal added to it (GPTQ's percdamp; the
    paper's 0.01 is for some 10⁵ calibration tokens: with a few hundred, 0.1 keeps what they do not show
    nearer to rounding and measured best on MiniLM)."""
    if weight.ndim != 2 or bits not in (4, 8) or block_size < 1:
        raise QuantizationError(f"block weights need a 2-d weight, 4 or 8 bits and a block size, not {weight.shape}")
    k, n = weight.shape
    work = weight.astype(np.float64)
    # each block's grid from the weights as they are (GPTQ's static groups: rows are visited out of order)
    grids = [_grid(work[start : start + block_size], bits, symmetric) for start in range(0, k, block_size)]
    scales, zeros = np.stack([g[0] for g in grids]), np.stack([g[1] for g in grids])
    block_of = np.arange(k) // block_size
    q = np.zeros((k, n), np.uint8)
    if moments is None:
        q[:] = _round(work, scales[block_of], zeros[block_of], bits)
        return BlockWeights(q, scales.astype(np.float32), zeros.astype(np.float32), block_size)
    order = np.argsort(-np.diag(moments), kind="stable")  # act order: the inputs carrying most first
    work = work[order]  # rows are rounded in this order, each one's error spread to the rows after it
    inverse = _upper_inverse(moments[np.ix_(order, order)], damping)
    for start in range(0, k, _LAZY_ROWS):
        end = min(start + _LAZY_ROWS, k)
        errors = np.zeros((end - start, n))
        for row in range(start, end):
            source, b = order[row], block_of[order[row]]
            q[source] = _round(work[row], scales[b], zeros[b], bits)
            error = (work[row] - scales[b] * (q[source] - zeros[b])) / inverse[row, row]
            work[row + 1 : end] -= np.outer(inverse[row, row + 1 : end], error)
            errors[row - start] = error
        if end < k:
            work[end:] -= inverse[start:end, end:].T @ errors
    return BlockWeights(q, scales.astype(np.float32), zeros.astype(np.float32), block_size)


def moments_of(inputs: Iterable[str], moments: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The summed moments of the inputs one weight multiplies (a weight read by several MatMuls sees all
    their inputs); None where calibration reached none of them: that weight is rounded to nearest."""
    seen = [moments[x] for x in inputs if x in moments]
    return np.sum(seen, axis=0) if seen else None


def _upper_inverse(moments: np.ndarray, damping: float) -> np.ndarray:
    """The upper Cholesky factor of (H + λI)⁻¹, as GPTQ uses it; inputs never seen count as independent."""
    h = np.array(moments, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    mean = float(np.mean(np.diag(h)))
    for attempt in range(4):  # more damping if H is too ill-conditioned to factor
        damped = h + (damping * 10**attempt) * mean * np.eye(len(h))
        try:
            lower = np.linalg.cholesky(np.linalg.inv(damped))
        except np.linalg.LinAlgError:
            continue
        return np.ascontiguousarray(lower.T)
    raise QuantizationError("GPTQ: the calibration inputs' moments cannot be factored; use --quantizer rtn")


def input_moments(
    model: onnx.ModelProto, samples: Iterable[Mapping[str, np.ndarray]], tensors: Collection[str]
) -> dict[str, np.ndarray]:
    """Σ xᵀx over every position of each named float tensor (its last axis), as ONNX Runtime computes the
    model on `samples`."""
    import onnx

    from quiver.ort_package import onnxruntime as ort

    names = sorted(set(tensors))
    if not names:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names if name not in known)
    moments: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="quiver-gptq-") as tmp:
        path = Path(tmp) / "probe.onnx"
        onnx.save(probe, path, save_as_external_data=probe.ByteSize() > 1 << 30)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for sample in samples:
            for name, value in zip(names, session.run(names, dict(sample))):
                rows = np.asarray(value, np.float64).reshape(-1, value.shape[-1])
                product = rows.T @ rows
                moments[name] = moments[name] + product if name in moments else product
    return moments

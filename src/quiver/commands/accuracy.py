"""How much quantization costs: per-output SQNR and cosine against float, per-layer SQNR ranked worst first.

Both models run in plain ONNX Runtime on the same inputs. Per layer: every activation the QDQ model
quantizes, as its DequantizeLinear gives it back, against the same tensor of the float model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from quiver.errors import QuantizationError
from quiver.ort_package import onnxruntime as ort
from quiver.passes.mask_fills import apply_mask_fills, mask_fills_of


def sqnr_db(reference: np.ndarray, approximation: np.ndarray) -> float:
    """Signal to quantization noise, in dB: 20·log10(‖ref‖ / ‖ref − approx‖).

    inf when they are equal, -inf when the noise is infinite, nan when either holds a NaN: tensors that
    carry extreme values (a mask filled with finfo.min) make such statistics, and they are reported so.
    """
    reference = np.asarray(reference, np.float64).ravel()
    with np.errstate(all="ignore"):
        noise = float(np.linalg.norm(reference - np.asarray(approximation, np.float64).ravel()))
        signal = float(np.linalg.norm(reference))
    if math.isnan(noise) or math.isnan(signal):
        return math.nan
    if noise == 0:
        return math.inf
    if math.isinf(noise):
        return -math.inf if math.isfinite(signal) else math.nan
    return 20 * math.log10(max(signal, 1e-30) / noise)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    with np.errstate(all="ignore"):
        norms = float(np.linalg.norm(a) * np.linalg.norm(b))
        dot = float(a @ b)
    if not math.isfinite(norms) or not math.isfinite(dot):
        return math.nan
    return 1.0 if norms == 0 else dot / norms


@dataclass(frozen=True)
class OutputAccuracy:
    name: str
    sqnr_db: float
    cosine: float
    max_abs_diff: float


@dataclass(frozen=True)
class AccuracyReport:
    outputs: list[OutputAccuracy]
    layers: list[tuple[str, str, float]]  # (tensor, op producing it, SQNR dB of the QDQ model vs. float), worst first
    samples: int

    def to_json(self) -> dict[str, Any]:
        def number(x: float) -> float | str:
            return x if math.isfinite(x) else str(x)  # "inf", "-inf", "nan": JSON has no such numbers

        return {
            "samples": self.samples,
            "outputs": [
                {"name": o.name, "sqnr_db": number(o.sqnr_db), "cosine": o.cosine, "max_abs_diff": o.max_abs_diff}
                for o in self.outputs
            ],
            "layers": [{"tensor": name, "op": op, "sqnr_db": number(value)} for name, op, value in self.layers],
        }


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    """ORT with its defaults: the numerics the cpu backend has by default (its MatMul accuracy level)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def compare_outputs(
    float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]]
) -> list[OutputAccuracy]:
    """Each output of the QDQ model against the float model's, over all samples together."""
    reference, quantized = _session(float_model), _session(qdq_model)
    names = [o.name for o in reference.get_outputs()]
    ours: dict[str, list[np.ndarray]] = {n: [] for n in names}
    theirs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for sample in samples:
        for name, value in zip(names, reference.run(names, dict(sample))):
            theirs[name].append(np.asarray(value).ravel())
        for name, value in zip(names, quantized.run(names, dict(sample))):
            ours[name].append(np.asarray(value).ravel())
    result = []
    for name in names:
        a, b = np.concatenate(theirs[name]), np.concatenate(ours[name])
        result.append(OutputAccuracy(name, sqnr_db(a, b), cosine(a, b), float(np.max(np.abs(a - b), initial=0.0))))
    return result


def _with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """The model with these intermediate tensors as extra (float) outputs."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    present = {o.name for o in result.graph.output}
    result.graph.output.extend(
        onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names if n not in present
    )
    return result


def layer_sqnr(
    float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]]
) -> list[tuple[str, str, float]]:
    """SQNR of every quantized activation (its Q→DQ output) against the float model's value, worst first."""
    producers = {o for node in float_model.graph.node for o in node.output} | {i.name for i in float_model.graph.input}
    dequantized = {node.input[0]: node.output[0] for node in qdq_model.graph.node if node.op_type == "DequantizeLinear"}
    pairs = {
        node.input[0]: dequantized[node.output[0]]
        for node in qdq_model.graph.node
        if node.op_type == "QuantizeLinear" and node.output[0] in dequantized and node.input[0] in producers
    }
    if not pairs:
        return []
    names = sorted(pairs)
    reference = _session(_with_outputs(float_model, names))
    quantized = _session(_with_outputs(qdq_model, [pairs[n] for n in names]))
    theirs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    ours: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for sample in samples:
        for name, value in zip(names, reference.run(names, dict(sample))):
            theirs[name].append(np.ravel(value))
        for name, value in zip(names, quantized.run([pairs[n] for n in names], dict(sample))):
            ours[name].append(np.ravel(value))
    ops = {o: node.op_type for node in float_model.graph.node for o in node.output}
    layers = [(n, ops.get(n, "input"), sqnr_db(np.concatenate(theirs[n]), np.concatenate(ours[n]))) for n in names]
    return sorted(layers, key=lambda item: item[2])


def accuracy_report(
    float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]]
) -> AccuracyReport:
    """Outputs against the float model as given; layers against it with the QDQ model's mask fills applied
    (a clamped fill is a change made on purpose, not quantization noise, and would hide the real losses)."""
    if not samples:
        raise QuantizationError("an accuracy report needs sample inputs: give --input-list")
    treated = float_model
    fills = mask_fills_of(qdq_model)
    if fills:
        treated = onnx.ModelProto()
        treated.CopyFrom(float_model)
        apply_mask_fills(treated, fills)
    return AccuracyReport(
        compare_outputs(float_model, qdq_model, samples), layer_sqnr(treated, qdq_model, samples), len(samples)
    )

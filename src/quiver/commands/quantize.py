"""The work of `quiver quantize` and `quiver eval`, as functions: read the model, input list and overrides;
write the QDQ model and its encodings; compare outputs with the float model's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx.external_data_helper import load_external_data_for_model

from quiver.commands.accuracy import AccuracyReport, accuracy_report
from quiver.errors import ModelLoadError, QuantizationError
from quiver.formats.encodings import EncodingSet, parse_encodings, read_json_file, save_encodings
from quiver.formats.writer import write_atomically
from quiver.ir.tensors import TensorInfo, TensorType, info_of_value
from quiver.passes.convert import InputShapes, fix_input_shapes
from quiver.passes.load import load_model
from quiver.passes.qdq import QuantizeOptions, parse_ort_overrides, quantize
from quiver.passes.quantized import QUANTIZED_SUFFIX
from quiver.runtime.netrun import parse_input_list


def load_float_model(path: Path) -> onnx.ModelProto:
    """The whole model, external weights included (quantization needs their values)."""
    model, folder = load_model(path)
    if folder is not None:
        try:
            load_external_data_for_model(model, str(folder))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read its external weights ({exc})") from None
    return model


def read_samples(
    model: onnx.ModelProto,
    input_list: Path | None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    extra_inputs: Sequence[TensorInfo] = (),
) -> list[dict[str, np.ndarray]]:
    """The feeds of a QNN input list, checked against the model's inputs (and `extra_inputs`, inputs of
    a graph made from the model, such as LoRA's `lora_alpha`); none without a list."""
    if input_list is None:
        return []
    initializers = {t.name for t in model.graph.initializer}
    inputs = [info_of_value(v, TensorType.APP_WRITE) for v in model.graph.input if v.name not in initializers]
    known = {i.name for i in inputs}
    return parse_input_list(input_list, inputs, shapes, [i for i in extra_inputs if i.name not in known])


def read_overrides(path: Path) -> tuple[EncodingSet | None, dict[str, list[dict[str, Any]]]]:
    """An AIMET encodings file (any version) or an ORT TensorQuantOverrides file, told apart by their keys."""
    raw = read_json_file(path, "overrides", QuantizationError)
    if not isinstance(raw, dict):
        raise QuantizationError(f"{path}: an overrides file is a JSON object")
    if {"version", "activation_encodings", "param_encodings", "encodings"} & set(raw):
        return parse_encodings(raw, str(path)), {}
    try:
        return None, parse_ort_overrides(raw)
    except QuantizationError as exc:
        raise QuantizationError(f"{path}: {exc}") from None


@dataclass
class QuantizeResult:
    model: onnx.ModelProto
    encodings: EncodingSet
    report: AccuracyReport | None
    float_bytes: int
    quantized_bytes: int


def _weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers as stored: 4-bit types two per byte."""
    total = 0
    for tensor in model.graph.initializer:
        count = int(np.prod(tensor.dims, dtype=np.int64))
        if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
            total += (count + 1) // 2
        else:
            total += count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def run_quantize(
    model_path: Path,
    output: Path,
    options: QuantizeOptions,
    input_list: Path | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    encodings_out: Path | None = None,
    encodings_version: str = "1.0.0",
    report: bool = False,
) -> QuantizeResult:
    model = load_float_model(model_path)
    samples = read_samples(model, input_list, shapes)
    qdq, encodings = quantize(model, samples, options)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(output, qdq.SerializeToString())
    if encodings_out is not None:
        save_encodings(encodings, encodings_out, encodings_version)
    accuracy = accuracy_report(model, qdq, samples) if report else None
    return QuantizeResult(qdq, encodings, accuracy, _weight_bytes(model), _weight_bytes(qdq))


def quantize_from_overrides(
    path: Path,
    overrides: tuple[EncodingSet | None, dict[str, list[dict[str, Any]]]],
    shapes: InputShapes | None = None,
) -> tuple[onnx.ModelProto, EncodingSet]:
    """`quiver build --quantization-overrides`: the model at `path` (inputs fixed to `shapes`) quantized from
    the given encodings alone, what they leave out kept float (qairt's converter with `--float_fallback`)."""
    encodings, ort_overrides = overrides
    model = load_float_model(path)
    if shapes:
        fix_input_shapes(model.graph, shapes)
    return quantize(model, [], QuantizeOptions(float_fallback=True, encodings=encodings, ort_overrides=ort_overrides))


def stored_names(qdq: onnx.ModelProto, weights: Sequence[str]) -> list[str]:
    """The initializers of a QDQ model that hold each named float weight: itself where it stayed float,
    else its integers, scale and zero point."""
    stored = {t.name for t in qdq.graph.initializer}
    names: list[str] = []
    for weight in weights:
        quantized = f"{weight}{QUANTIZED_SUFFIX}"  # a bias's scale is named after its integers
        parts = [quantized, *(f"{base}_{part}" for base in (weight, quantized) for part in ("scale", "zero_point"))]
        names.extend([weight] if weight in stored else [name for name in parts if name in stored])
    return names


def run_eval(
    float_path: Path, qdq_path: Path, input_list: Path, shapes: Mapping[str, Sequence[int]] | None = None
) -> AccuracyReport:
    float_model, qdq_model = load_float_model(float_path), load_float_model(qdq_path)
    return accuracy_report(float_model, qdq_model, read_samples(float_model, input_list, shapes))

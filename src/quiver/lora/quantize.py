"""Quantized LoRA: one QDQ graph serves every use case; each use case's section carries its adapter weights
(as integers), their encodings and the encodings of the activations the adapters change.

Each use case is calibrated on the LoRA graph with its own adapter weights and alphas. ONNX Runtime's
quantizer places Q/DQ nodes by the graph's structure, not its values, so every use case yields the
same QDQ graph with other values in some tensors: those become updateable, and applying a use case's
section replaces them all at once (QNN updates encodings after applyBinarySection in the same way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from quiver.errors import AdapterError
from quiver.formats.encodings import EncodingSet
from quiver.lora.create import ALPHA_INPUT, LoraGraph
from quiver.passes.quantize import QuantizeOptions, quant_type_of, quantize

UseCaseValues = Mapping[str, tuple[Mapping[str, np.ndarray], Sequence[float]]]  # name -> (tensors, alphas)


@dataclass
class QuantizedLora:
    model: onnx.ModelProto  # the QDQ graph every use case shares
    updateable: list[str]  # what differs between use cases: adapter integers, scales, zero points
    values: dict[str, dict[str, np.ndarray]]  # use case -> its values of the updateable tensors
    encodings: dict[str, EncodingSet]  # use case -> encodings of its adapter weights and changed activations


def _with_values(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for tensor in result.graph.initializer:
        if tensor.name in values:
            tensor.CopyFrom(numpy_helper.from_array(np.asarray(values[tensor.name]), tensor.name))
    return result


def _structure(model: onnx.ModelProto) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    return [(n.op_type, tuple(n.input), tuple(n.output)) for n in model.graph.node]


def quantize_use_cases(
    graph: LoraGraph,
    cases: UseCaseValues,
    samples: Sequence[Mapping[str, np.ndarray]],
    options: QuantizeOptions,
    lora_weight_bits: int | None = None,
) -> QuantizedLora:
    """Calibrates and quantizes the LoRA graph once per use case; returns the shared graph and the differences."""
    if not samples:
        raise AdapterError("quantizing LoRA use cases needs calibration inputs: give --input-list")
    adapter_weights = [name for slot in graph.slots for name in (slot.a_name, slot.b_name)]
    overrides = dict(options.ort_overrides)
    if lora_weight_bits is not None:  # e.g. 16-bit adapters on an 8-bit base
        dtype = {8: "uint8", 16: "int16"}.get(lora_weight_bits)
        if dtype is None:
            raise AdapterError(f"LoRA weights can be kept at 8 or 16 bits, not {lora_weight_bits}")
        for name in adapter_weights:
            overrides[name] = [{"quant_type": quant_type_of(dtype), "symmetric": dtype.startswith("int")}]
    per_case_options = dataclasses.replace(options, ort_overrides=overrides)
    models: dict[str, onnx.ModelProto] = {}
    encodings: dict[str, EncodingSet] = {}
    for name, (values, alphas) in cases.items():
        alpha = np.asarray(alphas, np.float32)
        calibration = [{**sample, ALPHA_INPUT: alpha} for sample in samples]
        models[name], encodings[name] = quantize(_with_values(graph.model, values), calibration, per_case_options)
    first_name, first = next(iter(models.items()))
    for name, model in models.items():
        if _structure(model) != _structure(first):
            raise AdapterError(
                f"use cases {first_name!r} and {name!r} quantize to different graphs; quantize them separately"
            )
    arrays = {name: {t.name: numpy_helper.to_array(t) for t in m.graph.initializer} for name, m in models.items()}
    adapter_derived = tuple(adapter_weights) + tuple(slot.index_name for slot in graph.slots)
    updateable = [
        tensor
        for tensor, value in arrays[first_name].items()
        if tensor.startswith(adapter_derived)
        or any(not np.array_equal(value, arrays[other][tensor]) for other in arrays)
    ]
    changed = {
        tensor
        for tensor, encoding in encodings[first_name].tensors.items()
        if tensor in adapter_weights or any(encodings[other].tensors.get(tensor) != encoding for other in encodings)
    }
    return QuantizedLora(
        first,
        updateable,
        {name: {t: arrays[name][t] for t in updateable} for name in models},
        {
            name: EncodingSet({t: e for t, e in found.tensors.items() if t in changed}, version="1.0.0")
            for name, found in encodings.items()
        },
    )

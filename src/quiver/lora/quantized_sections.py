"""Quantized LoRA: one QDQ graph serves every use case; each use case's section carries its adapter weights
(as integers), their encodings and the encodings of the activations the adapters change.

Each use case is calibrated on the LoRA graph with its own adapter weights and alphas. ONNX Runtime's
quantizer places Q/DQ nodes by the graph's structure, not its values, so every use case yields the
same QDQ graph with other values in some tensors: those become updateable, and applying a use case's
section replaces them all at once (QNN updates encodings after applyBinarySection in the same way).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from quiver.errors import AdapterError
from quiver.formats.encodings import EncodingSet
from quiver.lora.create import ALPHA_INPUT, LoraGraph
from quiver.passes.qdq import QuantizeOptions, placeholder_sample, quant_type_of, quantize

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


def encodings_in_graph(model: onnx.ModelProto, encodings: EncodingSet, where: str) -> EncodingSet:
    """The encodings of tensors `model` has (weights, inputs, node outputs), as qairt's converter takes
    overrides: names it lacks are skipped with a warning, and a file that names none of them is an error."""
    names = {t.name for t in model.graph.initializer} | {v.name for v in model.graph.input}
    names.update(output for node in model.graph.node for output in node.output)
    found = {name: encoding for name, encoding in encodings.tensors.items() if name in names}
    missing = sorted(set(encodings.tensors) - set(found))
    if encodings.tensors and not found:
        raise AdapterError(
            f"{where}: its encodings name no tensor of the LoRA graph (e.g. {missing[:3]}); encodings from QAT "
            "must name the graph `quiver lora create` writes"
        )
    if missing:
        warnings.warn(
            f"{where}: {len(missing)} encoding(s) name tensors the LoRA graph lacks, skipped: {missing[:5]}",
            stacklevel=2,
        )
    return dataclasses.replace(encodings, tensors=found)


def quantize_use_cases(
    graph: LoraGraph,
    cases: UseCaseValues,
    samples: Sequence[Mapping[str, np.ndarray]],
    options: QuantizeOptions,
    lora_weight_bits: int | None = None,
    case_encodings: Mapping[str, EncodingSet] | None = None,
) -> QuantizedLora:
    """Calibrates and quantizes the LoRA graph once per use case, each with its own encodings where
    `case_encodings` has them (else `options.encodings`); returns the shared graph and the differences."""
    if not samples and not options.float_fallback:
        raise AdapterError(
            "quantizing LoRA use cases needs calibration inputs: give --input-list, or --float-fallback with encodings"
        )
    case_encodings = case_encodings or {}
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
        calibration = [{**sample, ALPHA_INPUT: alpha} for sample in samples or [placeholder_sample(graph.model)]]
        given = case_encodings.get(name, options.encodings)
        if given is None and options.float_fallback:
            raise AdapterError(
                f"use case {name!r} has no encodings to quantize from with --float-fallback: give it quant_overrides "
                "in the YAML, or encodings for every use case with --quantization-overrides"
            )
        case_options = per_case_options
        if given is not None:
            given = encodings_in_graph(graph.model, given, f"use case {name!r}")
            case_options = dataclasses.replace(per_case_options, encodings=given)
        models[name], encodings[name] = quantize(_with_values(graph.model, values), calibration, case_options)
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

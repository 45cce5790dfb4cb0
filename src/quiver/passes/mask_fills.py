"""Attention-mask fills (transformers' finfo.min, -1e9, -inf) -> a finite fill calibrated to the scores.

A mask filled with -3.4e38 that is added to attention scores before Softmax stretches the calibrated
range of that Add to 38 orders of magnitude: a 16-bit encoding then has no resolution left for the
scores, and the quantized model is ruined. Production quantizers clamp the fill. Here it becomes
(lowest score seen in calibration) - 100: every masked weight stays below e^-100 of the row's largest
one, so Softmax gives the same probabilities in float32, and the Add's range stays near the scores'.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

EXTREME = 1e4  # |x| at or past this in a constant that reaches a Softmax is a mask fill
MARGIN = 100.0  # e^-100: nothing in float32 softmax
_MASK_PATH_OPS = {"Where", "Add", "Sub", "Mul", "Expand", "Reshape", "Unsqueeze", "Squeeze", "Cast", "Min", "Max",
                  "Concat", "Slice", "Tile", "Identity", "Transpose"}  # fmt: skip
_MAX_HOPS = 8


@dataclass(frozen=True)
class MaskFill:
    """One treated constant: what it held, what it holds now, and the Softmax inputs it reaches."""

    tensor: str
    original: float
    fill: float
    softmax_inputs: tuple[str, ...]


def _extreme_constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    found = {}
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type not in (1, 10, 11, 16):
            continue
        value = numpy_helper.to_array(tensor)
        if value.size and value.size <= 1 << 20 and np.any(value <= -EXTREME):
            found[tensor.name] = value
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.dtype.kind == "f" and value.size and np.any(value <= -EXTREME):
                found[node.output[0]] = value
    return found


def _scores_reached(graph: onnx.GraphProto, start: str) -> list[tuple[str, str]]:
    """(Softmax input, the scores the mask is added to) for every Softmax the constant reaches."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    producers = {output: node for node in graph.node for output in node.output}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    on_path, frontier, reached = {start}, [start], []
    for _ in range(_MAX_HOPS):
        following = []
        for name in frontier:
            for node in consumers.get(name, []):
                if node.op_type == "Softmax":
                    producer = producers.get(name)
                    if producer is not None and producer.op_type == "Add":
                        scores = [i for i in producer.input if i not in on_path]
                        if len(scores) == 1:
                            reached.append((name, scores[0]))
                elif node.op_type in _MASK_PATH_OPS:
                    for output in node.output:
                        if output not in on_path:
                            on_path.add(output)
                            following.append(output)
        frontier = following
    return reached


def _lowest(model: onnx.ModelProto, names: Sequence[str], samples: Sequence[Mapping[str, np.ndarray]]) -> float:
    from quiver.ort_package import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names) if n not in known)
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a sample that fails raises; ORT need not also print it
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    lowest = 0.0
    for sample in samples:
        for value in session.run(list(dict.fromkeys(names)), dict(sample)):
            finite = np.asarray(value)[np.isfinite(value)]
            if finite.size:
                lowest = min(lowest, float(finite.min()))
    return lowest


def clamp_mask_fills(model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]]) -> list[MaskFill]:
    """Rewrites the model's mask fills in place (see the module docstring); returns what it treated."""
    values = _extreme_constants(model.graph)
    masks = {name: reached for name in values if (reached := _scores_reached(model.graph, name))}
    if not masks or not samples:
        return []
    lowest = _lowest(model, [scores for reached in masks.values() for _, scores in reached], samples)
    fill = float(np.float32(lowest - MARGIN))
    treated = [
        MaskFill(name, float(values[name].min()), fill, tuple(s for s, _ in reached)) for name, reached in masks.items()
    ]
    apply_mask_fills(model, treated)
    return treated


def apply_mask_fills(model: onnx.ModelProto, fills: Sequence[MaskFill]) -> None:
    """Writes the fills into the model's constants, in place (the same change `clamp_mask_fills` made)."""
    graph = model.graph
    values = _extreme_constants(graph)
    for fill in fills:
        value = values.get(fill.tensor)
        if value is None:
            continue
        clamped = np.where(value <= -EXTREME, np.float32(fill.fill), value).astype(value.dtype)
        replacement = numpy_helper.from_array(clamped, fill.tensor)
        for tensor in graph.initializer:
            if tensor.name == fill.tensor:
                tensor.CopyFrom(replacement)
        for node in graph.node:
            if node.op_type == "Constant" and node.output[0] == fill.tensor:
                node.attribute[0].t.CopyFrom(replacement)


MASK_FILLS_KEY = "quiver.mask_fills"  # model metadata: the fills a QDQ model was calibrated with


def record_mask_fills(model: onnx.ModelProto, fills: Sequence[MaskFill]) -> None:
    """Notes the fills in the (quantized) model's metadata, where reports and summaries find them."""
    if fills:
        model.metadata_props.add(key=MASK_FILLS_KEY, value=json.dumps([dataclasses.asdict(f) for f in fills]))


def mask_fills_of(model: onnx.ModelProto) -> list[MaskFill]:
    """The fills recorded in a model (none for a model `quantize` did not treat)."""
    for prop in model.metadata_props:
        if prop.key == MASK_FILLS_KEY:
            return [MaskFill(**{**m, "softmax_inputs": tuple(m["softmax_inputs"])}) for m in json.loads(prop.value)]
    return []

"""Calibrated QDQ quantization (qairt-quantizer's options) on top of ONNX Runtime's QNN quantization tools.

ONNX Runtime does the calibration and the Q/DQ insertion (`get_qnn_qdq_config` + `quantize`), mixed
precision included (its `convert` overrides). Quiver adds what ORT lacks: AIMET encodings as overrides
(activations exactly, weights requantized exactly with the given scales), qairt's `--float_fallback`
(tensors without an encoding stay float), and the encodings of the result as an AIMET file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.version_converter
from onnx import numpy_helper

from quiver import ort_package
from quiver.errors import QuantizationError
from quiver.formats.encodings import Encoding, EncodingSet
from quiver.passes.gptq import WEIGHT_QUANTIZERS, input_moments, moments_of, quantize_blocks
from quiver.passes.mask_fills import clamp_mask_fills, record_mask_fills
from quiver.passes.quantized import QUANTIZED_SUFFIX, graph_encodings

CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
DEFAULT_BLOCK_SIZE = 64
# Ops whose output is a rearrangement of their input: an encoding carries over unchanged (qairt propagates
# encodings across such "math-invariant" ops before falling back to float).
_INVARIANT_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand", "Slice", "Gather"}
# Activations that AIMET and QNN fuse into the op before them (a "supergroup": Conv+Relu, Gemm+Clip...):
# only the activation's output has an encoding, and quantizing the producer's output with it is exact,
# since these activations only clamp.
_CLAMPING_ACTIVATIONS = {"Relu", "Clip"}
_FUSING_PRODUCERS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "BatchNormalization"}


@dataclass
class QuantizeOptions:
    """qairt-quantizer's knobs, named as `quiver quantize` names them."""

    activation_bits: int = 16
    weight_bits: int = 8
    bias_bits: int = 32
    per_channel: bool = False
    block_size: int = 0  # > 0: per-block weights (4-bit), blocks along the reduction axis
    calibration: str = "minmax"
    float_fallback: bool = False
    encodings: EncodingSet | None = None  # AIMET overrides
    ort_overrides: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # ORT TensorQuantOverrides
    weight_quantizer: str = "rtn"  # how 4-bit blocks are made: `quiver.passes.gptq.WEIGHT_QUANTIZERS`

    def check(self) -> None:
        if self.activation_bits not in (8, 16):
            raise QuantizationError(f"activation bit width {self.activation_bits} is not supported; use 8 or 16")
        if self.weight_bits not in (4, 8, 16):
            raise QuantizationError(f"weight bit width {self.weight_bits} is not supported; use 4, 8 or 16")
        if self.bias_bits != 32:
            raise QuantizationError(f"bias bit width {self.bias_bits} is not supported; use 32")
        if self.calibration not in CALIBRATION_METHODS:
            raise QuantizationError(f"calibration {self.calibration!r} is unknown; use one of {CALIBRATION_METHODS}")
        if self.block_size and (self.block_size < 16 or self.block_size & (self.block_size - 1)):
            raise QuantizationError(f"block size {self.block_size} must be a power of two ≥ 16")
        if self.block_size and self.weight_bits != 4:
            raise QuantizationError("--block-size is for 4-bit weights; add --weight-bitwidth 4")
        if self.weight_quantizer not in WEIGHT_QUANTIZERS:
            raise QuantizationError(
                f"weight quantizer {self.weight_quantizer!r} is unknown; use one of {', '.join(WEIGHT_QUANTIZERS)}"
            )
        if self.weight_quantizer != "rtn" and self.weight_bits != 4:
            raise QuantizationError(f"--quantizer {self.weight_quantizer} makes 4-bit blocks; add --weight-bitwidth 4")
        if self.float_fallback and self.encodings is None and not self.ort_overrides:
            raise QuantizationError(
                "--float-fallback keeps tensors without an encoding in float: give the encodings "
                "with --quantization-overrides"
            )


def quant_type_of(dtype: str) -> Any:
    """ORT's QuantType for an integer dtype name."""
    QuantType = ort_package.submodule("quantization").QuantType  # noqa: N806 (ORT's class)

    names = {"uint8": "QUInt8", "int8": "QInt8", "uint16": "QUInt16", "int16": "QInt16", "uint4": "QUInt4",
             "int4": "QInt4"}  # fmt: skip
    if dtype not in names:
        raise QuantizationError(f"ONNX Runtime's QDQ tools have no {dtype} type; use 4, 8 or 16-bit encodings")
    return QuantType[names[dtype]]


def _quant_types(options: QuantizeOptions) -> tuple[Any, Any]:
    # Under --float-fallback with encodings, every quantized activation takes its type from them; ORT's
    # default type then only steers its mixed-precision rules, and at 16 bits those refuse a given 16-bit
    # tensor that an 8-bit region produces (a 16-bit a16w8 file's own embeddings, made 8-bit by their tables).
    given_types = options.float_fallback and options.encodings is not None
    activation = "uint16" if options.activation_bits == 16 and not given_types else "uint8"
    weight = {4: "uint8", 8: "uint8", 16: "int16"}[options.weight_bits]  # 4: MatMul weights redone afterwards
    return quant_type_of(activation), quant_type_of(weight)


def parse_ort_overrides(raw: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """ORT's TensorQuantOverrides from JSON: quant types by name, scales and zero points as numpy values."""
    result: dict[str, list[dict[str, Any]]] = {}
    try:
        for tensor, entries in raw.items():
            parsed = []
            for entry in entries if isinstance(entries, list) else [entries]:
                entry = dict(entry)
                if "quant_type" in entry:
                    entry["quant_type"] = _ort_type_by_name(entry["quant_type"])
                if "convert" in entry:
                    convert = dict(entry["convert"])
                    convert["quant_type"] = _ort_type_by_name(convert["quant_type"])
                    if "recv_nodes" in convert:
                        convert["recv_nodes"] = set(convert["recv_nodes"])
                    entry["convert"] = convert
                if "scale" in entry or "zero_point" in entry:
                    dtype = _numpy_dtype_of(entry["quant_type"])
                    entry["scale"] = np.asarray(entry["scale"], np.float32)
                    if not np.all(np.isfinite(entry["scale"])) or np.any(entry["scale"] <= 0):
                        raise ValueError(f"scale of {tensor!r} is not a finite positive number")
                    zero_point = np.asarray(entry["zero_point"])
                    if zero_point.dtype.kind not in "iub" or np.any(zero_point != zero_point.astype(dtype)):
                        raise ValueError(f"zero_point of {tensor!r} does not fit {np.dtype(dtype).name}")
                    entry["zero_point"] = zero_point.astype(dtype)
                parsed.append(entry)
            result[str(tensor)] = parsed
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise QuantizationError(f"not a TensorQuantOverrides file ({type(exc).__name__}: {exc})") from None
    return result


def _ort_type_by_name(name: Any) -> Any:
    QuantType = ort_package.submodule("quantization").QuantType  # noqa: N806 (ORT's class)

    try:
        return QuantType[str(name)]
    except KeyError:
        valid = ", ".join(t.name for t in QuantType)
        raise QuantizationError(f"quant_type {name!r} is unknown; use one of {valid}") from None


def _numpy_dtype_of(quant_type: Any) -> np.dtype:
    types = ort_package.submodule("quantization.quant_utils").ONNX_TYPE_TO_NP_TYPE
    return np.dtype(types[quant_type.tensor_type])


def _encoding_overrides(model: onnx.ModelProto, encodings: EncodingSet) -> dict[str, list[dict[str, Any]]]:
    """AIMET encodings as ORT overrides: activations get their scale and zero point; weights their type."""
    initializers = {t.name for t in model.graph.initializer}
    overrides: dict[str, list[dict[str, Any]]] = {}
    for name, encoding in encodings.tensors.items():
        if encoding.is_float or encoding.bitwidth == 32:
            continue  # 32-bit biases: ORT derives their scale from the input's and the weight's, as QNN does
        if encoding.block_size:
            raise QuantizationError(f"tensor {name!r}: per-block encodings as overrides are not supported; "
                                    "use --block-size instead")  # fmt: skip
        quant_type = quant_type_of(encoding.dtype)
        if name in initializers:
            # The exact values are written afterwards (`_requantize_weights`): ORT computes weight scales itself.
            entry: dict[str, Any] = {"quant_type": quant_type, "symmetric": encoding.symmetric}
            if encoding.granularity == "per_channel":
                entry["axis"] = encoding.axis if encoding.axis is not None else _channel_axis(model, name)
            overrides[name] = [entry]
        elif encoding.granularity == "per_tensor":
            dtype = _numpy_dtype_of(quant_type)
            overrides[name] = [
                {
                    "quant_type": quant_type,
                    "scale": np.asarray(encoding.scale[0], np.float32),
                    "zero_point": np.asarray(encoding.zero_point[0], dtype),
                }
            ]
        else:
            raise QuantizationError(f"activation {name!r}: only per-tensor activation encodings are supported")
    return overrides


def _weights_read_by(model: onnx.ModelProto, op_type: str, position: int) -> list[str]:
    """2-D initializers at input `position` of `op_type` nodes: MatMul weights (1), Gather tables (0)."""
    initializers = {t.name: t for t in model.graph.initializer}
    return [
        node.input[position]
        for node in model.graph.node
        if node.op_type == op_type
        and len(node.input) > position
        and node.input[position] in initializers
        and len(initializers[node.input[position]].dims) == 2
    ]


def _channel_axis(model: onnx.ModelProto, weight: str) -> int:
    """The output-channel axis of a weight: 1 for MatMul's B [in, out], 0 for Conv and Gemm (transB) weights."""
    for node in model.graph.node:
        if weight in node.input[1:2] and node.op_type == "MatMul":
            return 1
    return 0


def fused_activation_encodings(model: onnx.ModelProto, encodings: EncodingSet) -> EncodingSet:
    """`encodings` plus, for each fused pair (Conv→Relu, Gemm→Clip…) whose activation output has an encoding
    and whose producer output has none, that encoding on the producer's output too, as QNN's converter does
    when it folds the activation into the op (AIMET writes an encoding only after the pair)."""
    consumers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    producers = {output: node for node in model.graph.node for output in node.output}
    outputs = {o.name for o in model.graph.output}
    added: dict[str, Encoding] = {}
    for node in model.graph.node:
        if node.op_type not in _CLAMPING_ACTIVATIONS or not node.input or node.output[0] not in encodings.tensors:
            continue
        source = node.input[0]
        producer = producers.get(source)
        fused = producer is not None and producer.op_type in _FUSING_PRODUCERS
        if fused and consumers.get(source) == 1 and source not in outputs and source not in encodings.tensors:
            added[source] = encodings.tensors[node.output[0]]
    if not added:
        return encodings
    return replace(encodings, tensors={**encodings.tensors, **added})


def _float_fallback_exclusions(model: onnx.ModelProto, encodings: set[str]) -> list[str]:
    """Nodes touching a float activation that has no encoding (after propagation): these stay float."""
    initializers = {t.name for t in model.graph.initializer}
    known = set(encodings)
    for node in model.graph.node:  # topological: propagate forward through rearranging ops
        if node.op_type in _INVARIANT_OPS and node.input and node.input[0] in known:
            known.update(node.output)
    float_values = _float_values(model)
    excluded = []
    for node in model.graph.node:
        activations = [v for v in [*node.input, *node.output] if v and v not in initializers and v in float_values]
        if any(v not in known for v in activations):
            excluded.append(node.name)
    return excluded


def _float_values(model: onnx.ModelProto) -> set[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    return {v.name for v in values if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}


class SampleReader:
    """ORT's CalibrationDataReader over a list of feed dicts; rewinds for another pass."""

    def __init__(self, samples: Sequence[Mapping[str, np.ndarray]]) -> None:
        self._samples = list(samples)
        self._iterator: Iterator[Mapping[str, np.ndarray]] = iter(self._samples)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return dict(sample) if (sample := next(self._iterator, None)) is not None else None

    def rewind(self) -> None:
        self._iterator = iter(self._samples)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:  # ORT's debugging tools iterate
        return (dict(sample) for sample in self._samples)


def placeholder_sample(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """One all-zero feed (dynamic dims as 1): enough when every quantized activation has an encoding."""
    from onnx.helper import tensor_dtype_to_np_dtype

    initializers = {t.name for t in model.graph.initializer}
    feed = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor.shape.dim]
        feed[value.name] = np.zeros(shape, tensor_dtype_to_np_dtype(tensor.elem_type))
    return feed


def quantize(
    model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]], options: QuantizeOptions
) -> tuple[onnx.ModelProto, EncodingSet]:
    """A QDQ model runnable by plain ONNX Runtime, and the encodings it uses (AIMET model)."""
    ort_errors = ort_package.submodule("capi.onnxruntime_pybind11_state")

    failures = tuple(
        getattr(ort_errors, name)
        for name in ("Fail", "InvalidArgument", "RuntimeException", "InvalidGraph", "NotImplemented", "EPFail")
        if hasattr(ort_errors, name)
    )
    try:
        return _quantize(model, samples, options)
    except failures as exc:  # calibration runs the float model on the samples: a sample that does not fit
        raise QuantizationError(
            f"ONNX Runtime could not run the model on the calibration inputs ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:300]}); check that every --input-list sample is valid input for the model"
        ) from None


def _quantize(
    model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]], options: QuantizeOptions
) -> tuple[onnx.ModelProto, EncodingSet]:
    quantization = ort_package.submodule("quantization")
    CalibrationMethod, ort_quantize = quantization.CalibrationMethod, quantization.quantize  # noqa: N806
    qnn = ort_package.submodule("quantization.execution_providers.qnn")
    get_qnn_qdq_config, qnn_preprocess_model = qnn.get_qnn_qdq_config, qnn.qnn_preprocess_model

    options.check()
    if not samples and not options.float_fallback:
        raise QuantizationError("calibration needs sample inputs: give --input-list, or --float-fallback with "
                                "--quantization-overrides")  # fmt: skip
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    for index, node in enumerate(model_copy.graph.node):
        if not node.name:  # ORT's quantizer finds nodes by name (exclusions, mixed-precision converts)
            node.name = f"{node.op_type}_{index}"
    mask_fills = clamp_mask_fills(model_copy, samples)
    activation_type, weight_type = _quant_types(options)
    overrides = dict(options.ort_overrides)
    encodings = options.encodings
    if encodings is not None:
        encodings = fused_activation_encodings(model_copy, encodings)
        overrides.update(_encoding_overrides(model_copy, encodings))
    for table in _weights_read_by(model_copy, "Gather", 0):
        # QNN's config gives a Gather table the activations' type (its output shares the encoding): with
        # 16-bit activations that doubles the biggest weight of a transformer. Tables are weights.
        overrides.setdefault(table, [{"quant_type": quant_type_of("uint8")}])
    if options.per_channel:
        # ORT's QNN config keeps MatMul weights per tensor (QNN's HTP has no per-channel MatMul); Quiver's
        # backends have, and a transformer's weights are nearly all MatMul: one scale per output column.
        channel_type = quant_type_of("int8") if options.weight_bits == 8 else weight_type
        for weight in _weights_read_by(model_copy, "MatMul", 1):
            overrides.setdefault(weight, [{"quant_type": channel_type, "symmetric": True, "axis": 1}])
    excluded: list[str] = []
    if options.float_fallback:
        excluded = _float_fallback_exclusions(model_copy, set(overrides))
        if excluded:
            ops = {n.name: n.op_type for n in model_copy.graph.node}
            warnings.warn(
                f"--float-fallback: {len(excluded)} op(s) stay float, an activation of each having no encoding: "
                + ", ".join(f"{name} ({ops[name]})" for name in excluded),
                stacklevel=2,
            )
    method = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
              "entropy": CalibrationMethod.Entropy}[options.calibration]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="quiver-quantize-") as tmp:
        source, target = Path(tmp) / "float.onnx", Path(tmp) / "qdq.onnx"
        onnx.save(model_copy, source, save_as_external_data=model_copy.ByteSize() > 1 << 30)
        preprocessed = Path(tmp) / "preprocessed.onnx"
        # ORT's QNN pre-processing fuses exported Erf / ReduceMean sequences into Gelu / LayerNormalization:
        # one quantized op each instead of a chain of quantized pieces.
        if qnn_preprocess_model(source, preprocessed, fuse_layernorm=True):
            source = preprocessed
        reader = SampleReader(samples or [placeholder_sample(model_copy)])
        quiet = logging.getLogger()
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # ORT's advice to pre-process and its opset notes are not the user's business
        try:
            config = get_qnn_qdq_config(
                str(source),
                reader,
                calibrate_method=method,
                activation_type=activation_type,
                weight_type=weight_type,
                per_channel=options.per_channel,
                init_overrides=overrides or None,
                # An encodings file gives each tensor its own type, as QNN's converter reads it: ORT's fixer
                # would turn a tensor of another type than the default into conversions (and refuse an 8-bit
                # Gather output feeding a 16-bit Add, as Quiver's own 16-bit runs write). ORT's own overrides
                # keep ORT's behaviour.
                add_qtype_converts=encodings is None,
                nodes_to_exclude=excluded or None,
            )
            with contextlib.redirect_stdout(io.StringIO()):  # ORT's calibrators print progress to stdout
                ort_quantize(str(source), str(target), config)
        except QuantizationError:
            raise
        except Exception as exc:
            raise QuantizationError(f"ONNX Runtime's quantizer failed: {type(exc).__name__}: {exc}") from None
        finally:
            quiet.setLevel(level)
        result = onnx.load(target)
    if encodings is not None:
        _requantize_weights(result, model_copy, encodings)
    if options.weight_bits == 4:
        result = _with_opset(result, BLOCK_QUANTIZATION_OPSET)
        _matmul_weights_to_int4_blocks(
            result, model_copy, options.block_size or DEFAULT_BLOCK_SIZE, options.weight_quantizer, samples
        )
    record_mask_fills(result, mask_fills)  # the model says what was changed in it; reports read it there
    used = encodings_of(result)
    if encodings is not None:
        _warn_of_replaced_encodings(encodings, used)
    return result, used


def _warn_of_replaced_encodings(given: EncodingSet, used: EncodingSet) -> None:
    """Says which given activation encodings the result does not use: ORT's QNN rules fix some outputs
    (Tanh, Sigmoid, Softmax...) whatever the overrides say, as QNN's HTP needs them."""
    replaced = [
        name
        for name, encoding in given.activations().items()
        if name in used.tensors
        and not encoding.is_float
        and (used.tensors[name].scale, used.tensors[name].zero_point)
        != (tuple(float(np.float32(s)) for s in encoding.scale), encoding.zero_point)
    ]
    if replaced:
        warnings.warn(
            f"{len(replaced)} given activation encoding(s) were replaced by the fixed ones ONNX Runtime's QNN rules "
            f"require (e.g. Tanh, Sigmoid outputs): {', '.join(replaced)}; the result's encodings say what is used",
            stacklevel=3,
        )


BLOCK_QUANTIZATION_OPSET = 21  # DequantizeLinear's block_size


def _with_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """The model at an ONNX opset of at least `version` (ORT's quantizer keeps the source's on older ORT)."""
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), version)
    if current >= version:
        return model
    try:
        return onnx.version_converter.convert_version(model, version)
    except Exception as exc:
        raise QuantizationError(
            f"4-bit block weights need ONNX opset {version}; converting the model from opset {current} failed "
            f"({exc}); export the model at opset {version} or later"
        ) from None


def _matmul_weights_to_int4_blocks(
    qdq: onnx.ModelProto,
    float_model: onnx.ModelProto,
    block_size: int,
    quantizer: str = "rtn",
    samples: Sequence[Mapping[str, np.ndarray]] = (),
) -> None:
    """MatMul weights [K, N] become int4 in blocks of `block_size` along K (DequantizeLinear-21), made by
    `quantizer` (`quiver.passes.gptq`): symmetric (scale = max|w| / 7 per block and column) or with a zero
    point per block, rounded to nearest or by GPTQ from the float model's inputs on `samples`.

    ORT's quantizer blocks every weight or none (rank-1 ones fail), so it quantizes to 8 bits and the
    MatMul weights, the bulk of a transformer, are redone here. ORT runs this pattern as MatMulNBits.
    """
    floats = {t.name: t for t in float_model.graph.initializer}
    stored = {t.name: t for t in qdq.graph.initializer}
    matmul_weights = {n.input[1] for n in qdq.graph.node if n.op_type == "MatMul"}
    targets: dict[str, onnx.NodeProto] = {}
    for node in qdq.graph.node:
        if node.op_type != "DequantizeLinear" or node.output[0] not in matmul_weights:
            continue
        name = node.input[0].removesuffix(QUANTIZED_SUFFIX)
        names = [f"{name}{QUANTIZED_SUFFIX}", f"{name}_scale", f"{name}_zero_point"]
        if name in floats and len(floats[name].dims) == 2 and all(n in stored for n in names):
            targets[name] = node
    readers: dict[str, list[str]] = {}  # weight -> the float model's MatMul inputs that multiply it
    for node in float_model.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in targets:
            readers.setdefault(node.input[1], []).append(node.input[0])
    gptq = quantizer.startswith("gptq")
    moments = input_moments(float_model, samples, [x for xs in readers.values() for x in xs]) if gptq else {}
    for name, node in targets.items():
        weight = numpy_helper.to_array(floats[name]).astype(np.float32)
        symmetric = not quantizer.endswith("-asym")
        blocks = quantize_blocks(weight, 4, block_size, symmetric, moments_of(readers.get(name, ()), moments))
        names = [f"{name}{QUANTIZED_SUFFIX}", f"{name}_scale", f"{name}_zero_point"]
        del node.input[:]
        node.input.extend(names)
        del node.attribute[:]
        node.attribute.extend(
            [onnx.helper.make_attribute("axis", 0), onnx.helper.make_attribute("block_size", block_size)]
        )
        node.domain = ""  # ONNX's DequantizeLinear-21 has blocks; the com.microsoft one does not
        for name, tensor in zip(names, blocks.int4_initializers(*names)):
            stored[name].CopyFrom(tensor)


def _requantize_weights(qdq: onnx.ModelProto, float_model: onnx.ModelProto, encodings: EncodingSet) -> None:
    """Replaces ORT's weight integers and scales with those of the given param encodings, exactly."""
    floats = {t.name: t for t in float_model.graph.initializer}
    stored = {t.name: t for t in qdq.graph.initializer}
    for name, encoding in encodings.params().items():
        quantized = stored.get(name + QUANTIZED_SUFFIX)
        if encoding.is_float or encoding.bitwidth == 32 or quantized is None or name not in floats:
            continue
        scale, zero = stored[name + "_scale"], stored[name + "_zero_point"]
        dtype = numpy_helper.to_array(quantized).dtype
        if encoding.granularity == "per_channel":
            axis = next(
                (a.i for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == quantized.name
                 for a in n.attribute if a.name == "axis"), 1)  # fmt: skip
            encoding = Encoding(encoding.dtype, encoding.scale, encoding.zero_point, encoding.symmetric, axis=axis)
        if len(encoding.scale) != numpy_helper.to_array(scale).size:
            raise QuantizationError(
                f"weight {name!r}: its encoding has {len(encoding.scale)} scales, the quantized weight needs "
                f"{numpy_helper.to_array(scale).size}"
            )
        ints = encoding.quantize(numpy_helper.to_array(floats[name]).astype(np.float32)).astype(dtype)
        quantized.CopyFrom(numpy_helper.from_array(ints, quantized.name))
        shape = numpy_helper.to_array(scale).shape
        scale.CopyFrom(numpy_helper.from_array(encoding.scale_array().reshape(shape), scale.name))
        zero.CopyFrom(numpy_helper.from_array(np.asarray(encoding.zero_point, dtype).reshape(shape), zero.name))
    _rederive_biases(qdq, floats, stored)


def _rederive_biases(
    qdq: onnx.ModelProto, floats: Mapping[str, onnx.TensorProto], stored: Mapping[str, onnx.TensorProto]
) -> None:
    """A 32-bit bias's scale is its op's input scale × weight scale (QNN's rule, and ORT's): where the
    weight's scale was replaced by a given one, the bias is quantized again to the new product."""
    dequantized = {n.output[0]: n for n in qdq.graph.node if n.op_type == "DequantizeLinear"}

    def array(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(stored[name]) if name in stored else None

    for node in qdq.graph.node:
        if len(node.input) < 3 or not all(i in dequantized for i in node.input[:3]):
            continue
        x, w, b = (dequantized[i] for i in node.input[:3])
        bias_ints, bias_scale, x_scale, w_scale = (
            array(b.input[0]),
            array(b.input[1]),
            array(x.input[1]),
            array(w.input[1]),
        )
        bias_float = floats.get(b.input[0].removesuffix(QUANTIZED_SUFFIX))
        if bias_ints is None or bias_ints.dtype != np.int32 or bias_float is None or x_scale is None or w_scale is None:
            continue
        scale = (x_scale.astype(np.float64) * w_scale.astype(np.float64)).astype(np.float32).reshape(-1)
        if bias_scale is not None and bias_scale.size == scale.size and np.array_equal(bias_scale.reshape(-1), scale):
            continue  # ORT's product already: the weight kept its scale
        values = numpy_helper.to_array(bias_float).astype(np.float64)
        ints = np.clip(np.round(values / scale.astype(np.float64)), -(2**31), 2**31 - 1).astype(np.int32)
        stored[b.input[0]].CopyFrom(numpy_helper.from_array(ints, b.input[0]))
        shape = bias_scale.shape if bias_scale is not None and bias_scale.size == scale.size else scale.shape
        stored[b.input[1]].CopyFrom(numpy_helper.from_array(scale.reshape(shape), b.input[1]))


def encodings_of(model: onnx.ModelProto) -> EncodingSet:
    """The encodings a QDQ model uses: weights by their float names, activations by the tensors quantized."""
    constants = {t.name: t for t in model.graph.initializer}
    return graph_encodings(
        model, constants, lambda name: numpy_helper.to_array(constants[name]) if name in constants else None
    )

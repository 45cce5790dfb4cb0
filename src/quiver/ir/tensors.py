"""Descriptions of graph tensors: name, dtype, shape and QNN-style role."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from quiver.errors import ConversionError
from quiver.ir import dtypes, proto

Dim = int | str | None


class TensorType(enum.Enum):
    """The role of a tensor, with QNN's names."""

    APP_WRITE = "APP_WRITE"  # graph input, written by the application
    APP_READ = "APP_READ"  # graph output, read by the application
    STATIC = "STATIC"  # weight, fixed at build time
    NATIVE = "NATIVE"  # intermediate, owned by the backend
    UPDATEABLE_STATIC = "UPDATEABLE_STATIC"  # weight whose value can be replaced at run time


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # a Quiver dtype name, e.g. "float32"
    shape: tuple[Dim, ...] | None  # None: rank unknown; str: a symbolic dim; None dim: unknown
    tensor_type: TensorType

    @property
    def numpy_dtype(self) -> np.dtype:
        return dtypes.numpy_of(self.dtype)

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
            "type": self.tensor_type.value,
        }


def info_of_value(value: proto.ValueInfoProto, tensor_type: TensorType) -> TensorInfo:
    kind = value.type.WhichOneof("value")
    if kind not in ("tensor_type", None):
        raise ConversionError(
            f"{value.name!r} is a {kind.removesuffix('_type')} at the graph's edge; Quiver's graphs take and give "
            "tensors (sequences and maps inside a graph are fine): run the model with onnxruntime"
        )
    tensor = value.type.tensor_type
    shape: tuple[Dim, ...] | None = None
    if tensor.HasField("shape"):
        shape = tuple(
            # a negative size (Paddle writes -1) is a dynamic one, as ORT reads it
            (d.dim_value if d.dim_value >= 0 else None) if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim
        )
    return TensorInfo(value.name, dtypes.io_name_of_onnx(tensor.elem_type), shape, tensor_type)


# The input of a LoRA graph holding one strength per adapter (QNN's `lora_alpha`, Genie's alpha tensor).
LORA_ALPHA_INPUT = "lora_alpha"

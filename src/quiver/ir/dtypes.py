"""One table mapping ONNX element types to numpy dtypes and the names used in files."""

from __future__ import annotations

from collections.abc import Iterable

import ml_dtypes
import numpy as np

from quiver.errors import ConversionError
from quiver.ir.proto import TensorProto

# name in .qctx headers and CLI output -> (ONNX element type, numpy dtype)
_TABLE: dict[str, tuple[int, np.dtype]] = {
    "float32": (TensorProto.FLOAT, np.dtype(np.float32)),
    "float16": (TensorProto.FLOAT16, np.dtype(np.float16)),
    "float64": (TensorProto.DOUBLE, np.dtype(np.float64)),
    "bfloat16": (TensorProto.BFLOAT16, np.dtype(ml_dtypes.bfloat16)),
    "int8": (TensorProto.INT8, np.dtype(np.int8)),
    "uint8": (TensorProto.UINT8, np.dtype(np.uint8)),
    "int16": (TensorProto.INT16, np.dtype(np.int16)),
    "uint16": (TensorProto.UINT16, np.dtype(np.uint16)),
    "int32": (TensorProto.INT32, np.dtype(np.int32)),
    "uint32": (TensorProto.UINT32, np.dtype(np.uint32)),
    "int64": (TensorProto.INT64, np.dtype(np.int64)),
    "uint64": (TensorProto.UINT64, np.dtype(np.uint64)),
    "bool": (TensorProto.BOOL, np.dtype(np.bool_)),
}
_BY_ONNX = {onnx_type: name for name, (onnx_type, _) in _TABLE.items()}

DTYPE_NAMES = frozenset(_TABLE)

# Types graph inputs and outputs may have but weights may not (weights of these are converted at
# build time: 4-bit ones packed for MatMulNBits). numpy holds them as ml_dtypes (one byte per value,
# 4-bit ones too) and strings as object arrays of str.
_IO_ONLY: dict[str, tuple[int, np.dtype]] = {
    "float8e4m3fn": (TensorProto.FLOAT8E4M3FN, np.dtype(ml_dtypes.float8_e4m3fn)),
    "float8e4m3fnuz": (TensorProto.FLOAT8E4M3FNUZ, np.dtype(ml_dtypes.float8_e4m3fnuz)),
    "float8e5m2": (TensorProto.FLOAT8E5M2, np.dtype(ml_dtypes.float8_e5m2)),
    "float8e5m2fnuz": (TensorProto.FLOAT8E5M2FNUZ, np.dtype(ml_dtypes.float8_e5m2fnuz)),
    "int4": (TensorProto.INT4, np.dtype(ml_dtypes.int4)),
    "uint4": (TensorProto.UINT4, np.dtype(ml_dtypes.uint4)),
    "string": (TensorProto.STRING, np.dtype(object)),
}
_ANY = {**_TABLE, **_IO_ONLY}
_ANY_BY_ONNX = {onnx_type: name for name, (onnx_type, _) in _ANY.items()}
IO_DTYPE_NAMES = frozenset(_ANY)


def as_io_array(array: np.ndarray, name: str) -> np.ndarray:
    """An array of an I/O-only type in the numpy form Quiver uses (ml_dtypes, str objects), from the
    forms other libraries give: raw bytes (ORT's float8 outputs), onnx 1.17's structured dtypes."""
    target = numpy_of(name)
    if array.dtype == target:
        return array
    if name == "string":
        return np.array([v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)],
                        dtype=object).reshape(array.shape)  # fmt: skip
    if name.startswith("float8"):
        return array.view(np.uint8).view(target)  # the same bits
    return array.view(np.int8 if name == "int4" else np.uint8).astype(target)  # 4-bit: one value per byte


def name_of_onnx(elem_type: int) -> str:
    """The Quiver dtype name of an ONNX element type; raises for types weights cannot have."""
    try:
        return _BY_ONNX[elem_type]
    except KeyError:
        type_name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise ConversionError(
            f"tensors of ONNX type {type_name} are not supported by Quiver; use one of: {', '.join(sorted(_TABLE))}"
        ) from None


def io_name_of_onnx(elem_type: int) -> str:
    """The Quiver dtype name of a graph input's or output's element type (weights' types and I/O-only ones)."""
    return _ANY_BY_ONNX[elem_type] if elem_type in _ANY_BY_ONNX else name_of_onnx(elem_type)  # raises


def numpy_of(name: str) -> np.dtype:
    return _ANY[name][1]


def onnx_of(name: str) -> int:
    return _ANY[name][0]


def itemsize(name: str) -> int:
    return int(_TABLE[name][1].itemsize)


def byte_length(name: str, shape: Iterable[int]) -> int:
    """The bytes a tensor of this dtype and shape takes, in Python integers (no overflow)."""
    length = itemsize(name)
    for dim in shape:
        length *= int(dim)
    return length

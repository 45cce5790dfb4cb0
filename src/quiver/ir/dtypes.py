"""One table mapping ONNX element types to numpy dtypes and the names used in files."""

from __future__ import annotations

import enum
import functools
import sys
from collections.abc import Iterable

import numpy as np

from quiver.errors import ConversionError


class ElementType(enum.IntEnum):
    """ONNX's element types (TensorProto.DataType): numbers fixed by the ONNX spec, kept here so that
    reading a type needs no protobuf import (paid only when a model is actually parsed)."""

    UNDEFINED = 0
    FLOAT = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    DOUBLE = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23
    FLOAT8E8M0 = 24
    UINT2 = 25
    INT2 = 26
    FLOAT6E2M3 = 27
    FLOAT6E3M2 = 28


_T = ElementType
# name in .qctx headers and CLI output -> (ONNX element type, numpy dtype; a str names an ml_dtypes type,
# resolved on first use: ml_dtypes costs ~10 ms to import)
_TABLE: dict[str, tuple[int, np.dtype | str]] = {
    "float32": (_T.FLOAT, np.dtype(np.float32)),
    "float16": (_T.FLOAT16, np.dtype(np.float16)),
    "float64": (_T.DOUBLE, np.dtype(np.float64)),
    "bfloat16": (_T.BFLOAT16, "bfloat16"),
    "int8": (_T.INT8, np.dtype(np.int8)),
    "uint8": (_T.UINT8, np.dtype(np.uint8)),
    "int16": (_T.INT16, np.dtype(np.int16)),
    "uint16": (_T.UINT16, np.dtype(np.uint16)),
    "int32": (_T.INT32, np.dtype(np.int32)),
    "uint32": (_T.UINT32, np.dtype(np.uint32)),
    "int64": (_T.INT64, np.dtype(np.int64)),
    "uint64": (_T.UINT64, np.dtype(np.uint64)),
    "bool": (_T.BOOL, np.dtype(np.bool_)),
}
_BY_ONNX = {onnx_type: name for name, (onnx_type, _) in _TABLE.items()}

DTYPE_NAMES = frozenset(_TABLE)

# Types graph inputs and outputs may have but weights may not (weights of these are converted at
# build time: 4-bit ones packed for MatMulNBits). numpy holds them as ml_dtypes (one byte per value,
# 4-bit ones too) and strings as object arrays of str.
_IO_ONLY: dict[str, tuple[int, np.dtype | str]] = {
    "float8e4m3fn": (_T.FLOAT8E4M3FN, "float8_e4m3fn"),
    "float8e4m3fnuz": (_T.FLOAT8E4M3FNUZ, "float8_e4m3fnuz"),
    "float8e5m2": (_T.FLOAT8E5M2, "float8_e5m2"),
    "float8e5m2fnuz": (_T.FLOAT8E5M2FNUZ, "float8_e5m2fnuz"),
    "int4": (_T.INT4, "int4"),
    "uint4": (_T.UINT4, "uint4"),
    "string": (_T.STRING, np.dtype(object)),
}
_ANY = {**_TABLE, **_IO_ONLY}
_ANY_BY_ONNX = {onnx_type: name for name, (onnx_type, _) in _ANY.items()}
IO_DTYPE_NAMES = frozenset(_ANY)


def type_name(elem_type: int) -> str:
    """ONNX's upper-case name of an element type ('FLOAT'), or its number where this table has none."""
    try:
        return ElementType(elem_type).name
    except ValueError:
        return str(elem_type)


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
        supported = ", ".join(sorted(_TABLE))
        raise ConversionError(
            f"tensors of ONNX type {type_name(elem_type)} are not supported by Quiver; use one of: {supported}"
        ) from None


def io_name_of_onnx(elem_type: int) -> str:
    """The Quiver dtype name of a graph input's or output's element type (weights' types and I/O-only ones)."""
    return _ANY_BY_ONNX[elem_type] if elem_type in _ANY_BY_ONNX else name_of_onnx(elem_type)  # raises


@functools.cache
def numpy_of(name: str) -> np.dtype:
    dtype = _ANY[name][1]
    if isinstance(dtype, str):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype))
    return dtype


def onnx_of(name: str) -> int:
    return _ANY[name][0]


def onnx_of_numpy(dtype: np.dtype) -> int | None:
    """The ONNX element type of a numpy dtype (strings excluded), None where Quiver has none. An ml_dtypes
    dtype exists only once ml_dtypes is imported: until then its types are not compared (nor imported)."""
    for name, (number, spec) in _ANY.items():
        if name == "string" or (isinstance(spec, str) and "ml_dtypes" not in sys.modules):
            continue
        if numpy_of(name) == dtype:
            return number
    return None


def itemsize(name: str) -> int:
    if name not in _TABLE:
        raise KeyError(name)  # weights' types only, as the callers expect
    return int(numpy_of(name).itemsize)


def byte_length(name: str, shape: Iterable[int]) -> int:
    """The bytes a tensor of this dtype and shape takes, in Python integers (no overflow)."""
    length = itemsize(name)
    for dim in shape:
        length *= int(dim)
    return length

"""One table mapping ONNX element types to numpy dtypes and the names used in files."""

from __future__ import annotations

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


def name_of_onnx(elem_type: int) -> str:
    """The Quiver dtype name of an ONNX element type; raises for types weights cannot have."""
    try:
        return _BY_ONNX[elem_type]
    except KeyError:
        type_name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise ConversionError(
            f"tensors of ONNX type {type_name} are not supported by Quiver; use one of: {', '.join(sorted(_TABLE))}"
        ) from None


def numpy_of(name: str) -> np.dtype:
    return _TABLE[name][1]


def onnx_of(name: str) -> int:
    return _TABLE[name][0]


def itemsize(name: str) -> int:
    return int(_TABLE[name][1].itemsize)

"""Loads ONNX models without pulling external weight data into memory; tensors become streamable sources."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from quiver.errors import ModelLoadError
from quiver.formats.layout import INLINE_LIMIT, WEIGHT_LOCATION
from quiver.ir import dtypes
from quiver.ir.deferred import Deferred

CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class TensorSource:
    """Where one initializer's bytes come from: in-memory array, a range of an external data file, or a
    deferred array (made when it is stored: a streaming export's weights)."""

    dtype: str
    shape: tuple[int, ...]
    array: np.ndarray | None = None
    path: Path | None = None
    offset: int = 0
    length: int = 0
    deferred: Deferred | None = None

    @property
    def nbytes(self) -> int:
        if self.deferred is not None:
            return self.deferred.nbytes
        return self.array.nbytes if self.array is not None else self.length

    def chunks(self) -> Iterator[memoryview]:
        """The tensor's little-endian bytes, streamed in bounded chunks."""
        array = self.deferred.compute() if self.deferred is not None else self.array
        if array is not None:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
            for start in range(0, len(data), CHUNK):
                yield data[start : start + CHUNK]
            return
        assert self.path is not None
        with open(self.path, "rb") as f:
            if self.length == 0:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                for start in range(self.offset, self.offset + self.length, CHUNK):
                    yield memoryview(mapped[start : min(start + CHUNK, self.offset + self.length)])

    def to_array(self) -> np.ndarray:
        if self.deferred is not None:
            return self.deferred.compute()
        if self.array is not None:
            return self.array
        return np.frombuffer(b"".join(bytes(c) for c in self.chunks()), dtypes.numpy_of(self.dtype)).reshape(self.shape)


def load_model(
    source: str | Path | onnx.ModelProto, external_data_folder: Path | None = None
) -> tuple[onnx.ModelProto, Path | None]:
    """The model (external data left on disk) and the folder its external data is relative to: the file's
    own, or for a ModelProto the folder the caller names (ORT's `model_external_initializers_file_folder_path`)."""
    if isinstance(source, onnx.ModelProto):
        return source, external_data_folder
    path = Path(source)
    if not path.is_file():
        raise ModelLoadError(f"no ONNX model at {path}; check the path")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several unrelated types on malformed input
        raise ModelLoadError(f"{path} is not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node and not model.graph.output:
        raise ModelLoadError(f"{path} parsed as an empty ONNX model; is it really an .onnx file?")
    return model, path.parent


def _external_source(tensor: onnx.TensorProto, dtype: str, shape: tuple[int, ...], base: Path | None) -> TensorSource:
    info = {e.key: e.value for e in tensor.external_data}
    if base is None:
        raise ModelLoadError(
            f"initializer {tensor.name!r} keeps its data in an external file; pass the model's path, "
            "not a ModelProto, or load it with onnx.load(path) first"
        )
    location = info.get("location", "")
    file = (base / location).resolve()
    if not location or base.resolve() not in file.parents:
        raise ModelLoadError(f"initializer {tensor.name!r}: external data path {location!r} leaves the model's folder")
    if not file.is_file():
        raise ModelLoadError(f"initializer {tensor.name!r}: external data file {file} is missing")
    try:
        offset = int(info.get("offset", "0"))
        expected = dtypes.byte_length(dtype, shape)
        length = int(info.get("length", str(expected)))
    except ValueError:
        raise ModelLoadError(f"initializer {tensor.name!r}: external data offset/length are not integers") from None
    if length != expected or offset < 0 or offset + length > os.path.getsize(file):
        raise ModelLoadError(
            f"initializer {tensor.name!r}: {length} bytes at offset {offset} do not fit {file.name} "
            f"or the tensor's {expected} bytes"
        )
    return TensorSource(dtype, shape, path=file, offset=offset, length=length)


def placeholder(name: str, data_type: int, dims: Sequence[int]) -> onnx.TensorProto:
    """An initializer without data: its bytes lie among the context's weights (`WEIGHT_LOCATION`)."""
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=dims, data_location=onnx.TensorProto.EXTERNAL)
    tensor.external_data.add(key="location", value=WEIGHT_LOCATION)
    return tensor


def deferred_placeholder(name: str, value: Deferred) -> onnx.TensorProto:
    """A placeholder whose values are `value`, made when the context stores it (`deferred` of
    `tensor_source`)."""
    data_type = dtypes.onnx_of_numpy(value.dtype)
    assert data_type is not None, value.dtype  # a recipe's dtype, never the user's
    return placeholder(name, data_type, value.shape)


def weight_initializer(
    name: str, value: np.ndarray | Deferred, deferred: dict[str, Deferred] | None
) -> onnx.TensorProto:
    """`value` as the initializer `name`: with its data, or where `deferred` is given and the value is not
    small, a placeholder whose values `deferred` holds (made when the context stores them; a name already
    there keeps the first value: the graphs of one export share their weights by name)."""
    if deferred is None or value.nbytes < INLINE_LIMIT:
        array = value.compute() if isinstance(value, Deferred) else value
        return numpy_helper.from_array(np.ascontiguousarray(array), name)
    kept = deferred.setdefault(name, value if isinstance(value, Deferred) else Deferred.of(value))
    if kept.shape != tuple(value.shape) or kept.dtype != value.dtype:  # a recipe's mistake, never the user's
        raise ValueError(f"two weights named {name!r} of different shapes: {kept.shape} and {value.shape}")
    return deferred_placeholder(name, kept)


def materialized(model: onnx.ModelProto, deferred: Mapping[str, Deferred]) -> onnx.ModelProto:
    """A copy of `model` whose deferred placeholders hold their values (for running the model in memory:
    a calibration pass)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for index, tensor in enumerate(copy.graph.initializer):
        if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.name in deferred:
            values = deferred[tensor.name].compute()
            copy.graph.initializer[index].CopyFrom(numpy_helper.from_array(values, tensor.name))
    return copy


def tensor_source(
    tensor: onnx.TensorProto, base: Path | None, deferred: Mapping[str, Deferred] | None = None
) -> TensorSource:
    """A streamable source for an initializer, without reading external data; `deferred`: the values of
    placeholders a streaming export made (`deferred_placeholder`)."""
    dtype = dtypes.name_of_onnx(tensor.data_type)
    shape = tuple(int(d) for d in tensor.dims)
    value = deferred.get(tensor.name) if deferred is not None else None
    if value is not None and tensor.data_location == onnx.TensorProto.EXTERNAL:
        if value.shape != shape or dtypes.onnx_of_numpy(value.dtype) != tensor.data_type:
            raise ModelLoadError(f"initializer {tensor.name!r} is {dtype}{list(shape)}; its deferred values are not")
        return TensorSource(dtype, shape, deferred=value)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return _external_source(tensor, dtype, shape, base)
    try:
        array = numpy_helper.to_array(tensor)
    except Exception as exc:
        raise ModelLoadError(f"initializer {tensor.name!r} cannot be decoded ({exc})") from None
    target = dtypes.numpy_of(dtype)
    if array.dtype != target and array.dtype.itemsize == target.itemsize and dtype == "bfloat16":
        array = array.view(target)  # onnx decodes bfloat16 as raw uint16 bits
    return TensorSource(dtype, shape, array=array.astype(target, copy=False))

"""Reads a transformers causal-LM folder's weights (safetensors) without torch, and its token ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from quiver.errors import ModelFolderError
from quiver.formats.files import open_regular
from quiver.ir.deferred import Deferred

_SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
}


def token_ids(value: Any) -> tuple[int, ...]:
    """The token ids of a config value (an id or a list of them); anything else is left out."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


class SafetensorsWeights:
    """Every tensor of a folder's *.safetensors files as float32, read on demand (bf16 and f16 converted),
    one tensor at a time."""

    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelFolderError(f"{folder} has no *.safetensors weights; save the model with safe_serialization")
        self._where: dict[str, tuple[Path, str, list[int], int, int]] = {}
        self._read: set[str] = set()
        for path in files:
            for name, entry in self._header(path).items():
                self._where[name] = (path, *entry)

    @staticmethod
    def _header(path: Path) -> dict[str, tuple[str, list[int], int, int]]:
        with open_regular(path) as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                raise ModelFolderError(f"{path}: not a safetensors file (header length {length}, file {size} bytes)")
            try:
                header = json.loads(f.read(length))
            except ValueError as exc:
                raise ModelFolderError(f"{path}: damaged safetensors header ({exc})") from None
        entries = {}
        for name, raw in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
            if dtype not in _SAFETENSORS_DTYPES:
                raise ModelFolderError(f"{path}: tensor {name!r} is {dtype}; float weights are expected")
            start, end = (8 + length + o for o in offsets)
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if not start <= end <= size or end - start != count * np.dtype(_SAFETENSORS_DTYPES[dtype]).itemsize:
                raise ModelFolderError(f"{path}: tensor {name!r} lies outside the file or has the wrong length")
            entries[name] = (dtype, list(shape), start, end)
        return entries

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def ignore(self, name: str) -> None:
        """A tensor the model does not compute with (a tied head's saved copy, as transformers ties it)."""
        self._read.add(name)

    def unused(self) -> list[str]:
        """The tensors nothing read (transformers' saved rotary buffers aside)."""
        return sorted(n for n in self._where if n not in self._read and not n.endswith("rotary_emb.inv_freq"))

    def deferred(self, name: str) -> Deferred:
        """The tensor as float32, read when it is made (the name counts as used now)."""
        if name not in self._where:
            raise ModelFolderError(f"the weights have no tensor {name!r}: does config.json describe these weights?")
        self._read.add(name)
        path, dtype, shape, start, end = self._where[name]

        def read() -> np.ndarray:
            with open_regular(path) as f:
                f.seek(start)
                data = f.read(end - start)
            if len(data) != end - start:
                raise ModelFolderError(f"{path}: tensor {name!r} was cut short while it was read")
            return np.frombuffer(data, _SAFETENSORS_DTYPES[dtype]).reshape(shape).astype(np.float32)

        return Deferred(shape, np.float32, read)

    def get(self, name: str) -> np.ndarray:
        return self.deferred(name).compute()

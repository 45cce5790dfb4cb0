"""The weight-sharing report between two ONNX models, matched by content, never by name."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from quiver.passes.load import TensorSource, load_model, tensor_source
from quiver.passes.quantized import weight_encodings


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sha256: str
    encoding: str = ""  # sha256 of the encoding a quantized weight is read with

    @property
    def content(self) -> tuple[str, tuple[int, ...], str]:
        return (self.dtype, self.shape, self.sha256)

    @property
    def key(self) -> tuple[str, tuple[int, ...], str, str]:
        """What must match for two graphs to share the tensor: bytes and encoding (QNN's rule)."""
        return (*self.content, self.encoding)


@dataclass
class Comparison:
    """Initializers of A and B: identical (same content), different (same role, other bytes), unmatched."""

    identical: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    different: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # same bytes, other encoding: would be shared but for the encodings
    encoding_conflicts: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    only_a: list[Tensor] = field(default_factory=list)
    only_b: list[Tensor] = field(default_factory=list)
    bytes_a: int = 0
    bytes_b: int = 0
    shared_bytes: int = 0  # bytes of distinct content present in both

    @property
    def separate_bytes(self) -> int:
        return self.bytes_a + self.bytes_b

    @property
    def context_bytes(self) -> int:
        """Weight bytes of one shared context holding both models."""
        return self.separate_bytes - self.shared_bytes

    def to_json(self) -> dict[str, object]:
        def rows(pairs: list[tuple[Tensor, Tensor]]) -> list[dict[str, object]]:
            return [
                {"a": a.name, "b": b.name, "dtype": a.dtype, "shape": list(a.shape), "bytes": a.nbytes}
                for a, b in pairs
            ]

        return {
            "identical": rows(self.identical),
            "different": rows(self.different),
            "encoding_conflicts": rows(self.encoding_conflicts),
            "only_a": [t.name for t in self.only_a],
            "only_b": [t.name for t in self.only_b],
            "bytes_a": self.bytes_a,
            "bytes_b": self.bytes_b,
            "separate_bytes": self.separate_bytes,
            "context_bytes": self.context_bytes,
            "saved_bytes": self.shared_bytes,
        }


def _digest(source: TensorSource) -> str:
    digest = hashlib.sha256()
    for chunk in source.chunks():
        digest.update(chunk)
    return digest.hexdigest()


def _tensors_in_use_order(model: onnx.ModelProto, base: Path | None) -> list[Tensor]:
    """Initializers in the order nodes first use them: the order in which two exports line up."""
    by_name = {t.name: t for t in model.graph.initializer}
    order = list(dict.fromkeys(name for node in model.graph.node for name in node.input if name in by_name))
    order += [name for name in by_name if name not in order]
    sources = {name: tensor_source(by_name[name], base) for name in order}
    encodings = weight_encodings(model, set(order), lambda name: sources[name].to_array() if name in sources else None)
    return [
        Tensor(name, s.dtype, s.shape, s.nbytes, _digest(s), encodings.get(name, {}).get("sha256", ""))
        for name, s in sources.items()
    ]


def compare_models(a: str | Path | onnx.ModelProto, b: str | Path | onnx.ModelProto) -> Comparison:
    """Which initializers two models could share in one context, and the bytes that saves."""
    tensors_a = _tensors_in_use_order(*load_model(a))
    tensors_b = _tensors_in_use_order(*load_model(b))
    result = Comparison()
    result.bytes_a = sum(t.nbytes for t in tensors_a)
    result.bytes_b = sum(t.nbytes for t in tensors_b)
    keys_b: dict[tuple[str, tuple[int, ...], str, str], Tensor] = {t.key: t for t in tensors_b}
    keys_a = {t.key for t in tensors_a}
    result.shared_bytes = sum(t.nbytes for key, t in keys_b.items() if key in keys_a)
    rest_b = [t for t in tensors_b if t.key not in keys_a]
    contents_b = {t.content: t for t in rest_b}
    for tensor in tensors_a:
        if tensor.key in keys_b:
            result.identical.append((tensor, keys_b[tensor.key]))
            continue
        twin = contents_b.pop(tensor.content, None)
        if twin is not None and twin in rest_b:
            rest_b.remove(twin)
            result.encoding_conflicts.append((tensor, twin))
            continue
        # Same dtype and shape, first in use order: the same parameter, fine-tuned.
        match = next((t for t in rest_b if (t.dtype, t.shape) == (tensor.dtype, tensor.shape)), None)
        if match is None:
            result.only_a.append(tensor)
        else:
            rest_b.remove(match)
            result.different.append((tensor, match))
    result.only_b = rest_b
    return result

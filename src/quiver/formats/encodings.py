"""Quantization encodings: one internal model, read from and written to AIMET encodings JSON 0.6.1 / 1.0.0 / 2.0.0.

The internal model is ONNX's: real = scale·(q − zero_point), q of an explicit integer dtype (uint8, int8,
uint16, int16, int4, uint4, int32). QNN and AIMET 0.6.1 / 1.0.0 write real = scale·(q + offset) with q
counted from 0 (unsigned), so offset = −zero_point for an unsigned dtype and
offset = −zero_point − 2^(bw−1) for a signed one; symmetric encodings of a signed dtype have
offset = −2^(bw−1). Numbers keep their JSON values (Python floats), so a file read and written
again in its own version is unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from quiver.errors import EncodingsError, FileAccessError, QuiverError
from quiver.formats.files import read_text
from quiver.formats.writer import write_atomically

VERSIONS = ("0.6.1", "1.0.0", "2.0.0")
INTEGER_DTYPES = {  # name -> (bit width, signed)
    "uint4": (4, False),
    "int4": (4, True),
    "uint8": (8, False),
    "int8": (8, True),
    "uint16": (16, False),
    "int16": (16, True),
    "uint32": (32, False),
    "int32": (32, True),
}
FLOAT_DTYPES = {"float16": 16, "float32": 32}


def integer_dtype(bitwidth: int, signed: bool) -> str:
    name = f"{'' if signed else 'u'}int{bitwidth}"
    if name not in INTEGER_DTYPES:
        raise EncodingsError(f"no {bitwidth}-bit integer type; use 4, 8, 16 or 32 bits")
    return name


def qrange(dtype: str) -> tuple[int, int]:
    """The smallest and largest value of an integer dtype."""
    bits, signed = INTEGER_DTYPES[dtype]
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


@dataclass(frozen=True)
class Encoding:
    """How one tensor is quantized: per tensor (one scale), per channel (`axis`) or per block (`block_size`)."""

    dtype: str  # an INTEGER_DTYPES or FLOAT_DTYPES name; a float dtype means "kept in float"
    scale: tuple[float, ...] = ()
    zero_point: tuple[int, ...] = ()
    symmetric: bool = False
    axis: int | None = None
    block_size: int | None = None
    per_channel: bool = False  # AIMET 1.0.0 says PER_CHANNEL without naming the axis
    kind: str | None = None  # "param" or "activation"; unknown for AIMET 2.0.0 files
    # AIMET 0.6.1 also records min/max; kept so that a file round-trips exactly.
    minimum: tuple[float, ...] | None = field(default=None, compare=False)
    maximum: tuple[float, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in INTEGER_DTYPES and self.dtype not in FLOAT_DTYPES:
            raise EncodingsError(f"unknown encoding dtype {self.dtype!r}; use one of {sorted(INTEGER_DTYPES)}")
        if self.is_float:
            return
        if not self.scale or len(self.scale) != len(self.zero_point):
            raise EncodingsError(
                f"an integer encoding needs one zero point per scale, got {len(self.scale)} and {len(self.zero_point)}"
            )
        if any(not (s > 0 and math.isfinite(s)) for s in self.scale):
            raise EncodingsError("encoding scales must be positive and finite")
        low, high = qrange(self.dtype)
        if any(not low <= z <= high for z in self.zero_point):
            raise EncodingsError(f"a zero point lies outside {self.dtype}'s range [{low}, {high}]")

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def bitwidth(self) -> int:
        return FLOAT_DTYPES[self.dtype] if self.is_float else INTEGER_DTYPES[self.dtype][0]

    @property
    def signed(self) -> bool:
        return not self.is_float and INTEGER_DTYPES[self.dtype][1]

    @property
    def granularity(self) -> str:
        if self.block_size:
            return "per_block"
        channelwise = self.per_channel or self.axis is not None or len(self.scale) > 1
        return "per_channel" if channelwise else "per_tensor"

    @property
    def offsets(self) -> tuple[int, ...]:
        """QNN's offsets: real = scale·(q + offset) with q counted from 0."""
        shift = (1 << (self.bitwidth - 1)) if self.signed else 0
        return tuple(-z - shift for z in self.zero_point)

    @classmethod
    def from_offsets(
        cls, bitwidth: int, scale: Iterable[float], offset: Iterable[int], symmetric: bool, **kwargs: Any
    ) -> Encoding:
        """From QNN's scale/offset. Symmetric with offset −2^(bw−1) is a signed type with zero point 0."""
        offsets = tuple(int(o) for o in offset)
        if any(o > 0 for o in offsets):
            raise EncodingsError(f"QNN offsets must be ≤ 0 (real = scale·(q + offset)); got {max(offsets)}")
        half = 1 << (bitwidth - 1)
        signed = symmetric and all(o == -half for o in offsets)
        zero_point = tuple(0 for _ in offsets) if signed else tuple(-o for o in offsets)
        return cls(integer_dtype(bitwidth, signed), tuple(float(s) for s in scale), zero_point, symmetric, **kwargs)

    def with_dtype(self, dtype: str) -> Encoding:
        """The same real values in another integer type of the same width (e.g. int8 ⇄ uint8)."""
        bits, signed = INTEGER_DTYPES[dtype]
        if bits != self.bitwidth or self.is_float:
            raise EncodingsError(f"cannot express a {self.dtype} encoding as {dtype}")
        shift = (1 << (bits - 1)) * (int(self.signed) - int(signed))
        return replace(self, dtype=dtype, zero_point=tuple(z + shift for z in self.zero_point))

    def scale_array(self) -> np.ndarray:
        return np.asarray(self.scale, dtype=np.float32).reshape(() if self.granularity == "per_tensor" else -1)

    def quantize(self, values: np.ndarray) -> np.ndarray:
        """Integers for `values` (per tensor or per channel along `axis`), rounded half to even as ONNX does."""
        scale, zero = self.scale_array(), np.asarray(self.zero_point, np.int64).reshape(self.scale_array().shape)
        if scale.ndim and self.axis is not None:
            shape = [1] * values.ndim
            shape[self.axis] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        low, high = qrange(self.dtype)
        return np.clip(np.rint(values / scale) + zero, low, high).astype(np.int64)


@dataclass
class EncodingSet:
    """Encodings by tensor name, plus the other top-level fields of the file they came from."""

    tensors: dict[str, Encoding] = field(default_factory=dict)
    version: str = "1.0.0"
    extras: dict[str, Any] = field(default_factory=dict)  # quantizer_args, excluded_layers, ...

    def params(self) -> dict[str, Encoding]:
        return {n: e for n, e in self.tensors.items() if e.kind == "param"}

    def activations(self) -> dict[str, Encoding]:
        return {n: e for n, e in self.tensors.items() if e.kind != "param"}


# --- reading ---------------------------------------------------------------------------------------


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() == "true"


def _read_061(entries: Any, kind: str) -> Encoding:
    entries = _as_list(entries)
    first = entries[0]
    if str(first.get("dtype", "int")).lower() == "float":
        return Encoding(f"float{int(first['bitwidth'])}", kind=kind)
    return Encoding.from_offsets(
        int(first["bitwidth"]),
        [e["scale"] for e in entries],
        [e["offset"] for e in entries],
        _bool(first.get("is_symmetric", False)),
        kind=kind,
        per_channel=len(entries) > 1,
        minimum=tuple(float(e["min"]) for e in entries) if all("min" in e for e in entries) else None,
        maximum=tuple(float(e["max"]) for e in entries) if all("max" in e for e in entries) else None,
    )


def _read_100(entry: Mapping[str, Any], kind: str) -> Encoding:
    if str(entry.get("dtype", "INT")).upper() == "FLOAT":
        return Encoding(f"float{int(entry['bw'])}", kind=kind)
    enc_type = str(entry.get("enc_type", "PER_TENSOR")).upper()
    if enc_type not in ("PER_TENSOR", "PER_CHANNEL", "PER_BLOCK"):
        raise EncodingsError(
            f"tensor {entry.get('name')!r}: enc_type {enc_type} is not supported; "
            "use PER_TENSOR, PER_CHANNEL or PER_BLOCK"
        )
    return Encoding.from_offsets(
        int(entry["bw"]),
        _as_list(entry["scale"]),
        _as_list(entry["offset"]),
        _bool(entry.get("is_sym", False)),
        kind=kind,
        per_channel=enc_type == "PER_CHANNEL",
        block_size=int(entry["block_size"]) if entry.get("block_size") else None,
    )


def _read_200(entry: Mapping[str, Any]) -> Encoding:
    dtype = str(entry.get("output_dtype", "")).lower()
    if dtype in FLOAT_DTYPES:
        return Encoding(dtype)
    if dtype not in INTEGER_DTYPES:
        raise EncodingsError(f"tensor {entry.get('name')!r}: output_dtype {dtype!r} is not supported")
    scale = _as_list(entry["y_scale"])
    zero = _as_list(entry.get("y_zero_point", [0] * len(scale)))
    return Encoding(
        dtype,
        tuple(float(s) for s in scale),
        tuple(int(z) for z in zero),
        symmetric=all(z == 0 for z in zero) and INTEGER_DTYPES[dtype][1],
        axis=int(entry["axis"]) if entry.get("axis") is not None else None,
        block_size=int(entry["block_size"]) if entry.get("block_size") else None,
    )


def parse_encodings(raw: Mapping[str, Any], source: str = "<encodings>") -> EncodingSet:
    """The internal model of an AIMET encodings document of any supported version."""
    if not isinstance(raw, Mapping):
        raise EncodingsError(f"{source}: an encodings file is a JSON object")
    version = str(raw.get("version", "0.6.1"))
    extras = {
        k: v for k, v in raw.items() if k not in ("version", "activation_encodings", "param_encodings", "encodings")
    }
    result = EncodingSet(version=version, extras=extras)
    try:
        if version.startswith("2."):
            for entry in raw.get("encodings", []):
                result.tensors[str(entry["name"])] = _read_200(entry)
        elif version.startswith("1."):
            for kind, key in (("activation", "activation_encodings"), ("param", "param_encodings")):
                for entry in raw.get(key, []):
                    result.tensors[str(entry["name"])] = _read_100(entry, kind)
        elif version.startswith("0."):
            for kind, key in (("activation", "activation_encodings"), ("param", "param_encodings")):
                for name, entries in dict(raw.get(key, {})).items():
                    result.tensors[str(name)] = _read_061(entries, kind)
        else:
            raise EncodingsError(f"{source}: encodings version {version} is not supported; use one of {VERSIONS}")
    except EncodingsError as exc:
        raise EncodingsError(f"{source}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise EncodingsError(f"{source}: not an AIMET {version} encodings file ({type(exc).__name__}: {exc})") from None
    result.version = version
    return result


def read_json_file(path: Path, what: str, error: type[QuiverError] = EncodingsError) -> Any:
    """A JSON document, or `error` saying the file is missing or unreadable as a `what` file."""
    if not Path(path).exists():
        raise error(f"{path}: no such {what} file")
    try:
        return json.loads(read_text(path, what=f"{what} file"))
    except (FileAccessError, ValueError, RecursionError) as exc:  # ValueError: JSON, or an integer too long
        raise error(f"{path}: not a readable JSON {what} file ({exc})") from None


def load_encodings(path: str | Path) -> EncodingSet:
    path = Path(path)
    return parse_encodings(read_json_file(path, "encodings"), str(path))


# --- writing ---------------------------------------------------------------------------------------


def _write_061(encoding: Encoding) -> list[dict[str, Any]]:
    if encoding.is_float:
        return [{"bitwidth": encoding.bitwidth, "dtype": "float"}]
    entries = []
    levels = (1 << encoding.bitwidth) - 1
    for i, (scale, offset) in enumerate(zip(encoding.scale, encoding.offsets)):
        low = encoding.minimum[i] if encoding.minimum else scale * offset
        high = encoding.maximum[i] if encoding.maximum else scale * (levels + offset)
        entries.append(
            {
                "bitwidth": encoding.bitwidth,
                "dtype": "int",
                "is_symmetric": str(encoding.symmetric),
                "max": high,
                "min": low,
                "offset": offset,
                "scale": scale,
            }
        )
    return entries


def _write_100(name: str, encoding: Encoding) -> dict[str, Any]:
    if encoding.is_float:
        return {"name": name, "dtype": "FLOAT", "enc_type": "PER_TENSOR", "bw": encoding.bitwidth}
    entry: dict[str, Any] = {
        "name": name,
        "dtype": "INT",
        "enc_type": encoding.granularity.upper(),
        "is_sym": encoding.symmetric,
        "bw": encoding.bitwidth,
        "scale": list(encoding.scale),
        "offset": list(encoding.offsets),
    }
    if encoding.block_size:
        entry["block_size"] = encoding.block_size
    return entry


def _write_200(name: str, encoding: Encoding) -> dict[str, Any]:
    if encoding.is_float:
        return {"name": name, "output_dtype": encoding.dtype}
    per_tensor = encoding.granularity == "per_tensor" and len(encoding.scale) == 1
    entry: dict[str, Any] = {
        "name": name,
        "output_dtype": encoding.dtype,
        "y_scale": encoding.scale[0] if per_tensor else list(encoding.scale),
    }
    if any(encoding.zero_point):
        entry["y_zero_point"] = encoding.zero_point[0] if per_tensor else list(encoding.zero_point)
    if encoding.axis is not None:
        entry["axis"] = encoding.axis
    if encoding.block_size:
        entry["block_size"] = encoding.block_size
    return entry


def to_document(encodings: EncodingSet, version: str | None = None) -> dict[str, Any]:
    """The AIMET JSON document of `encodings` in `version` (default: the version it was read in)."""
    version = version or encodings.version
    params, activations = encodings.params(), encodings.activations()
    if version == "2.0.0":
        return {
            "version": version,
            "encodings": [_write_200(n, e) for n, e in encodings.tensors.items()],
            **encodings.extras,
        }
    if version == "1.0.0":
        return {
            "version": version,
            "activation_encodings": [_write_100(n, e) for n, e in activations.items()],
            "param_encodings": [_write_100(n, e) for n, e in params.items()],
            **encodings.extras,
        }
    if version == "0.6.1":
        if any(e.block_size for e in encodings.tensors.values()):
            raise EncodingsError("AIMET 0.6.1 has no per-block encodings; write 1.0.0 or 2.0.0")
        return {
            "version": version,
            "activation_encodings": {n: _write_061(e) for n, e in activations.items()},
            "param_encodings": {n: _write_061(e) for n, e in params.items()},
            **encodings.extras,
        }
    raise EncodingsError(f"encodings version {version} is not supported; use one of {VERSIONS}")


def save_encodings(encodings: EncodingSet, path: str | Path, version: str | None = None) -> Path:
    path = Path(path)
    write_atomically(path, json.dumps(to_document(encodings, version), indent=2).encode())
    return path

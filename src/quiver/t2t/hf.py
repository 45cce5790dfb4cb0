"""Reads a transformers causal-LM folder (config.json, safetensors, tokenizer.json) without torch."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from quiver.errors import ModelFolderError
from quiver.formats.files import open_regular, read_text

# transformers class -> what differs from Llama. Every entry: RMSNorm, SiLU-gated MLP, rotary positions
# (half-split, not interleaved), grouped-query attention.
ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": False},
    "MistralForCausalLM": {"qkv_bias": False},
    "Qwen2ForCausalLM": {"qkv_bias": True},
}
_SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
}


@dataclass(frozen=True)
class DecoderConfig:
    """What the graph builder needs from config.json."""

    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


def _int(raw: dict[str, Any], key: str, source: Path, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelFolderError(f"{source}: {key!r} must be a positive integer, not {value!r}")
    return value


def token_ids(value: Any) -> tuple[int, ...]:
    """The token ids of a config value (an id or a list of them); anything else is left out."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def read_config(folder: Path) -> DecoderConfig:
    """The decoder's shape from `folder/config.json`; a clear error for any other kind of model."""
    source = folder / "config.json"
    if not folder.is_dir() or not source.is_file():
        what = "has no config.json" if folder.is_dir() else "is not a folder"
        raise ModelFolderError(f"{folder} {what}; give a transformers model folder (config.json, *.safetensors)")
    try:
        raw = json.loads(read_text(source, limit=1 << 20, what="config.json"))
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{source}: not a readable transformers config ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{source}: must hold a JSON object")
    names = raw.get("architectures") or []
    architecture = next((n for n in names if n in ARCHITECTURES), None)
    if architecture is None:
        raise ModelFolderError(
            f"{folder} holds {names or 'a model without architectures'}, not a causal LM Quiver exports; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    heads = _int(raw, "num_attention_heads", source)
    hidden = _int(raw, "hidden_size", source)
    kv_heads = _int(raw, "num_key_value_heads", source, heads)
    head_dim = raw.get("head_dim") or hidden // heads
    if heads % kv_heads or not isinstance(head_dim, int) or head_dim % 2:
        raise ModelFolderError(
            f"{source}: {heads} heads, {kv_heads} key/value heads and head_dim {head_dim} do not fit"
        )
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ("default", "llama3"):
        raise ModelFolderError(f"{source}: rotary scaling {rope_type!r} is not supported (default and llama3 are)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelFolderError(f"{source}: activation {raw.get('hidden_act')!r}; Quiver's decoders use silu")
    eps = raw.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or not 0 < eps < 1 or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelFolderError(f"{source}: rms_norm_eps {eps!r} or rope_theta {theta!r} is out of range")
    return DecoderConfig(
        architecture=architecture,
        hidden=hidden,
        layers=_int(raw, "num_hidden_layers", source),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=_int(raw, "intermediate_size", source),
        vocab=_int(raw, "vocab_size", source),
        rms_eps=float(eps),
        rope_theta=float(theta),
        rope_scaling=dict(rope) if rope_type == "llama3" else None,
        max_positions=_int(raw, "max_position_embeddings", source, 4096),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", ARCHITECTURES[architecture]["qkv_bias"])),
        bos_token_id=next(iter(token_ids(raw.get("bos_token_id"))), None),
        eos_token_ids=token_ids(raw.get("eos_token_id")),
        pad_token_id=next(iter(token_ids(raw.get("pad_token_id"))), None),
    )


def rotary_tables(config: DecoderConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] as transformers computes them (llama3 frequency scaling too)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is not None:
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        inv_freq = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    inv_freq = inv_freq.astype(np.float32)  # transformers keeps inv_freq in float32
    angles = np.outer(np.arange(positions, dtype=np.float32), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class SafetensorsWeights:
    """Every tensor of a folder's *.safetensors files as float32, read on demand (bf16 and f16 converted)."""

    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelFolderError(f"{folder} has no *.safetensors weights; save the model with safe_serialization")
        self._where: dict[str, tuple[Path, str, list[int], int, int]] = {}
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

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ModelFolderError(f"the weights have no tensor {name!r}; is this a {', '.join(ARCHITECTURES)} folder?")
        path, dtype, shape, start, end = self._where[name]
        with open_regular(path) as f:
            f.seek(start)
            data = f.read(end - start)
        return np.frombuffer(data, _SAFETENSORS_DTYPES[dtype]).reshape(shape).astype(np.float32)

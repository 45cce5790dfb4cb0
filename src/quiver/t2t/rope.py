"""Rotary position tables as transformers computes them: default, linear, dynamic, yarn, longrope, llama3; and
llama.cpp's frequencies divided by factors of its own (`divided`: a GGUF file's `rope_freqs`)."""

from __future__ import annotations

import math

import numpy as np

from quiver.errors import ModelFolderError
from quiver.t2t.families import Rope


def _is_finite_number(value: object) -> bool:
    """A JSON number (not a bool) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(rope: Rope, key: str, default: float | None = None) -> float:
    value = rope.params.get(key, default)
    if not _is_finite_number(value):
        raise ModelFolderError(f"rope type {rope.kind}: {key!r} must be a number, not {value!r}")
    return float(value)


def _optional_number(rope: Rope, key: str) -> float | None:
    """The rope's number at `key`, None where it is absent or null (transformers' default applies)."""
    return None if rope.params.get(key) is None else _number(rope, key)


def inverse_frequencies(rope: Rope, positions: int, max_positions: int) -> tuple[np.ndarray, float]:
    """The rope's inverse frequencies [dim / 2] for a cache of `positions`, and the factor its cos and sin
    are scaled by (yarn's and longrope's attention factor; 1 otherwise)."""
    dim = rope.dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    base = (1.0 / (rope.theta ** exponents.astype(np.float64))).astype(np.float32)
    scale = 1.0
    if rope.kind == "linear":
        base = base / np.float32(_number(rope, "factor"))
    elif rope.kind == "dynamic":
        # transformers scales only once a sequence outgrows the original length: within it, the default
        original = int(_number(rope, "original_max_position_embeddings", max_positions))
        if positions > original:
            raise ModelFolderError(f"dynamic rope scaling past {original} positions: give --context-size {original} "
                                   "or less")  # fmt: skip
    elif rope.kind == "llama3":
        base = _llama3(rope, base)
    elif rope.kind == "divided":  # as llama.cpp: theta_i = position * base_i / factor_i
        base = (base / np.asarray(rope.params["divisors"], np.float32)).astype(np.float32)
    elif rope.kind == "yarn":
        base, scale = _yarn(rope, dim, max_positions)
    elif rope.kind == "longrope":
        base, scale = _longrope(rope, exponents, positions, max_positions)
    return base, scale


def _llama3(rope: Rope, inv_freq: np.ndarray) -> np.ndarray:
    factor = _number(rope, "factor")
    low, high = _number(rope, "low_freq_factor", 1.0), _number(rope, "high_freq_factor", 4.0)
    original = _number(rope, "original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq.astype(np.float64)
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled).astype(np.float32)


def _yarn(rope: Rope, dim: int, max_positions: int) -> tuple[np.ndarray, float]:
    original = _number(rope, "original_max_position_embeddings")
    factor = rope.params.get("factor")
    factor = max_positions / original if factor is None else _number(rope, "factor")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = _optional_number(rope, "attention_factor")
    if attention is None:
        m, m_all = _optional_number(rope, "mscale"), _optional_number(rope, "mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = _optional_number(rope, "beta_fast") or 32, _optional_number(rope, "beta_slow") or 1

    def correction(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction(fast), correction(slow)
    if rope.params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    frequencies = (rope.theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    extrapolation, interpolation = 1.0 / frequencies, 1.0 / (np.float32(factor) * frequencies)
    keep = 1 - ramp
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32), float(attention)


def _longrope(rope: Rope, exponents: np.ndarray, positions: int, max_positions: int) -> tuple[np.ndarray, float]:
    original = int(_number(rope, "original_max_position_embeddings"))
    if positions > original:
        # transformers switches every position to the long factors once a sequence passes the original
        # length, after earlier keys were cached with the short ones: a cache of that size has no one answer
        raise ModelFolderError(f"longrope past {original} positions: give --context-size {original} or less")
    short = rope.params.get("short_factor")
    if (
        not isinstance(short, list)
        or len(short) != len(exponents)
        or not all(_is_finite_number(v) and v > 0 for v in short)
    ):
        raise ModelFolderError(f"longrope: short_factor must list {len(exponents)} positive numbers")
    factor = rope.params.get("factor")
    factor = max_positions / original if factor is None else _number(rope, "factor")
    attention = _optional_number(rope, "attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(short, np.float32)
    return (1.0 / (ext * rope.theta**exponents)).astype(np.float32), float(attention)


def rotary_tables(rope: Rope, positions: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, rotary dims / 2], as ORT's attention takes them."""
    if (rope.dim // 2) % 8:
        raise ModelFolderError(f"{rope.dim} rotary dimensions per head: ONNX Runtime's attention rotates a multiple "
                               "of 16; Quiver cannot run this model's positions")  # fmt: skip
    inv_freq, scale = inverse_frequencies(rope, positions, max_positions)
    angles = np.outer(np.arange(positions, dtype=np.float32), inv_freq.astype(np.float32))
    cos, sin = np.cos(angles), np.sin(angles)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos.astype(np.float32), sin.astype(np.float32)

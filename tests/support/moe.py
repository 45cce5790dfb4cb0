"""The corpus's mixture-of-experts cases, and whether this onnxruntime runs them (ORT's MoE operator is
refused below 1.32: 1.24's gave other tokens)."""

from __future__ import annotations

from quiver.ort_package import onnxruntime

MOE = {"mixtral", "qwen2_moe", "qwen3_moe"}
MOE_TRUSTED = tuple(int(p) for p in onnxruntime.__version__.split(".")[:2]) >= (1, 32)

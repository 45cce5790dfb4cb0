"""What the tests and the benchmarks share about the wheel corpus (tests/real/make_wheel_models.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# model -> the size of each input it runs at (dims the model leaves open filled in as its users feed them)
MODELS: dict[str, dict[str, list[int]]] = {
    "ocr_det": {"x": [1, 3, 96, 128]},
    "ocr_rec": {"x": [2, 3, 48, 192]},
    "ocr_cls": {"x": [5, 3, 48, 192]},
    "yolov8n": {"images": [1, 3, 320, 320]},
    "vad": {"input": [1, 512], "state": [2, 1, 128], "sr": []},
    "vad_sequence": {"input": [3, 576], "h": [1, 1, 128], "c": [1, 1, 128]},
    "captcha": {"input1": [1, 1, 64, 160]},
    "captcha_dynamic": {"input1": [1, 1, 64, 160]},
}
_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64}


def feeds(name: str, inputs: Sequence[Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for a model, typed as its `get_inputs()` says (silero-vad's sample rate: 16 kHz)."""
    rng = np.random.default_rng(seed)
    made = {}
    for arg in inputs:
        input_name, dtype = arg.name, _DTYPES[arg.type]
        shape = MODELS[name][input_name]
        made[input_name] = np.array(16000, dtype) if input_name == "sr" else rng.random(shape).astype(dtype)
    return made

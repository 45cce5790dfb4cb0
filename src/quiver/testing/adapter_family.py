"""More PEFT adapters like a real one (for tests and benchmarks of many adapters at once): same modules,
ranks and scale, other seeded weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def reseeded_adapters(source: Path, out: Path, count: int, prefix: str = "reseeded") -> dict[str, Path]:
    """`count` PEFT folders `<prefix>_<i>` in `out`, each the `source` adapter's config with new weights:
    every tensor drawn from a normal distribution with the mean and spread of the source's (seed i)."""
    tensors = load_file(str(source / _WEIGHTS))
    folders: dict[str, Path] = {}
    for index in range(count):
        rng = np.random.default_rng(index)
        folder = out / f"{prefix}_{index}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / _CONFIG, folder / _CONFIG)
        drawn = {
            name: (rng.standard_normal(t.shape) * float(t.std()) + float(t.mean())).astype(t.dtype)
            for name, t in sorted(tensors.items())
        }
        save_file(drawn, str(folder / _WEIGHTS))
        folders[folder.name] = folder
    return folders

"""Shared fixtures: a small seeded transformer family, saved as ONNX files and built into a context."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import quiver
from quiver.testing.family import SMALL, make_family, sample_input_ids


@pytest.fixture(scope="session")
def family() -> dict[str, onnx.ModelProto]:
    return make_family(SMALL, count=3, tuned_layers=1, seed=7)


@pytest.fixture(scope="session")
def family_files(family: dict[str, onnx.ModelProto], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("family")
    paths = {}
    for name, model in family.items():
        paths[name] = folder / f"{name}.onnx"
        onnx.save(model, str(paths[name]))
    return paths


@pytest.fixture(scope="session")
def family_context(family: dict[str, onnx.ModelProto], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ctx") / "family.qctx"
    context = quiver.Context.create("cpu")
    for name, model in family.items():
        context.add_graph(name, model)
    context.save(path)
    context.close()
    return path


@pytest.fixture
def input_ids() -> np.ndarray:
    return sample_input_ids(SMALL, batch=2, seq=12, seed=3)


def _corpus(variable: str, kind: str) -> Path:
    """A real-model corpus: exported once per machine and cached.

    The variable names the folder (CI sets it); otherwise ci/make-real-models exports it into the cache
    on first use, which installs torch into a venv of its own and takes a few minutes.
    """
    import os
    import subprocess

    folder = os.environ.get(variable)
    if not folder:
        script = Path(__file__).resolve().parents[1] / "ci" / "make-real-models"
        result = subprocess.run(["bash", str(script), kind], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"exporting the real-model corpus failed:\n{result.stderr[-3000:]}")
        folder = result.stdout.strip().splitlines()[-1]
    path = Path(folder)
    if not (path / "versions.json").is_file():
        pytest.fail(f"no real-model corpus in {path}: run `bash ci/make-real-models {kind}`")
    return path


@pytest.fixture(scope="session")
def real_models() -> Path:
    """tests/real/make_models.py's corpus: torch.onnx exports of real encoders and a decoder."""
    return _corpus("QUIVER_REAL_MODELS", "models")


@pytest.fixture(scope="session")
def real_llms() -> Path:
    """tests/real/make_llms.py's corpus: transformers folders, PEFT adapters and their generations."""
    return _corpus("QUIVER_REAL_LLMS", "llms")


@pytest.fixture(scope="session")
def real_families() -> Path:
    """tests/real/make_families.py's corpus: tiny decoders of every family and transformers' greedy tokens."""
    return _corpus("QUIVER_REAL_FAMILIES", "families")


@pytest.fixture(scope="session")
def real_templates() -> Path:
    """tests/real/make_templates.py's corpus: real models' chat templates and transformers' renderings."""
    return _corpus("QUIVER_REAL_TEMPLATES", "templates")


@pytest.fixture(scope="session")
def real_wheel_models() -> Path:
    """tests/real/make_wheel_models.py's corpus: the ONNX models OCR, detection and audio wheels ship."""
    return _corpus("QUIVER_REAL_WHEEL_MODELS", "wheels")


@pytest.fixture(autouse=True, scope="session")
def _contexts_kept_in_a_folder_of_this_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    """quiver.ort keeps the contexts it builds (`quiver.ort.context_cache`): in this run's own folder, not
    the user's cache (subprocesses inherit it)."""
    import os

    os.environ["QUIVER_ORT_CACHE"] = str(tmp_path_factory.mktemp("ort-contexts"))


LAYERS = ("unit", "integration", "stress", "fuzz")  # the folders under tests/, each its own marker


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test carries its layer's marker: `pytest -m unit` runs the fast layer alone."""
    for item in items:
        layer = Path(str(item.fspath)).parent.name
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))

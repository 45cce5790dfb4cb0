"""quiver.ort keeps the contexts it builds: a later session over the same model maps one, a changed model
is built again, the folder stays within its limit, and `QUIVER_ORT_CACHE=off` keeps nothing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

import quiver.ort
from quiver.runtime.context import Context


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "kept"
    monkeypatch.setenv("QUIVER_ORT_CACHE", str(folder))
    return folder


def _builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the contexts quiver.ort builds from now on."""
    made: list[int] = []
    create = Context.create.__func__  # type: ignore[attr-defined]

    def counting(cls: type[Context], *args: object, **kwargs: object) -> Context:
        made.append(1)
        return create(cls, *args, **kwargs)

    monkeypatch.setattr(Context, "create", classmethod(counting))
    return made


def _run(path: Path, ids: np.ndarray) -> np.ndarray:
    session = quiver.ort.InferenceSession(str(path))
    output = session.run(None, {"input_ids": ids})[0]
    session.close()
    return output


def _scaled(source: Path, target: Path, factor: float) -> Path:
    model = onnx.load(str(source))
    for index, tensor in enumerate(model.graph.initializer):
        value = numpy_helper.to_array(tensor)
        if value.dtype == np.float32 and value.size > 1:
            scaled = (value * factor).astype(np.float32)
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(scaled, tensor.name))
    onnx.save(model, str(target))
    return target


def _ort(path: Path, ids: np.ndarray) -> np.ndarray:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]


def test_a_second_session_over_the_same_model_maps_the_kept_context(
    family_files: dict[str, Path], kept: Path, input_ids: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = _builds(monkeypatch)
    first = _run(family_files["base"], input_ids)
    second = _run(family_files["base"], input_ids)
    assert len(builds) == 1 and len(list(kept.glob("*.qctx"))) == 1
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(second, _ort(family_files["base"], input_ids), atol=1e-5)


def test_a_model_rewritten_in_place_is_built_again(
    family_files: dict[str, Path], kept: Path, tmp_path: Path, input_ids: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _scaled(family_files["base"], tmp_path / "model.onnx", 1.0)
    before = _run(model, input_ids)
    _scaled(family_files["base"], model, 0.5)  # the same path and size, other weights
    builds = _builds(monkeypatch)
    after = _run(model, input_ids)
    assert len(builds) == 1
    np.testing.assert_allclose(after, _ort(model, input_ids), atol=1e-5)
    assert not np.allclose(before, after, atol=1e-3)


def test_a_damaged_kept_context_is_built_again(
    family_files: dict[str, Path], kept: Path, input_ids: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(family_files["base"], input_ids)
    (file,) = kept.glob("*.qctx")
    damaged = file.with_suffix(".damaged")
    damaged.write_bytes(file.read_bytes()[:-100])  # truncated (as no writer of Quiver's leaves one)
    os.replace(damaged, file)  # replaced, never rewritten in place: a process may still map the old one
    builds = _builds(monkeypatch)
    np.testing.assert_allclose(_run(family_files["base"], input_ids), _ort(family_files["base"], input_ids), atol=1e-5)
    assert len(builds) == 1


def test_the_least_recently_used_contexts_go_beyond_the_limit(
    family_files: dict[str, Path], kept: Path, input_ids: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUIVER_ORT_CACHE_MB", "0")
    _run(family_files["base"], input_ids)
    _run(family_files["finetune_1"], input_ids)
    assert len(list(kept.glob("*.qctx"))) == 1  # the newest only: the one a session maps now


def test_off_keeps_nothing(
    family_files: dict[str, Path], tmp_path: Path, input_ids: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUIVER_ORT_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    builds = _builds(monkeypatch)
    _run(family_files["base"], input_ids)
    _run(family_files["base"], input_ids)
    assert len(builds) == 2 and not (tmp_path / "home-cache").exists()

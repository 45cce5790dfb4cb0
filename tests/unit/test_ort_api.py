"""`quiver.ort`: code written for onnxruntime, run with the import swapped, against onnxruntime itself."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper

import quiver
import quiver.ort
from quiver.backends import CpuBackend, register_backend
from quiver.backends import base as backends_base
from quiver.errors import BackendError
from quiver.ort import provider
from quiver.ort.engine_quiver import SHARED_CONTEXTS
from quiver.testing.family import SMALL, sample_input_ids
from tests.support import FIXTURES  # noqa: E402
from tests.support.cli import quiver as run_cli
from tests.support.helpers import sequence_input_model
from tests.support.peft_models import LORA_X as X
from tests.support.peft_models import make_project

TORCH_EXPORTS = [FIXTURES / "torch_base.onnx", FIXTURES / "llama" / "model.onnx"]


def _feeds(session: Any) -> dict[str, np.ndarray]:
    """Inputs for a session, built only from what get_inputs() reports (as user code does)."""
    feeds = {}
    for arg in session.get_inputs():
        shape = [d if isinstance(d, int) else 8 for d in arg.shape]
        assert arg.type == "tensor(int64)"
        feeds[arg.name] = np.random.default_rng(0).integers(0, 100, shape).astype(np.int64)
    return feeds


def _typical_program(ort: Any, model: Path) -> tuple[list, list, list[np.ndarray], Any]:
    """The usage patterns of ONNX Runtime's Python docs, written against the module `ort`."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 2
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(model), sess_options=options, providers=ort.get_available_providers())
    inputs = [(a.name, a.shape, a.type) for a in session.get_inputs()]
    outputs = [(a.name, a.shape, a.type) for a in session.get_outputs()]
    feeds = _feeds(session)
    run_options = ort.RunOptions()
    run_options.log_severity_level = 3
    first = session.run([session.get_outputs()[0].name], feeds, run_options)
    every = session.run(None, feeds)
    from_bytes = ort.InferenceSession(model.read_bytes() if not Path(str(model) + ".data").exists() else str(model))
    again = from_bytes.run(None, feeds)
    return inputs, outputs, [first[0], every[0], again[0]], session


@pytest.mark.parametrize("model", TORCH_EXPORTS, ids=lambda p: p.parent.name + "/" + p.name)
def test_onnxruntime_code_runs_unchanged_with_the_import_swapped(model: Path) -> None:
    theirs = _typical_program(onnxruntime, model)
    ours = _typical_program(quiver.ort, model)
    assert ours[0] == theirs[0] and ours[1] == theirs[1]  # get_inputs() / get_outputs(): names, shapes, types
    for a, b in zip(ours[2], theirs[2]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    session = ours[3]
    assert session.get_providers()[0] == "QuiverExecutionProvider"
    assert session.get_modelmeta().graph_name == onnx.load(str(model), load_external_data=False).graph.name
    assert isinstance(session.get_session_options(), quiver.ort.SessionOptions)


def test_errors_have_onnxruntime_names_and_are_quiver_errors(tmp_path: Path) -> None:
    model = TORCH_EXPORTS[0]
    session = quiver.ort.InferenceSession(str(model))
    ids = np.zeros((1, 4), np.int64)
    with pytest.raises(quiver.ort.InvalidArgument):
        session.run(None, {"input_ids": ids.astype(np.float32)})  # ORT: INVALID_ARGUMENT too
    with pytest.raises(ValueError, match="Required inputs"):  # ORT checks that in Python: ValueError
        session.run(None, {"not_an_input": ids})
    with pytest.raises(quiver.ort.InvalidArgument, match="invalid output name"):
        session.run(["nope"], {"input_ids": ids})
    with pytest.raises(quiver.ort.NoSuchFile):
        quiver.ort.InferenceSession(str(tmp_path / "missing.onnx"))
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07not a model")
    with pytest.raises(quiver.ort.InvalidProtobuf):
        quiver.ort.InferenceSession(str(tmp_path / "junk.onnx"))
    for error in (quiver.ort.InvalidArgument, quiver.ort.NoSuchFile, quiver.ort.EngineError, quiver.ort.Fail):
        assert issubclass(error, quiver.QuiverError)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quiver.testing.family import build_model, family_weights

    folder = tmp_path_factory.mktemp("ort")
    onnx.save(build_model(SMALL, family_weights(SMALL, seed=4), "small"), folder / "small.onnx")
    return folder / "small.onnx"


def _ep_node(path: Path) -> dict[str, Any]:
    model = onnx.load(str(path))
    (node,) = model.graph.node
    assert (node.op_type, node.domain) == ("EPContext", "com.microsoft")
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("embed", ["0", "1"])
def test_context_cache_writes_an_ep_context_model_that_reopens(small_model: Path, tmp_path: Path, embed: str) -> None:
    source = tmp_path / "model.onnx"
    source.write_bytes(small_model.read_bytes())
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("ep.context_enable", "1")
    options.add_session_config_entry("ep.context_embed_mode", embed)
    first = quiver.ort.InferenceSession(str(source), options)
    ids = {"input_ids": sample_input_ids(SMALL, 1, 12, seed=3)}
    expected = onnxruntime.InferenceSession(str(source)).run(None, ids)[0]
    np.testing.assert_allclose(first.run(None, ids)[0], expected, atol=1e-5)
    cached = tmp_path / "model_ctx.onnx"
    attributes = _ep_node(cached)
    assert attributes["source"] == b"Quiver" and attributes["main_context"] == 1
    assert attributes["embed_mode"] == int(embed) and attributes["partition_name"]
    assert "ep_sdk_version" in attributes
    if embed == "0":
        assert attributes["ep_cache_context"] == b"model_ctx.qctx" and (tmp_path / "model_ctx.qctx").is_file()
    else:
        assert attributes["ep_cache_context"][:4] == b"QCTX" and not (tmp_path / "model_ctx.qctx").exists()
    reopened = quiver.ort.InferenceSession(str(cached))
    theirs = onnxruntime.InferenceSession(str(source))
    assert [(a.name, a.shape, a.type) for a in reopened.get_inputs()] == [
        (a.name, a.shape, a.type) for a in theirs.get_inputs()
    ]
    np.testing.assert_allclose(reopened.run(None, ids)[0], first.run(None, ids)[0], atol=1e-5)


def test_an_ep_context_path_may_not_leave_the_models_folder(small_model: Path, tmp_path: Path) -> None:
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("ep.context_enable", "1")
    options.add_session_config_entry("ep.context_file_path", str(tmp_path / "inner" / "m_ctx.onnx"))
    quiver.ort.InferenceSession(str(small_model), options)
    model = onnx.load(str(tmp_path / "inner" / "m_ctx.onnx"))
    for escaping in (b"../m_ctx.qctx", str(tmp_path / "inner" / "m_ctx.qctx").encode()):
        for attribute in model.graph.node[0].attribute:
            if attribute.name == "ep_cache_context":
                attribute.s = escaping
        onnx.save(model, str(tmp_path / "inner" / "evil_ctx.onnx"))
        with pytest.raises(quiver.ort.InvalidGraph, match="leaves the model's folder"):
            quiver.ort.InferenceSession(str(tmp_path / "inner" / "evil_ctx.onnx"))


def test_unknown_options_htp_and_snapdragon_only_options(small_model: Path) -> None:
    with pytest.raises(quiver.ort.InvalidArgument, match="valid options are .*backend_type"):
        quiver.ort.InferenceSession(str(small_model), providers=[("QuiverExecutionProvider", {"bogus": "1"})])
    with pytest.raises(quiver.ort.InvalidArgument, match="QNN's backend types are .*htp.*Quiver's backends"):
        quiver.ort.InferenceSession(str(small_model), providers=[("QNNExecutionProvider", {"backend_type": "npu"})])
    with pytest.warns(UserWarning, match="vtcm_mb tunes Snapdragon hardware"):
        session = quiver.ort.InferenceSession(
            str(small_model), providers=[("QNNExecutionProvider", {"backend_type": "cpu", "vtcm_mb": "8"})]
        )
    assert session.get_provider_options()["QuiverExecutionProvider"]["vtcm_mb"] == "8"
    with pytest.raises(quiver.ort.InvalidArgument, match="htp_performance_mode='turbo'"):
        quiver.ort.InferenceSession(str(small_model), providers=[("QuiverExecutionProvider",
                                                                  {"htp_performance_mode": "turbo"})])  # fmt: skip


QNN_EP_BACKENDS = [  # as QNN EP code names its backend, on Windows and Linux
    {"backend_path": "QnnHtp.dll"},
    {"backend_path": "libQnnHtp.so"},
    {"backend_path": "C:\\Qualcomm\\lib\\QnnHtp.dll"},
    {"backend_path": "/opt/qcom/aistack/lib/libQnnHtp.so"},
    {"backend_path": "libQnnGpu.so"},
    {"backend_path": "QnnCpu.dll"},
    {"backend_type": "htp"},
    {"backend_type": "gpu"},
    {"backend_type": "cpu"},
    {"backend_type": "htp", "htp_performance_mode": "burst", "enable_htp_fp16_precision": "1"},
]


@pytest.mark.parametrize("options", QNN_EP_BACKENDS)
def test_qnn_ep_code_naming_any_backend_runs_unchanged_with_at_most_one_warning(
    small_model: Path, options: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(provider, "_WARNED", set())  # once per process: this test's process starts afresh
    ids = {"input_ids": sample_input_ids(SMALL, 1, 6, seed=2)}
    expected = onnxruntime.InferenceSession(str(small_model)).run(None, ids)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = quiver.ort.InferenceSession(
            str(small_model), providers=["QNNExecutionProvider"], provider_options=[options]
        )
        got = session.run(None, ids)[0]
    hardware = "cpu" not in str(options).lower()
    assert len(caught) == (1 if hardware else 0), [str(w.message) for w in caught]
    if hardware:
        assert "running on Quiver's cpu backend" in str(caught[0].message)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_backend_type_and_backend_path_together_fail_as_in_onnxruntime(small_model: Path) -> None:
    with pytest.raises(quiver.ort.Fail, match="Only one of 'backend_type' and 'backend_path' should be set"):
        quiver.ort.InferenceSession(str(small_model), providers=[
            ("QNNExecutionProvider", {"backend_type": "htp", "backend_path": "libQnnHtp.so"})])  # fmt: skip


def test_the_saver_backend_records_the_model_and_each_run_for_replay(small_model: Path, tmp_path: Path) -> None:
    from quiver.ort.saver import recorded_runs

    options = {"backend_type": "saver", "qnn_saver_path": str(tmp_path / "saved")}
    session = quiver.ort.InferenceSession(str(small_model), providers=[("QNNExecutionProvider", options)])
    runs = [{"input_ids": sample_input_ids(SMALL, 1, 6, seed=seed)} for seed in (3, 4)]
    results = [session.run(None, feeds)[0] for feeds in runs]
    (folder,) = (tmp_path / "saved").iterdir()
    replay = onnxruntime.InferenceSession(str(folder / "model.onnx"))
    recorded = list(recorded_runs(folder))
    assert len(recorded) == 2
    for (inputs, outputs), fed, got in zip(recorded, runs, results):
        np.testing.assert_array_equal(inputs["input_ids"], fed["input_ids"])
        name = session.get_outputs()[0].name
        np.testing.assert_array_equal(outputs[name], got)
        np.testing.assert_allclose(replay.run([name], inputs)[0], got, rtol=1e-5, atol=1e-5)


def test_a_saver_library_path_records_where_qnn_saver_does(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    session = quiver.ort.InferenceSession(str(small_model), providers=[("QNNExecutionProvider", {
        "backend_path": "libQnnHtp.so", "qnn_saver_path": "/opt/qcom/lib/libQnnSaver.so"})])  # fmt: skip
    session.run(None, {"input_ids": sample_input_ids(SMALL, 1, 6, seed=5)})
    (folder,) = (tmp_path / "saver_output").iterdir()
    assert (folder / "model.onnx").is_file() and len(list(folder.glob("run-*.npz"))) == 2


def test_reference_backend_and_performance_modes(small_model: Path) -> None:
    ids = {"input_ids": sample_input_ids(SMALL, 1, 6, seed=1)}
    expected = onnxruntime.InferenceSession(str(small_model)).run(None, ids)[0]
    reference = quiver.ort.InferenceSession(str(small_model), providers=[("QuiverExecutionProvider",
                                                                          {"backend_type": "reference"})])  # fmt: skip
    np.testing.assert_allclose(reference.run(None, ids)[0], expected, atol=1e-4)
    saver = quiver.ort.InferenceSession(
        str(small_model), providers=[("QuiverExecutionProvider", {"htp_performance_mode": "power_saver"})]
    )
    assert saver.engine.backend.intra_op_num_threads == 1 and not saver.engine.backend.allow_spinning
    np.testing.assert_allclose(saver.run(None, ids)[0], expected, atol=1e-4)
    burst = quiver.ort.InferenceSession(str(small_model), providers=[("QuiverExecutionProvider",
                                                                      {"htp_performance_mode": "burst"})])  # fmt: skip
    assert burst.engine.backend.intra_op_num_threads == 0 and burst.engine.backend.allow_spinning
    low = quiver.ort.InferenceSession(str(small_model), providers=[("QuiverExecutionProvider", {
        "htp_performance_mode": "burst", "qnn_context_priority": "low"})])  # fmt: skip
    assert not low.engine.backend.allow_spinning  # a low-priority context yields its cores
    np.testing.assert_allclose(low.run(None, ids)[0], expected, atol=1e-4)


@pytest.mark.parametrize("level", ["basic", "detailed"])
def test_profiling_writes_a_csv(small_model: Path, tmp_path: Path, level: str) -> None:
    target = tmp_path / f"{level}.csv"
    session = quiver.ort.InferenceSession(str(small_model), providers=[
        ("QuiverExecutionProvider", {"profiling_level": level, "profiling_file_path": str(target)})])  # fmt: skip
    ids = {"input_ids": sample_input_ids(SMALL, 1, 6, seed=1)}
    for _ in range(3):
        session.run(None, ids)
    assert session.end_profiling() == str(target)
    rows = list(csv.DictReader(target.open()))
    runs = [r for r in rows if not r["node"]]
    assert [r["run"] for r in runs] == ["1", "2", "3"] and all(float(r["duration_us"]) > 0 for r in runs)
    nodes = [r for r in rows if r["node"]]
    if level == "detailed":
        assert {r["op_type"] for r in nodes} >= {"MatMul", "LayerNormalization"}
        assert {r["run"] for r in nodes} == {"1", "2", "3"}
    else:
        assert not nodes


def test_cpu_fallback_and_disabling_it(tmp_path: Path) -> None:
    path = tmp_path / "sequence.onnx"  # a sequence fed from outside: Quiver's graphs take tensors only
    onnx.save(sequence_input_model(), str(path))
    fallback = quiver.ort.InferenceSession(str(path))
    assert fallback.get_providers() == ["CPUExecutionProvider"]
    path_taken = fallback.execution_path
    assert path_taken.engine == "onnxruntime" and "'s' is a sequence" in str(path_taken.reason)
    assert fallback.run(None, {"s": [np.zeros(2, np.float32)] * 3})[0] == 3
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    with pytest.raises(quiver.ort.NotImplemented, match="'s' is a sequence"):
        quiver.ort.InferenceSession(str(path), options)


class _FlakyBackend(CpuBackend):
    """The cpu backend whose device "restarts" after two runs, as an HTP subsystem restart would."""

    name = "flaky"
    runs = 0

    def prepare(self, graph: Any) -> Any:
        executable = super().prepare(graph)
        original = executable.run

        def run(*args: Any, **kwargs: Any) -> Any:
            _FlakyBackend.runs += 1
            if _FlakyBackend.runs == 3:
                raise BackendError("the device restarted")
            return original(*args, **kwargs)

        executable.run = run  # type: ignore[method-assign]
        return executable


def test_an_engine_error_is_recovered_by_a_new_session(small_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends_base, "_REGISTRY", dict(backends_base._REGISTRY))  # registered for this test only
    register_backend("flaky", _FlakyBackend)
    ids = {"input_ids": sample_input_ids(SMALL, 1, 6, seed=1)}
    providers = [("QuiverExecutionProvider", {"backend_type": "flaky"})]
    session = quiver.ort.InferenceSession(str(small_model), providers=providers)
    good = session.run(None, ids)[0]
    session.run(None, ids)
    with pytest.raises(quiver.ort.EngineError, match="create a new session"):
        session.run(None, ids)
    with pytest.raises(quiver.ort.EngineError):
        session.run(None, ids)  # the session stays unusable, as the QNN EP documents
    recreated = quiver.ort.InferenceSession(str(small_model), providers=providers)
    np.testing.assert_array_equal(recreated.run(None, ids)[0], good)


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA context (three use-case sections) wrapped by `quiver ort-wrap`, with a qnn.lora_config per case."""
    from quiver.lora.prepare import prepare

    project = make_project(tmp_path_factory.mktemp("ort_lora"))
    prepare(project / "lora.yaml", project / "out")
    result = run_cli("ort-wrap", project / "out" / "lora.qctx", "-o", project / "wrapped")
    assert result.returncode == 0, result.stderr
    for case in ("base", "elementary", "elementary_long"):
        (project / "wrapped" / f"{case}.lora").write_text(f"model;../out/{case}.qsec\n")
    return project


def test_lora_run_options_switch_adapters_like_apply_binary_section(wrapped: Path) -> None:
    session = quiver.ort.InferenceSession(str(wrapped / "wrapped" / "model_ctx.onnx"))
    direct = quiver.Context.from_binary(wrapped / "out" / "lora.qctx")
    for case in ("elementary", "base", "elementary_long", "elementary"):  # back and forth between runs
        options = quiver.ort.RunOptions()
        options.add_run_config_entry("qnn.lora_config", str(wrapped / "wrapped" / f"{case}.lora"))
        ours = session.run(None, {"x": X}, options)[0]
        direct.apply_binary_section("model", wrapped / "out" / f"{case}.qsec")
        np.testing.assert_allclose(ours, direct.graph("model").execute({"x": X})["y"], atol=1e-6, rtol=0)
    adapter = quiver.ort.LoraAdapter()
    adapter.Load(wrapped / "out" / "elementary_long.qsec")
    options = quiver.ort.RunOptions()
    options.add_active_adapter(adapter)
    direct.apply_binary_section("model", wrapped / "out" / "elementary_long.qsec")
    expected = direct.graph("model").execute({"x": X})["y"]
    np.testing.assert_allclose(session.run(None, {"x": X}, options)[0], expected, atol=1e-6, rtol=0)
    direct.close()


def test_sessions_over_one_wrapped_context_share_it(tmp_path: Path, small_model: Path) -> None:
    context = quiver.Context.create("cpu", workdir=tmp_path)
    for name in ("a", "b", "c", "d"):
        context.add_graph(name, small_model)
    context.save(tmp_path / "four.qctx")
    context.close()
    result = run_cli("ort-wrap", tmp_path / "four.qctx", "-o", tmp_path / "wrapped")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "wrapped").glob("*_ctx.onnx")) == [f"{g}_ctx.onnx" for g in "abcd"]
    assert [_ep_node(tmp_path / "wrapped" / f"{g}_ctx.onnx")["main_context"] for g in "abcd"] == [1, 0, 0, 0]
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("ep.share_ep_contexts", "1")
    sessions = [quiver.ort.InferenceSession(str(tmp_path / "wrapped" / f"{g}_ctx.onnx"), options) for g in "abcd"]
    # one store (weights mapped and packed once), one handle per session (adapters stay per session)
    contexts = [s.engine.context for s in sessions]
    assert len({id(c.file) for c in contexts}) == 1 and len({id(c) for c in contexts}) == 4
    key = sessions[0].engine.shared_key
    assert key is not None and SHARED_CONTEXTS.holds(key)
    ids = {"input_ids": sample_input_ids(SMALL, 1, 6, seed=2)}
    outputs = [s.run(None, ids)[0] for s in sessions]
    for output in outputs[1:]:
        np.testing.assert_allclose(output, outputs[0], atol=1e-5)  # four graphs of the same model
    for session in sessions:
        session.close()
    assert not SHARED_CONTEXTS.holds(key)
    separate = quiver.ort.InferenceSession(str(tmp_path / "wrapped" / "a_ctx.onnx"))  # without the option
    assert separate.engine.shared_key is None


def test_ort_wrap_refuses_a_damaged_context_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.qctx").write_bytes(b"not a context")
    result = run_cli("ort-wrap", tmp_path / "bad.qctx", "-o", tmp_path / "out")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quiver.ort.get_available_providers()[0] == "QuiverExecutionProvider"


def test_io_quantization_can_be_left_to_the_caller(small_model: Path, tmp_path: Path) -> None:
    from quiver.passes.qdq import QuantizeOptions, quantize

    samples = [{"input_ids": sample_input_ids(SMALL, 1, 8, seed=i)} for i in range(3)]
    qdq, encodings = quantize(onnx.load(str(small_model)), samples, QuantizeOptions(activation_bits=16))
    path = tmp_path / "qdq.onnx"
    onnx.save(qdq, str(path))
    floats = quiver.ort.InferenceSession(str(path))
    raw = quiver.ort.InferenceSession(str(path), providers=[("QuiverExecutionProvider",
                                                             {"offload_graph_io_quantization": "0"})])  # fmt: skip
    assert floats.get_outputs()[0].type == "tensor(float)" and raw.get_outputs()[0].type == "tensor(uint16)"
    ids = {"input_ids": samples[0]["input_ids"]}
    quantized = raw.run(None, ids)[0]
    encoding = encodings.tensors["last_hidden_state"]
    dequantized = (quantized.astype(np.float64) - encoding.zero_point[0]) * encoding.scale[0]  # ONNX's DQ formula
    np.testing.assert_allclose(dequantized, floats.run(None, ids)[0], atol=1e-6)


HTP = {"backend_path": "QnnHtp.dll"}  # as every QNN EP snippet of the documents names its backend


def _htp_session(path: Path, options: quiver.ort.SessionOptions | None = None, **more: str) -> Any:
    return quiver.ort.InferenceSession(str(path), sess_options=options, providers=["QNNExecutionProvider"],
                                       provider_options=[HTP | more])  # fmt: skip


def test_the_qnn_ep_documents_snippets_run_unchanged_each_with_at_most_one_warning(
    small_model: Path, wrapped: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = {"input_ids": sample_input_ids(SMALL, 1, 6, seed=6)}
    expected = onnxruntime.InferenceSession(str(small_model)).run(None, ids)[0]

    def profiling() -> None:
        session = _htp_session(small_model, profiling_level="detailed", profiling_file_path=str(tmp_path / "p.csv"))
        np.testing.assert_allclose(session.run(None, ids)[0], expected, rtol=1e-5, atol=1e-5)
        assert session.end_profiling() == str(tmp_path / "p.csv") and (tmp_path / "p.csv").stat().st_size > 0

    def ep_context() -> None:
        options = quiver.ort.SessionOptions()
        options.add_session_config_entry("ep.context_enable", "1")
        options.add_session_config_entry("ep.context_file_path", str(tmp_path / "model_ctx.onnx"))
        options.add_session_config_entry("ep.context_embed_mode", "0")  # the context beside it: sessions share it
        _htp_session(small_model, options)
        np.testing.assert_allclose(_htp_session(tmp_path / "model_ctx.onnx").run(None, ids)[0], expected, rtol=1e-5,
                                   atol=1e-5)  # fmt: skip

    def context_sharing() -> None:
        options = quiver.ort.SessionOptions()
        options.add_session_config_entry("ep.share_ep_contexts", "1")
        first, second = (_htp_session(tmp_path / "model_ctx.onnx", options) for _ in range(2))
        assert first.engine.shared_key is not None and first.engine.shared_key == second.engine.shared_key
        np.testing.assert_allclose(second.run(None, ids)[0], expected, rtol=1e-5, atol=1e-5)

    def lora_run_option() -> None:
        session = _htp_session(wrapped / "wrapped" / "model_ctx.onnx")
        options = quiver.ort.RunOptions()
        options.add_run_config_entry("qnn.lora_config", str(wrapped / "wrapped" / "elementary.lora"))
        session.run(None, {"x": X}, options)

    for snippet in (profiling, ep_context, context_sharing, lora_run_option):
        monkeypatch.setattr(provider, "_WARNED", set())  # each snippet as a program of its own
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            snippet()
        assert len(caught) <= 1, (snippet.__name__, [str(w.message) for w in caught])

"""`quiver.ort` has every public name of the installed onnxruntime, and behaves as ORT where users look:
error classes, versions, input conversion, OrtValues, IOBinding, asynchronous runs, the backend module."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

import quiver
import quiver.ort
from tests.support.helpers import sequence_input_model

W = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
X = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """y = relu(x·W) + 1, z = argmax over y: a float and an int64 output."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["m"]),
            helper.make_node("Relu", ["m"], ["r"]),
            helper.make_node("Add", ["r", "one"], ["y"]),
            helper.make_node("ArgMax", ["y"], ["z"], axis=1, keepdims=0),
        ],
        "surface",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32]),
            helper.make_tensor_value_info("z", TensorProto.INT64, ["n"]),
        ],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.ones(1, np.float32), "one")],
    )
    path = tmp_path_factory.mktemp("surface") / "surface.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


def _expected(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.maximum(x @ W, 0) + 1
    return y, np.argmax(y, axis=1)


def _public(module: object) -> set[str]:
    return {n for n in dir(module) if not n.startswith("_")}


def test_every_public_onnxruntime_name_is_in_quiver_ort() -> None:
    import pkgutil

    subpackages = {m.name for m in pkgutil.iter_modules(onnxruntime.__path__) if not m.name.startswith("_")}
    for name in subpackages:
        assert getattr(quiver.ort, name).__name__ in (f"onnxruntime.{name}", f"quiver.ort.{name}"), name
    missing = sorted(_public(onnxruntime) - _public(quiver.ort))
    assert not missing, f"decide these in quiver/ort/surface.py (implement, delegate or refuse): {missing}"
    for name in _public(onnxruntime):
        assert (getattr(quiver.ort, name) is None) == (getattr(onnxruntime, name) is None), name


def test_delegated_names_are_onnxruntimes_own_objects() -> None:
    for name in quiver.ort.surface.DELEGATED & _public(onnxruntime):
        assert getattr(quiver.ort, name) is getattr(onnxruntime, name), name
    value = quiver.ort.OrtValue.ortvalue_from_numpy(X)
    assert isinstance(value, onnxruntime.OrtValue)
    assert quiver.ort.__version__ == onnxruntime.__version__ == quiver.ort.get_version_string()


def test_session_and_options_have_every_public_member_of_onnxruntimes() -> None:
    for ours, theirs in (
        (quiver.ort.InferenceSession, onnxruntime.InferenceSession),
        (quiver.ort.IOBinding, onnxruntime.IOBinding),
    ):
        # defined by Quiver's class itself: InferenceSession derives from ORT's (for isinstance checks), and an
        # inherited method would run ORT's code on a session that has no ORT session inside
        defined = {n for klass in ours.__mro__ if klass.__module__.startswith("quiver.") for n in vars(klass)}
        missing = sorted(_public(theirs) - defined)
        assert not missing, f"{ours.__name__} lacks {missing}"
    assert issubclass(quiver.ort.InferenceSession, onnxruntime.InferenceSession)
    assert isinstance(quiver.ort.SessionOptions(), onnxruntime.SessionOptions)
    assert isinstance(quiver.ort.RunOptions(), onnxruntime.RunOptions)
    options = quiver.ort.SessionOptions()
    options.add_free_dimension_override_by_name("n", 4)  # ORT's own method
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_errors_are_onnxruntimes_classes_and_quiver_errors(model: Path, tmp_path: Path) -> None:
    session, plain = quiver.ort.InferenceSession(str(model)), onnxruntime.InferenceSession(str(model))
    for feeds, kind in [({"nope": X}, ValueError), ({"x": X, "nope": X}, ort_state.InvalidArgument)]:
        with pytest.raises(kind):  # a required input missing; an unknown one beside them
            plain.run(None, feeds)
        with pytest.raises(kind) as raised:
            session.run(None, feeds)
        assert isinstance(raised.value, quiver.QuiverError)
    with pytest.raises(ort_state.NoSuchFile):
        quiver.ort.InferenceSession(str(tmp_path / "missing.onnx"))
    for name, value in vars(quiver.ort.errors).items():
        if inspect.isclass(value) and issubclass(value, quiver.ort.OrtError) and hasattr(ort_state, name):
            assert issubclass(value, getattr(ort_state, name)), name


def test_python_lists_are_converted_to_the_inputs_type(model: Path) -> None:
    session = quiver.ort.InferenceSession(str(model))
    y, z = session.run(None, {"x": X.astype(np.float64).tolist()})
    np.testing.assert_allclose(y, _expected(X)[0], rtol=1e-5)
    np.testing.assert_array_equal(z, _expected(X)[1])


def test_model_metadata_reports_an_unset_version_as_onnxruntime_does(model: Path) -> None:
    ours = quiver.ort.InferenceSession(str(model)).get_modelmeta()
    theirs = onnxruntime.InferenceSession(str(model)).get_modelmeta()
    assert ours.version == theirs.version and ours.graph_name == theirs.graph_name


def test_run_with_ort_values_takes_and_gives_ort_values(model: Path) -> None:
    session = quiver.ort.InferenceSession(str(model))
    outputs = session.run_with_ort_values(["y"], {"x": onnxruntime.OrtValue.ortvalue_from_numpy(X)})
    assert isinstance(outputs[0], onnxruntime.OrtValue)
    np.testing.assert_allclose(outputs[0].numpy(), _expected(X)[0], rtol=1e-5)
    fetches: list = []
    session.run_with_ortvaluevector(None, ["x"], [onnxruntime.OrtValue.ortvalue_from_numpy(X)], ["z"], fetches)
    np.testing.assert_array_equal(fetches[0].numpy(), _expected(X)[1])


def test_iobinding_writes_into_bound_memory_without_copies(model: Path) -> None:
    session = quiver.ort.InferenceSession(str(model))
    binding = session.io_binding()
    binding.bind_cpu_input("x", X)
    target = onnxruntime.OrtValue.ortvalue_from_shape_and_type([4, 32], np.float32, "cpu", 0)
    binding.bind_ortvalue_output("y", target)
    binding.bind_output("z")  # allocated by the run
    session.run_with_iobinding(binding)
    binding.synchronize_outputs()
    y, z = _expected(X)
    np.testing.assert_allclose(target.numpy(), y, rtol=1e-5)  # written into the OrtValue's own memory
    outputs = binding.get_outputs()
    assert outputs[0] is target and isinstance(outputs[1], onnxruntime.OrtValue)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[1], z)
    # a raw pointer for the input and for the output, as GPU-style code binds them
    buffer = np.zeros((4, 32), np.float32)
    raw = session.io_binding()
    raw.bind_input("x", "cpu", 0, np.float32, list(X.shape), X.ctypes.data)
    raw.bind_output("y", "cpu", 0, np.float32, [4, 32], buffer.ctypes.data)
    session.run_with_iobinding(raw)
    np.testing.assert_allclose(buffer, y, rtol=1e-5)
    with pytest.raises(ort_state.InvalidArgument, match="CPU"):
        raw.bind_output("y", "cuda", 0, np.float32, [4, 32], buffer.ctypes.data)


def test_iobinding_without_outputs_gives_every_output(model: Path) -> None:
    session = quiver.ort.InferenceSession(str(model))
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", onnxruntime.OrtValue.ortvalue_from_numpy(X))
    session.run_with_iobinding(binding)
    y, z = binding.copy_outputs_to_cpu()
    np.testing.assert_allclose(y, _expected(X)[0], rtol=1e-5)
    fresh = session.io_binding()
    fresh.bind_output("y")
    with pytest.raises(ort_state.InvalidArgument, match="run_with_iobinding"):
        fresh.copy_outputs_to_cpu()


def test_run_async_calls_back_with_outputs_or_the_error(model: Path) -> None:
    session = quiver.ort.InferenceSession(str(model))
    done = threading.Event()
    received: dict = {}

    def callback(outputs: list, user_data: object, error: str) -> None:
        received.update(outputs=outputs, user_data=user_data, error=error)
        done.set()

    session.run_async(["y"], {"x": X}, callback, "mine")
    assert done.wait(30)
    assert received["error"] == "" and received["user_data"] == "mine"
    assert isinstance(received["outputs"][0], np.ndarray)  # ORT hands the callback numpy arrays
    np.testing.assert_allclose(received["outputs"][0], _expected(X)[0], rtol=1e-5)
    done.clear()
    session.run_async(None, {"nope": X}, callback, None)
    assert done.wait(30) and "nope" in received["error"] and received["outputs"] == []


def test_the_backend_module_runs_models_as_onnxruntimes_does(model: Path) -> None:
    from onnxruntime import backend as ort_backend

    from quiver.ort import backend

    ours = backend.run(str(model), X)
    theirs = ort_backend.run(str(model), X)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    rep = backend.prepare(model.read_bytes(), "CPU")
    np.testing.assert_array_equal(rep.run([X])[1], _expected(X)[1])
    assert backend.supports_device("CPU") and not backend.supports_device("CUDA")
    with pytest.raises(RuntimeError, match="not permitted"):
        backend.prepare(str(model), optimized_model_filepath="x.onnx")


def test_the_remaining_session_queries_answer_as_on_a_cpu(model: Path) -> None:
    session = quiver.ort.InferenceSession(str(model))
    value = session.create_ortvalue_from_shape_and_type([2, 3], TensorProto.FLOAT, "cpu")
    assert value.shape() == [2, 3] and value.data_type() == "tensor(float)"
    assert session.get_profiling_start_time_ns() > 0
    assert len(session.get_input_memory_infos()) == 1
    assert len(session.get_output_memory_infos()) == 2
    assert session.get_tuning_results() == []
    session.set_providers(["QuiverExecutionProvider"])
    with pytest.raises(ort_state.NotImplemented, match="new session"):
        session.set_providers(["QuiverExecutionProvider"], [{"htp_performance_mode": "power_saver"}])


@pytest.mark.parametrize(
    "providers, reported",
    [
        (None, ["QuiverExecutionProvider", "CPUExecutionProvider"]),
        (["QNNExecutionProvider"], ["QuiverExecutionProvider", "CPUExecutionProvider"]),
        (["QuiverExecutionProvider", "CPUExecutionProvider"], ["QuiverExecutionProvider", "CPUExecutionProvider"]),
        (["CPUExecutionProvider"], ["CPUExecutionProvider"]),
    ],
)
def test_providers_are_reported_as_onnxruntime_reports_them(model: Path, providers: list, reported: list) -> None:
    session = quiver.ort.InferenceSession(str(model), providers=providers)
    assert session.get_providers() == reported
    assert set(session.get_provider_options()) == set(reported)
    assert session.get_provider_options()["CPUExecutionProvider"] == {}
    np.testing.assert_allclose(session.run(["y"], {"x": X})[0], _expected(X)[0], rtol=1e-5)


def test_enable_profiling_writes_onnxruntimes_json_profile(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.chdir(tmp_path)
    options = quiver.ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = "mine"
    session = quiver.ort.InferenceSession(str(model), options)
    for _ in range(3):
        session.run(None, {"x": X})
    path = Path(session.end_profiling())
    assert path.parent == Path(".") and path.name.startswith("mine_") and path.suffix == ".json"
    events = json.loads(path.read_text())
    assert [e["name"] for e in events] == ["session_initialization"] + ["model_run"] * 3
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
    lines = path.read_text().splitlines()  # one event per line, as ORT writes it (and its tests read it)
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) == len(events) + 2
    assert quiver.ort.InferenceSession(str(model)).end_profiling() == ""


def test_optimized_model_filepath_is_written_as_onnxruntime_writes_it(model: Path, tmp_path: Path) -> None:
    options = quiver.ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = quiver.ort.InferenceSession(str(model), options)
    optimized = onnxruntime.InferenceSession(str(tmp_path / "optimized.onnx"))
    np.testing.assert_allclose(optimized.run(["y"], {"x": X})[0], session.run(["y"], {"x": X})[0], rtol=1e-5)


def test_session_options_load_from_the_model_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import onnx

    proto = onnx.load(str(_model_file(tmp_path)))
    config = {"session_options": {"intra_op_num_threads": 1, "inter_op_num_threads": 5, "execution_mode": 1}}
    onnx.helper.set_model_props(proto, {"ort_config": json.dumps(config)})
    path = tmp_path / "configured.onnx"
    onnx.save(proto, str(path))
    mine = quiver.ort.SessionOptions()
    mine.intra_op_num_threads = 2
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    for module in (quiver.ort, onnxruntime):
        session = module.InferenceSession(str(path), mine if module is quiver.ort else None)
        applied = session.get_session_options()
        assert (applied.intra_op_num_threads, applied.inter_op_num_threads) == (1, 5), module
        assert applied.execution_mode == onnxruntime.ExecutionMode.ORT_PARALLEL
    assert mine.intra_op_num_threads == 2  # the caller's object is left as it was
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "0")
    assert quiver.ort.InferenceSession(str(path)).get_session_options().inter_op_num_threads == 0


def _model_file(folder: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    path = folder / "relu.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


# --- ONNX Runtime's adapter format (.onnx_adapter) --------------------------------------------------
IN, OUT, RANK = 16, 12, 4


def _lora_model(folder: Path) -> Path:
    """y = x·W + (x·A)·B with A and B overridable initializers (zeros): ORT's multi-LoRA model layout."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["base"]),
        helper.make_node("MatMul", ["x", "lora_A"], ["xa"]),
        helper.make_node("MatMul", ["xa", "lora_B"], ["delta"]),
        helper.make_node("Add", ["base", "delta"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lora",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", IN]),
            helper.make_tensor_value_info("lora_A", TensorProto.FLOAT, [IN, RANK]),
            helper.make_tensor_value_info("lora_B", TensorProto.FLOAT, [RANK, OUT]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", OUT])],
        [
            numpy_helper.from_array(rng.standard_normal((IN, OUT)).astype(np.float32), "W"),
            numpy_helper.from_array(np.zeros((IN, RANK), np.float32), "lora_A"),
            numpy_helper.from_array(np.zeros((RANK, OUT), np.float32), "lora_B"),
        ],
    )
    path = folder / "lora.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


def _onnx_adapter(folder: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    adapter = onnxruntime.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters(
        {
            "lora_A": onnxruntime.OrtValue.ortvalue_from_numpy(rng.standard_normal((IN, RANK)).astype(np.float32)),
            "lora_B": onnxruntime.OrtValue.ortvalue_from_numpy(rng.standard_normal((RANK, OUT)).astype(np.float32)),
        }
    )
    path = folder / f"adapter{seed}.onnx_adapter"
    adapter.export_adapter(str(path))
    return path


def _run_with(module: object, session: object, path: Path | None, x: np.ndarray) -> np.ndarray:
    options = module.RunOptions()  # type: ignore[attr-defined]
    if path is not None:
        adapter = module.LoraAdapter()  # type: ignore[attr-defined]
        adapter.Load(str(path))
        options.add_active_adapter(adapter)
    return session.run(None, {"x": x}, options)[0]  # type: ignore[attr-defined]


def test_onnx_adapters_replace_overridable_initializers_per_run_as_in_onnxruntime(tmp_path: Path) -> None:
    model = _lora_model(tmp_path)
    adapters = [_onnx_adapter(tmp_path, seed) for seed in (1, 2)]
    ours = quiver.ort.InferenceSession(str(model))
    theirs = onnxruntime.InferenceSession(str(model))
    assert [a.name for a in ours.get_overridable_initializers()] == ["lora_A", "lora_B"]
    assert [a.name for a in ours.get_inputs()] == [a.name for a in theirs.get_inputs()] == ["x"]
    x = np.random.default_rng(3).standard_normal((3, IN)).astype(np.float32)
    for path in (adapters[0], None, adapters[1], adapters[0]):
        expected = _run_with(onnxruntime, theirs, path, x)
        np.testing.assert_allclose(_run_with(quiver.ort, ours, path, x), expected, rtol=1e-5, atol=1e-5)


def test_a_file_that_is_no_adapter_is_the_error_onnxruntime_raises(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx_adapter"
    bad.write_bytes(b"not an adapter at all")
    with pytest.raises(RuntimeError) as ours:
        quiver.ort.LoraAdapter().Load(str(bad))
    assert isinstance(ours.value, quiver.QuiverError) and "neither" in str(ours.value)
    with pytest.raises(RuntimeError):
        onnxruntime.LoraAdapter().Load(str(bad))
    with pytest.raises(ort_state.NoSuchFile):
        quiver.ort.LoraAdapter().Load(str(tmp_path / "missing.onnx_adapter"))


def test_quiver_lora_import_turns_an_onnx_adapter_into_a_section(tmp_path: Path) -> None:
    from tests.support.cli import assert_one_line_error
    from tests.support.cli import quiver as run_cli

    model = _lora_model(tmp_path)
    adapter = _onnx_adapter(tmp_path, 1)
    with quiver.Context.create("cpu") as builder:
        builder.add_graph("lora", model, updateable=["lora_A", "lora_B"])
        context = builder.save(tmp_path / "lora.qctx")
    result = run_cli("lora", "import", "--onnx-adapter", adapter, "--context", context, "-o", tmp_path / "one.qsec")
    assert result.returncode == 0, result.stderr
    x = np.random.default_rng(4).standard_normal((2, IN)).astype(np.float32)
    with quiver.Context.from_binary(context) as loaded:
        loaded.apply_binary_section("lora", tmp_path / "one.qsec")
        ours = loaded.graph("lora").execute({"x": x})["y"]
    expected = _run_with(onnxruntime, onnxruntime.InferenceSession(str(model)), adapter, x)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    plain = tmp_path / "plain.qctx"
    with quiver.Context.create("cpu") as builder:
        builder.add_graph("lora", model)
        builder.save(plain)
    failed = run_cli("lora", "import", "--onnx-adapter", adapter, "--context", plain, "-o", tmp_path / "x.qsec")
    assert_one_line_error(failed, "updateable")


# --- models plain ORT runs: quiver.ort runs them too ----------------------------------------------------
def _saved(model: object, folder: Path, name: str) -> Path:
    path = folder / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())  # type: ignore[attr-defined]
    return path


def _sparse_constant_model() -> object:
    dense = np.zeros((4, 4), np.float32)
    dense[1, 2], dense[3, 0] = 5.0, -2.0
    values = numpy_helper.from_array(np.array([5.0, -2.0], np.float32), "values")
    indices = numpy_helper.from_array(np.array([6, 12], np.int64), "indices")
    sparse = helper.make_sparse_tensor(values, indices, [4, 4])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], sparse_value=sparse), helper.make_node("Add", ["x", "c"], ["y"])],
        "sparse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ir3_model() -> object:
    """IR 3: initializers must also be graph inputs; ORT runs it."""
    w = numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "ir3",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
        [w],
    )
    return helper.make_model(graph, ir_version=3, opset_imports=[helper.make_opsetid("", 8)])


def test_a_model_quiver_cannot_convert_compiles_unchanged_unless_asked_to_fail(tmp_path: Path) -> None:
    source = _saved(sequence_input_model(18), tmp_path, "sequence")
    quiver.ort.ModelCompiler(quiver.ort.SessionOptions(), str(source)).compile_to_file(str(tmp_path / "out.onnx"))
    assert (tmp_path / "out.onnx").read_bytes() == source.read_bytes()
    strict = onnxruntime.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED
    with pytest.raises(ort_state.Fail, match="Unable to compile any nodes"):
        quiver.ort.ModelCompiler(quiver.ort.SessionOptions(), str(source), flags=strict).compile_to_file()


def test_onnx_adapters_are_per_run_under_threads(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    model = _lora_model(tmp_path)
    paths = [_onnx_adapter(tmp_path, seed) for seed in (1, 2)]
    session = quiver.ort.InferenceSession(str(model))
    x = np.random.default_rng(5).standard_normal((3, IN)).astype(np.float32)
    reference = onnxruntime.InferenceSession(str(model))
    expected = {path: _run_with(onnxruntime, reference, path, x) for path in paths}

    def work(index: int) -> bool:
        path = paths[index % 2]
        return all(np.allclose(_run_with(quiver.ort, session, path, x), expected[path], atol=1e-5) for _ in range(20))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))


def test_a_fixed_shape_output_bound_to_an_ortvalue_is_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quiver.ort.binding import array_of

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
        [numpy_helper.from_array(W, "W")],
    )
    path = _saved(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path, "fixed")
    session = quiver.ort.InferenceSession(str(path))
    target = onnxruntime.OrtValue.ortvalue_from_shape_and_type([4, 32], np.float32, "cpu", 0)
    binding = session.io_binding()
    binding.bind_cpu_input("x", X)
    binding.bind_ortvalue_output("y", target)

    def no_copy(*_: object, **__: object) -> None:
        raise AssertionError("a fixed-shape bound output was copied, not written by the run")

    monkeypatch.setattr(np, "copyto", no_copy)
    for _ in range(2):
        session.run_with_iobinding(binding)
        # float32 sums of 64 products in another order than numpy's BLAS: an absolute allowance too
        np.testing.assert_allclose(target.numpy(), X.astype(np.float64) @ W, rtol=1e-5, atol=1e-5)
        # the run's result is the OrtValue's own memory: written by the graph, not copied afterwards
        assert np.shares_memory(binding._results["y"], array_of(target))

"""`quiver.ort` where ONNX Runtime's own API tests look: module layout, string feeds, options that change
the model, adapters of another rank, ORT's private session, process-wide thread pools, compile streams.
Each behaviour is checked against plain onnxruntime on the same model."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

import quiver
import quiver.ort
from tests.support.helpers import sequence_input_model


def _save(graph: object, path: Path, opset: int = 17) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path.write_bytes(model.SerializeToString())
    return path


def _elementwise(path: Path, op: str, inputs: tuple[str, ...] = ("x",), size: int = 2) -> Path:
    """y = op(inputs) on float vectors of `size`."""
    graph = helper.make_graph(
        [helper.make_node(op, list(inputs), ["y"])],
        op.lower(),
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])],
    )
    return _save(graph, path)


def _matmul(w: np.ndarray) -> object:
    """y = x·w for one row x: the graph, to save with or without external data."""
    return helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[1]])],
        [numpy_helper.from_array(w, "w")],
    )


def test_delegated_subpackages_import_by_their_quiver_ort_names() -> None:
    from quiver.ort.capi import _pybind_state
    from quiver.ort.capi.onnxruntime_inference_collection import check_and_normalize_provider_args
    from quiver.ort.capi.onnxruntime_pybind11_state import Fail

    from quiver.ort.backend.backend import OnnxRuntimeBackend
    from quiver.ort.backend.backend_rep import OnnxRuntimeBackendRep

    assert Fail is ort_state.Fail and issubclass(quiver.ort.Fail, Fail)
    assert _pybind_state is onnxruntime.capi._pybind_state  # the same module, its extension loaded once
    assert onnxruntime.capi.__spec__.name == "onnxruntime.capi"  # the alias left ORT's own module as it was
    assert check_and_normalize_provider_args(["a"], None, ["a"]) == (["a"], [{}])
    assert OnnxRuntimeBackend.supports_device("CPU") and OnnxRuntimeBackendRep.__module__.startswith("quiver.ort")


def test_strings_fed_as_bytes_or_raw_bytes_are_decoded_as_onnxruntime_does(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["s"], ["t"])],
        "strings",
        [helper.make_tensor_value_info("s", TensorProto.STRING, [2, 2])],
        [helper.make_tensor_value_info("t", TensorProto.STRING, [2, 2])],
    )
    path = _save(graph, tmp_path / "strings.onnx")
    ours, theirs = quiver.ort.InferenceSession(str(path)), onnxruntime.InferenceSession(str(path))
    assert ours.execution_path.on_quiver  # Quiver runs it itself
    feeds = [
        np.array([["Olá", "你好"], ["여보세요", "hi"]]),
        np.array([[b"this", b"is"], [b"a", b"test"]], dtype="S5"),  # ORT reads past an unpadded one: not here
        np.array([[b"must", b"have"], [b"A\0A\0", b"size"]], dtype=np.void),
        np.array([["a", "b"], ["c", "d"]], dtype=object),
    ]
    for feed in feeds:
        np.testing.assert_array_equal(ours.run(None, {"s": feed})[0], theirs.run(None, {"s": feed})[0])


def test_free_dimension_overrides_and_given_initializers_apply_as_in_onnxruntime(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "rows", 3])
    x.type.tensor_type.shape.dim[1].denotation = "DATA_CHANNEL"
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "free_dims",
        [x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "rows", 2])],
        [numpy_helper.from_array(w, "w")],
    )
    path = _save(graph, tmp_path / "free_dims.onnx")
    given = onnxruntime.OrtValue.ortvalue_from_numpy(-w)
    sessions = []
    for module in (quiver.ort, onnxruntime):
        options = module.SessionOptions()
        options.add_free_dimension_override_by_name("batch", 2)
        options.add_free_dimension_override_by_denotation("DATA_CHANNEL", 4)
        options.add_initializer("w", given)
        sessions.append(module.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
    ours, theirs = sessions
    assert ours.get_inputs()[0].shape == theirs.get_inputs()[0].shape == [2, 4, 3]
    feed = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)
    np.testing.assert_allclose(ours.run(None, {"x": feed})[0], feed @ -w, rtol=1e-6)
    np.testing.assert_allclose(theirs.run(None, {"x": feed})[0], feed @ -w, rtol=1e-6)


def _rank_free_lora_model(path: Path) -> Path:
    """ORT's LoRA layout: empty default parameters ([4, 0], [0, 4]) that adapters replace with rank r."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["base"]),
            helper.make_node("MatMul", ["x", "lora_a"], ["xa"]),
            helper.make_node("MatMul", ["xa", "lora_b"], ["delta"]),
            helper.make_node("Add", ["base", "delta"], ["y"]),
        ],
        "rank_free",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4]),
            helper.make_tensor_value_info("lora_a", TensorProto.FLOAT, [4, "rank"]),
            helper.make_tensor_value_info("lora_b", TensorProto.FLOAT, ["rank", 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
        [
            numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "w"),
            numpy_helper.from_array(np.zeros((4, 0), np.float32), "lora_a"),
            numpy_helper.from_array(np.zeros((0, 4), np.float32), "lora_b"),
        ],
    )
    return _save(graph, path)


def test_an_adapter_of_another_shape_runs_through_onnxruntime_as_onnxruntime_runs_it(tmp_path: Path) -> None:
    model = _rank_free_lora_model(tmp_path / "rank_free.onnx")
    rng = np.random.default_rng(1)
    adapters = []
    for rank in (1, 3):
        adapter = onnxruntime.AdapterFormat()
        adapter.set_parameters(
            {
                "lora_a": onnxruntime.OrtValue.ortvalue_from_numpy(rng.standard_normal((4, rank)).astype(np.float32)),
                "lora_b": onnxruntime.OrtValue.ortvalue_from_numpy(rng.standard_normal((rank, 4)).astype(np.float32)),
            }
        )
        adapter.export_adapter(str(tmp_path / f"rank{rank}.onnx_adapter"))
        adapters.append(tmp_path / f"rank{rank}.onnx_adapter")
    ours, theirs = quiver.ort.InferenceSession(str(model)), onnxruntime.InferenceSession(str(model))
    assert ours.execution_path.on_quiver
    x = np.ones((4, 4), np.float32)
    for path in (adapters[0], None, adapters[1]):
        results = []
        for module, session in ((quiver.ort, ours), (onnxruntime, theirs)):
            options = module.RunOptions()
            if path is not None:
                adapter = module.LoraAdapter()
                adapter.Load(str(path))
                options.add_active_adapter(adapter)
            results.append(session.run(None, {"x": x}, options)[0])
        np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-5)


def test_the_private_session_is_onnxruntimes_own(tmp_path: Path) -> None:
    """Client code (ORT's tests among it) reaches for `session._sess`: it is a plain ORT C session."""
    path = _elementwise(tmp_path / "square.onnx", "Mul", ("x", "x"), size=3)
    session = quiver.ort.InferenceSession(str(path))
    x = np.array([1.0, 2.0, 3.0], np.float32)
    value = onnxruntime.OrtValue.ortvalue_from_numpy(x)
    outputs = session._sess.run_with_ort_values({"x": value._get_c_value()}, ["y"], ort_state.RunOptions())
    assert isinstance(outputs, ort_state.OrtValueVector)
    np.testing.assert_array_equal(outputs[0].numpy(), x * x)
    assert session._sess is session._sess  # made once


def test_models_plain_onnxruntime_runs_take_sequences_as_onnxruntime_takes_them(tmp_path: Path) -> None:
    path = tmp_path / "sequence.onnx"
    onnx.save(sequence_input_model(11), str(path))
    session = quiver.ort.InferenceSession(str(path))
    assert session.execution_path.engine == "onnxruntime" and "'s' is a sequence" in str(session.execution_path.reason)
    assert session.run(None, {"s": [np.zeros(2, np.float32)] * 3})[0] == 3
    with pytest.raises(ValueError, match="Required inputs"):
        session.run(None, {})


def test_an_unknown_provider_is_the_runtime_error_onnxruntime_raises(tmp_path: Path) -> None:
    path = _elementwise(tmp_path / "neg.onnx", "Neg")
    for module in (quiver.ort, onnxruntime):
        session = module.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        with pytest.raises(RuntimeError, match="Unknown Provider Type: Bogus"):
            session.set_providers(["Bogus"])


def test_an_optimized_model_places_its_weights_as_the_session_entries_say(tmp_path: Path) -> None:
    w = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    path = _save(_matmul(w), tmp_path / "big_weight.onnx")
    options = quiver.ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "out" / "optimized.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "100")
    (tmp_path / "out").mkdir()
    quiver.ort.InferenceSession(str(path), options)
    assert (tmp_path / "out" / "weights.bin").stat().st_size >= w.nbytes  # beside the model, not in the cwd
    x = np.ones((1, 64), np.float32)
    reopened = quiver.ort.InferenceSession(str(tmp_path / "out" / "optimized.onnx"))
    np.testing.assert_allclose(reopened.run(None, {"x": x})[0], x @ w, rtol=1e-5)


def test_a_failing_compile_stream_is_onnxruntimes_fail(tmp_path: Path) -> None:
    path = _elementwise(tmp_path / "relu.onnx", "Relu")
    compiler = quiver.ort.ModelCompiler(quiver.ort.SessionOptions(), str(path), embed_compiled_data_into_model=True)

    def refuse(_: bytes) -> None:
        raise ValueError("disk full")

    with pytest.raises(ort_state.Fail, match="disk full"):
        compiler.compile_to_stream(refuse)


GLOBAL_POOLS = """
import numpy as np, onnx, onnxruntime, sys
from onnx import TensorProto, helper, numpy_helper
import quiver.ort
w = np.arange(12, dtype=np.float32).reshape(4, 3)
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "pools",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [numpy_helper.from_array(w, "w")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
{set_pools}
options = quiver.ort.SessionOptions()
options.use_per_session_threads = False
session = quiver.ort.InferenceSession(model, options)
assert session.execution_path.on_quiver
x = np.ones((2, 4), np.float32)
np.testing.assert_allclose(session.run(None, {{"x": x}})[0], x @ w)
try:
    quiver.ort.InferenceSession(model)
except RuntimeError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("module", ["quiver.ort", "onnxruntime"])
def test_sessions_run_on_global_thread_pools_once_they_are_made(module: str) -> None:
    """Process-wide, so in a process of its own; the pools may be made through either module."""
    script = GLOBAL_POOLS.format(set_pools=f"{module}.set_global_thread_pool_sizes(2, 2)")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if module == "quiver.ort":  # known at once: refused as ORT refuses it
        assert "use_per_session_threads must be false" in done.stdout


def test_a_model_onnxruntime_runs_for_quiver_ort_profiles_as_onnxruntime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    path = tmp_path / "sequence.onnx"
    onnx.save(sequence_input_model(11), str(path))
    monkeypatch.chdir(tmp_path)
    options = quiver.ort.SessionOptions()
    options.enable_profiling = True
    session = quiver.ort.InferenceSession(str(path), options)
    assert not session.execution_path.on_quiver  # a sequence fed from outside
    session.run(None, {"s": [np.zeros(2, np.float32)] * 2})
    events = json.loads(Path(session.end_profiling()).read_text())
    assert any(e.get("cat") == "Node" for e in events)  # ORT's own profile: its nodes ran
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_options_from_the_model_keep_the_callers_initializers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    w = np.arange(4, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])],
        "configured",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    helper.set_model_props(model, {"ort_config": json.dumps({"session_options": {"intra_op_num_threads": 1}})})
    path = tmp_path / "configured.onnx"
    path.write_bytes(model.SerializeToString())
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    options = quiver.ort.SessionOptions()
    options.add_initializer("w", onnxruntime.OrtValue.ortvalue_from_numpy(-w))
    session = quiver.ort.InferenceSession(str(path), options)
    assert session.get_session_options().intra_op_num_threads == 1
    np.testing.assert_array_equal(session.run(None, {"x": np.ones(4, np.float32)})[0], -w)


LOGGING = """
import numpy as np, quiver.ort
from onnx import TensorProto, helper
x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "xy")
graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
quiver.ort.InferenceSession(model).run(None, {"x": np.ones(2, np.float32)})
print("quiet load done", flush=True)
quiver.ort.set_default_logger_severity(0)
quiver.ort.InferenceSession(model).run(None, {"x": np.ones(2, np.float32)})
"""


def test_quiver_sessions_log_only_when_asked_through_the_default_logger_severity() -> None:
    """A normal load prints nothing; after set_default_logger_severity(0), Quiver's sessions log verbosely
    too, as ORT's do (in a process of its own: the severity is process-wide)."""
    done = subprocess.run([sys.executable, "-c", LOGGING], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout
    quiet, marker, verbose = done.stdout.partition("quiet load done")  # one pipe: the order is kept
    assert marker
    assert "onnxruntime" not in quiet
    assert "[V:onnxruntime" in verbose or "[I:onnxruntime" in verbose


@pytest.mark.skipif(
    not hasattr(onnxruntime, "set_default_logger_callback"), reason="this onnxruntime has no logging callback"
)
def test_a_logging_callback_receives_quiver_sessions_messages() -> None:
    script = LOGGING.replace(
        "quiver.ort.set_default_logger_severity(0)",
        "got = []\nquiver.ort.set_default_logger_callback(lambda *record: got.append(record), severity=0)",
    )
    script += "\nassert got and all(isinstance(r[4], str) for r in got), got\nprint('messages', len(got))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "messages" in done.stdout


def _add_mul_add(path: Path) -> Path:
    one = numpy_helper.from_array(np.ones(3, np.float32), "one")
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "one"], ["a"], name="add_0"),
            helper.make_node("Mul", ["a", "a"], ["m"], name="mul_0"),
            helper.make_node("Add", ["m", "one"], ["y"], name="add_1"),
        ],
        "add_mul_add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [one],
    )
    return _save(graph, path)


def test_the_graph_assignment_is_reported_as_for_a_compiling_provider(tmp_path: Path) -> None:
    path = _add_mul_add(tmp_path / "add_mul_add.onnx")
    with pytest.raises(ort_state.Fail, match="record_ep_graph_assignment_info"):
        quiver.ort.InferenceSession(str(path)).get_provider_graph_assignment_info()
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    (subgraph,) = quiver.ort.InferenceSession(str(path), options).get_provider_graph_assignment_info()
    assert subgraph.ep_name == "QuiverExecutionProvider"  # one compiled subgraph: every node of the model
    assert [f"{n.domain}:{n.op_type}/{n.name}" for n in subgraph.get_nodes()] == [
        ":Add/add_0",
        ":Mul/mul_0",
        ":Add/add_1",
    ]


@pytest.mark.skipif(
    not hasattr(onnxruntime.SessionOptions, "add_external_initializers_from_files_in_memory"),
    reason="this onnxruntime cannot take external-data files from memory",
)
def test_external_data_files_given_from_memory_are_read_as_onnxruntime_reads_them(tmp_path: Path) -> None:
    import onnx

    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    model = helper.make_model(_matmul(w), opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "external.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    (tmp_path / "weights.bin").unlink()  # its bytes are given from memory instead
    x, weights = np.ones((1, 4), np.float32), w.tobytes()  # ORT reads the buffer later: it must stay alive
    for module in (quiver.ort, onnxruntime):
        options = module.SessionOptions()
        options.add_external_initializers_from_files_in_memory(["weights.bin"], [weights], [w.nbytes])
        session = module.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ w)
        assert module is onnxruntime or session.execution_path.on_quiver  # quiver.ort: built by Quiver itself
    options = quiver.ort.SessionOptions()  # the optimized model is written from the bytes given too
    options.add_external_initializers_from_files_in_memory(["weights.bin"], [weights], [w.nbytes])
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    quiver.ort.InferenceSession(str(path), options)
    optimized = onnxruntime.InferenceSession(str(tmp_path / "optimized.onnx"))
    np.testing.assert_allclose(optimized.run(None, {"x": x})[0], x @ w)


def test_a_model_given_as_bytes_reads_its_external_data_from_the_folder_the_options_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnx

    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    (tmp_path / "model").mkdir()
    path = tmp_path / "model" / "external.onnx"
    onnx.save_model(helper.make_model(_matmul(w)), path, save_as_external_data=True, location="w.bin", size_threshold=0)
    monkeypatch.chdir(tmp_path)  # not the model's folder: ORT never reads external data relative to the cwd
    data, x = path.read_bytes(), np.ones((1, 4), np.float32)
    for module in (quiver.ort, onnxruntime):
        with pytest.raises(Exception) as refused:  # bytes alone: no folder to read the weights from
            module.InferenceSession(data, providers=["CPUExecutionProvider"])
        assert module is onnxruntime or isinstance(refused.value, quiver.QuiverError)
        options = module.SessionOptions()
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        session = module.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ w)
        assert module is onnxruntime or session.execution_path.on_quiver
    compiled = quiver.ort.ModelCompiler(options, data, embed_compiled_data_into_model=True).compile_to_bytes()
    np.testing.assert_allclose(quiver.ort.InferenceSession(compiled).run(None, {"x": x})[0], x @ w)


FORKED = """
import os, sys, threading, time, numpy as np, quiver.ort
from onnx import TensorProto, helper, numpy_helper
def save(nodes, inputs, outputs, opset, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()
seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
plain_ort = quiver.ort.InferenceSession(save(  # a model only plain ORT runs
    [helper.make_node("SequenceLength", ["s"], ["n"])], [helper.make_value_info("s", seq)],
    [helper.make_tensor_value_info("n", TensorProto.INT64, [])], 11))
w = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)  # its plain-ORT twin takes a while
x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2048]) for n in "xy")
on_quiver = quiver.ort.InferenceSession(save(
    [helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y], 17, [numpy_helper.from_array(w, "w")]))
a = np.ones((1, 2048), np.float32)
assert plain_ort.run(None, {"s": [a] * 3})[0] == 3
making = threading.Thread(target=lambda: on_quiver._sess)  # makes the twin, holding its lock meanwhile
making.start()
time.sleep(0.02)
pid = os.fork()  # in the middle of it: in the child, no thread will ever release that lock
if pid == 0:
    threading.Timer(60, lambda: os._exit(3)).start()  # a deadlock ends as exit status 3
    assert plain_ort.run(None, {"s": [a] * 3})[0] == 3
    value = quiver.ort.OrtValue.ortvalue_from_numpy(a)._get_c_value()
    twin = on_quiver._sess.run_with_ort_values({"x": value}, ["y"], None)
    np.testing.assert_allclose(twin[0].numpy(), a @ w, rtol=1e-3)
    np.testing.assert_allclose(on_quiver.run(None, {"x": a})[0], a @ w, rtol=1e-3)
    os._exit(0)
making.join()
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_sessions_run_in_a_forked_child_including_their_plain_onnxruntime_parts() -> None:
    """A child forked while another thread makes the plain-ORT twin (holding its lock) makes its own."""
    done = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "child exit 0" in done.stdout, done.stdout + done.stderr


def _conv_bn_model(declared_input: list[int | str]) -> object:
    """A Conv with 16 output channels and a BatchNormalization after it, as every CNN export has: ORT's
    Conv + BN fusion (basic) and NCHWc layout (all) read and rewrite the Conv's weights."""
    rng = np.random.default_rng(26)
    channels = 16
    weights = {
        "conv.weight": rng.standard_normal((channels, 3, 3, 3)),
        "bn.scale": rng.standard_normal(channels),
        "bn.bias": rng.standard_normal(channels),
        "bn.mean": rng.standard_normal(channels),
        "bn.var": rng.random(channels) + 0.5,
        "head.weight": rng.standard_normal((channels, channels, 1, 1)),
    }
    nodes = [
        helper.make_node("Conv", ["x", "conv.weight"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["b"]),
        helper.make_node("Relu", ["b"], ["r"]),
        helper.make_node("Conv", ["r", "head.weight"], ["h"]),
        helper.make_node("Transpose", ["h"], ["y"], perm=[0, 2, 3, 1]),
    ]
    return helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, declared_input)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v.astype(np.float32), n) for n, v in weights.items()],
    )


@pytest.mark.parametrize("level", ["ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
def test_a_cnn_whose_weights_orts_passes_rewrite_runs_on_quiver_from_its_first_run(tmp_path: Path, level: str) -> None:
    path = _save(_conv_bn_model([1, 3, 16, 16]), tmp_path / "cnn.onnx")
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    outputs = {}
    for module in (onnxruntime, quiver.ort):
        options = module.SessionOptions()
        options.graph_optimization_level = getattr(onnxruntime.GraphOptimizationLevel, level)
        session = module.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        outputs[module.__name__] = session.run(None, {"x": x})[0]
    assert session.execution_path.on_quiver
    np.testing.assert_array_equal(outputs["quiver.ort"], outputs["onnxruntime"])


def test_negative_and_symbolic_dims_are_dynamic_and_reported_as_onnxruntime_reports_them(tmp_path: Path) -> None:
    path = _save(_conv_bn_model([-1, 3, "?", -1]), tmp_path / "paddle_style.onnx")  # as Paddle declares them
    ours = quiver.ort.InferenceSession(str(path))
    theirs = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert ours.get_inputs()[0].shape == theirs.get_inputs()[0].shape
    assert ours.execution_path.on_quiver
    for shape in ((5, 3, 48, 192), (2, 3, 8, 8)):
        x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(ours.run(None, {"x": x})[0], theirs.run(None, {"x": x})[0])

"""The cpu backend: lazy weight packing, the shared packing container, and the Python-API fallback."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import quiver
from quiver.backends import cpu
from quiver.backends.cpu import capi_session, sessions
from quiver.backends.cpu.capi import CApiUnavailableError, api
from tests.support.helpers import executables


def _outputs(context: quiver.Context, ids: np.ndarray) -> dict[str, np.ndarray]:
    return {name: context.graph(name).execute({"input_ids": ids})["last_hidden_state"] for name in context.graph_names}


def test_a_graph_runs_unpacked_first_then_packed_with_the_same_outputs(
    family_context: Path, input_ids: np.ndarray
) -> None:
    context = quiver.Context.from_binary(family_context, backend="cpu")
    first = context.graph("base").execute({"input_ids": input_ids})["last_hidden_state"]
    executable = executables(context)["base"]
    assert isinstance(executable, cpu.CpuExecutable)
    context.wait_until_ready()
    assert executable.is_packed
    later = context.graph("base").execute({"input_ids": input_ids})["last_hidden_state"]
    np.testing.assert_allclose(first, later, atol=1e-5, rtol=0)


def test_background_packing_counts_a_run_under_way_as_not_quiet(family_context: Path, input_ids: np.ndarray) -> None:
    import threading

    context = quiver.Context.from_binary(family_context, backend=cpu.CpuBackend())
    context.prepare_graph("base")
    executable = executables(context)["base"]
    assert isinstance(executable, cpu.CpuExecutable) and not executable.is_packed
    session = executable._session
    assert session is not None
    entered, release = threading.Event(), threading.Event()
    real_run = session.run

    def held_run(*args: object, **kwargs: object) -> object:  # the real run, once the test lets it go
        entered.set()
        release.wait(30)
        return real_run(*args, **kwargs)  # type: ignore[arg-type]

    session.run = held_run  # type: ignore[method-assign]
    executable._last_run = time.monotonic() - 10  # the last run returned long ago
    results: list[np.ndarray] = []
    runner = threading.Thread(
        target=lambda: results.append(context.graph("base").execute({"input_ids": input_ids})["last_hidden_state"])
    )
    runner.start()
    try:
        assert entered.wait(30)
        # a run under way: packing (and letting the mapped weights go) waits for it
        assert executable._until_quiet() > 0
    finally:
        release.set()
        runner.join(30)
    assert len(results) == 1 and np.isfinite(results[0]).all()
    context.close()


@pytest.mark.parametrize("backend", [cpu.CpuBackend(lazy_prepack=False), cpu.CpuBackend(prepack=False)])
def test_eager_packing_and_no_packing_agree_with_onnxruntime(
    family: dict, family_context: Path, input_ids: np.ndarray, backend: cpu.CpuBackend
) -> None:
    context = quiver.Context.from_binary(family_context, backend=backend)
    for name, ours in _outputs(context, input_ids).items():
        theirs = ort.InferenceSession(family[name].SerializeToString()).run(None, {"input_ids": input_ids})[0]
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert all(e.is_packed == backend.prepack for e in executables(context).values())


def test_a_graph_packed_from_the_start_hands_what_orts_packing_freed_back_to_the_os(
    family_context: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ORT frees what it read to pack (or before it found the packed form in a file) into the heap, where it
    # stayed in a server's private memory (34 MB of SmolLM2's): packed-first graphs trim once they are made
    from quiver.backends.cpu import executable

    trims: list[int] = []
    monkeypatch.setattr(executable.portable, "return_freed_memory", lambda: trims.append(1))
    context = quiver.Context.from_binary(family_context, backend=cpu.CpuBackend(lazy_prepack=False))
    name = context.graph_names[0]
    context.prepare_graph(name)
    assert executables(context)[name].is_packed and trims
    context.close()


@pytest.mark.parametrize("lazy", [False, True])
def test_graphs_of_one_context_share_one_packing_container(
    family_context: Path, input_ids: np.ndarray, lazy: bool
) -> None:
    backend = cpu.CpuBackend(lazy_prepack=lazy)
    context = quiver.Context.from_binary(family_context, backend=backend)
    _outputs(context, input_ids)
    context.wait_until_ready()
    sessions = [e._session for e in executables(context).values()]  # type: ignore[attr-defined]
    assert all(isinstance(s, capi_session.Session) for s in sessions)
    assert {id(s._container) for s in sessions} == {id(backend.container())}
    other = quiver.Context.from_binary(family_context, backend="cpu")
    assert other._backend.container() is not backend.container()  # type: ignore[attr-defined]


def test_releasing_a_graph_while_it_packs_is_safe(family_context: Path, input_ids: np.ndarray) -> None:
    context = quiver.Context.from_binary(family_context, backend="cpu")
    context.graph("finetune_1").execute({"input_ids": input_ids})
    context.release_graph("finetune_1")
    assert context.live_graphs == []
    assert context.graph("finetune_1").execute({"input_ids": input_ids})["last_hidden_state"].shape[0] == 2


def test_the_first_output_comes_from_an_unpacked_python_api_session(
    family_context: Path, input_ids: np.ndarray
) -> None:
    context = quiver.Context.from_binary(family_context, backend="cpu")
    context.graph("base").execute({"input_ids": input_ids})
    executable = executables(context)["base"]
    context.wait_until_ready()
    assert executable.is_packed and isinstance(executable._session, capi_session.Session)  # type: ignore[attr-defined]
    unpacked = quiver.Context.from_binary(family_context, backend="cpu-noprepack")
    unpacked.graph("base").execute({"input_ids": input_ids})
    assert isinstance(executables(unpacked)["base"]._session, sessions.PythonApiSession)  # type: ignore[attr-defined]


def test_without_the_c_library_the_python_api_runs_the_graph(
    family: dict, family_context: Path, input_ids: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable(*_: object, **__: object) -> None:
        raise CApiUnavailableError("no C library in this test")

    monkeypatch.setattr(capi_session.Session, "__init__", unavailable)
    context = quiver.Context.from_binary(family_context, backend=cpu.CpuBackend(lazy_prepack=False))
    ours = context.graph("base").execute({"input_ids": input_ids})["last_hidden_state"]
    executable = executables(context)["base"]
    assert executable.is_packed and isinstance(executable._session, sessions.PythonApiSession)  # type: ignore[attr-defined]
    theirs = ort.InferenceSession(family["base"].SerializeToString()).run(None, {"input_ids": input_ids})[0]
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_the_c_api_table_passes_its_self_check() -> None:
    capi = api()
    assert capi.env and capi.cpu_memory
    with pytest.raises(quiver.BackendError, match="ONNX Runtime: boom"):
        capi.check(capi.CreateStatus(1, b"boom"))


@pytest.mark.parametrize(("from_bytes", "persistent"), [(False, True), (False, False), (True, True), (True, False)])
def test_outputs_after_packing_are_right_for_every_kind_of_source(
    family: dict, family_context: Path, input_ids: np.ndarray, from_bytes: bool, persistent: bool
) -> None:
    # Packed weights' mapped pages are dropped only for file mappings; private memory must keep its bytes.
    source = family_context.read_bytes() if from_bytes else family_context
    context = quiver.Context.from_binary(source, backend="cpu", persistent=persistent)
    assert context.file.file_backed == (not from_bytes and persistent)
    theirs = ort.InferenceSession(family["finetune_2"].SerializeToString()).run(None, {"input_ids": input_ids})[0]
    for _ in range(2):
        ours = context.graph("finetune_2").execute({"input_ids": input_ids})["last_hidden_state"]
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
        context.wait_until_ready()
    assert executables(context)["finetune_2"].is_packed  # type: ignore[attr-defined]


@pytest.mark.parametrize("lazy", [False, True])
def test_weights_that_onnx_runtime_folds_reach_its_optimizers_without_a_second_try(lazy: bool) -> None:
    from onnx import TensorProto, helper, numpy_helper

    table = np.arange(512 * 64, dtype=np.float32).reshape(512, 64) / 1000  # a position table, as BERT's
    graph = helper.make_graph(
        [  # Slice of a weight with constant bounds: too large for Quiver to fold at build time (100 KB), so
            # ORT folds it at load and must read the table's bytes
            helper.make_node("Slice", ["table", "starts", "ends", "axes"], ["rows"]),
            helper.make_node("Add", ["x", "rows"], ["y"]),
        ],
        "folded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [400, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [400, 64])],
        [
            numpy_helper.from_array(table, "table"),
            *(
                numpy_helper.from_array(np.array([v], np.int64), n)
                for n, v in (("starts", 3), ("ends", 403), ("axes", 0))
            ),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.ones((400, 64), np.float32)
    context = quiver.Context.create(cpu.CpuBackend(lazy_prepack=lazy))
    context.add_graph("folded", model)
    context.finalize()
    first = context.graph("folded").execute({"x": x})["y"]
    context.wait_until_ready()
    assert "Slice" in {n.op_type for n in context.finalized_graph("folded").model.graph.node}  # not folded at build
    np.testing.assert_array_equal(first, x + table[3:403])
    np.testing.assert_array_equal(context.graph("folded").execute({"x": x})["y"], first)
    assert all(e.is_packed for e in executables(context).values())  # type: ignore[attr-defined]


def _resident_kb_of_mapping(address: int) -> int:
    """The resident size (kB) of the memory mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_mapped_weights_are_let_go_while_a_session_packs_them(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(1 << 20, dtype=np.float32).tobytes())  # 4 MB
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # closed with its last array
    weights = np.frombuffer(mapped, np.float32)
    address = weights.__array_interface__["data"][0]
    assert float(weights[::1024].sum()) > 0  # every page read, as ORT reads a weight it packs
    assert _resident_kb_of_mapping(address) >= 4096
    seen = []

    def pack() -> str:  # a packing that takes until the pages it read are let go (or 10 s)
        deadline = time.monotonic() + 10
        while _resident_kb_of_mapping(address) and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append(_resident_kb_of_mapping(address))
        return "session"

    assert sessions.packing_while_dropping([weights], pack) == "session"
    assert seen == [0]
    np.testing.assert_array_equal(weights[:5], np.arange(5, dtype=np.float32))  # read back from the file

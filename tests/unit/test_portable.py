"""The core runs where the OS has neither `fcntl` nor `fork` (Windows): file locks and fork hooks go through
`quiver.portable`, which does without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quiver import portable
from tests.support import ROOT

_CORE_WITHOUT_POSIX = r"""
import sys
import tests.support.without_fork_and_fcntl  # before Quiver: no fcntl, no os.register_at_fork
import numpy as np, onnx
from onnx import helper, numpy_helper, TensorProto
import quiver, quiver.ort
from quiver import portable
from quiver.formats import file_guard
assert portable.fcntl is None and file_guard._LIBC is None
folder = sys.argv[1]
weight = np.arange(12, dtype=np.float32).reshape(3, 4)
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                          [numpy_helper.from_array(weight, "w")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
onnx.save(model, f"{folder}/m.onnx")
x = np.ones((2, 3), np.float32)
with quiver.Context.create("cpu", workdir=folder) as context:
    context.add_graph("m", f"{folder}/m.onnx")
    path = context.save(f"{folder}/m.qctx")
with quiver.Context.from_binary(path) as context:
    assert np.array_equal(context.graph("m").execute({"x": x})["y"], x @ weight)
session = quiver.ort.InferenceSession(f"{folder}/m.onnx")
assert np.array_equal(session.run(None, {"x": x})[0], x @ weight)
print("ran")
"""


def test_the_core_builds_saves_loads_and_runs_without_fcntl_and_fork_hooks(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CORE_WITHOUT_POSIX, str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ran"


@pytest.mark.skipif(portable.fcntl is None, reason="flock is POSIX's")
def test_a_held_lock_refuses_another_process_until_it_is_let_go(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        portable.lock_file(fd)
        probe = (
            "import os, sys; from quiver import portable; portable.lock_file(os.open(sys.argv[1], os.O_RDWR), False)"
        )
        held = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60)
        assert held.returncode != 0 and "BlockingIOError" in held.stderr
        portable.unlock_file(fd)
        free = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60)
        assert free.returncode == 0, free.stderr
    finally:
        os.close(fd)


def test_fork_hooks_are_registered_only_where_the_os_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(os, "register_at_fork", lambda **hooks: calls.append(hooks), raising=False)
    portable.at_fork(after_in_child=print)
    assert calls == [{"after_in_child": print}]
    monkeypatch.delattr(os, "register_at_fork")
    portable.at_fork(after_in_child=print)  # nothing to register, nothing raised
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("environ", "mode", "libc", "tunables"),
    [
        ({}, "madvise", ("glibc", "2.36"), "glibc.malloc.hugetlb=1"),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", ("glibc", "2.35"),
         "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),  # the user's tunables kept
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", ("glibc", "2.36"), None),  # the user chose
        ({"QUIVER_HUGE_PAGES": "0"}, "madvise", ("glibc", "2.36"), None),
        ({"QUIVER_HUGE_PAGES": "1"}, "madvise", ("glibc", "2.36"), None),  # asked already
        ({}, "always", ("glibc", "2.36"), None),  # huge pages anyway
        ({}, "never", ("glibc", "2.36"), None),
        ({}, None, ("glibc", "2.36"), None),  # no THP in this kernel (or not Linux)
        ({}, "madvise", ("glibc", "2.34"), None),  # a glibc without the tunable
        ({}, "madvise", ("", ""), None),  # musl, macOS, Windows
    ],
)  # fmt: skip
def test_malloc_is_asked_for_huge_pages_only_where_that_changes_something(
    environ: dict[str, str], mode: str | None, libc: tuple[str, str], tunables: str | None
) -> None:
    changed = portable.huge_page_environment(environ, mode=lambda: mode, libc=lambda: libc)
    assert (changed and changed["GLIBC_TUNABLES"]) == tunables
    if changed is not None:  # the rest kept; marked as asked, so a process started with it does not ask again
        assert changed == environ | {"GLIBC_TUNABLES": tunables, "QUIVER_HUGE_PAGES": "1"}
        assert portable.huge_page_environment(changed, mode=lambda: mode, libc=lambda: libc) is None


_RESTARTS = r"""
import os, sys
from quiver.cli import entry
calls = []
entry.os.execve = lambda path, argv, environ: calls.append((path, argv, environ.get("GLIBC_TUNABLES")))
entry.portable.huge_page_environment = lambda environ: dict(environ) | {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
for args in (["serve", "-c", "x"], ["--version"], ["t2t", "run"], ["info", "serve"], ["-h"], ["t2t", "export"]):
    calls.clear()
    entry.restart_with_huge_pages(args)
    print("-".join(args[:2]), bool(calls) and calls[0][1] == sys.orig_argv and calls[0][0] == sys.executable)
"""


def test_only_decoding_commands_restart_with_the_same_command_line() -> None:
    result = subprocess.run([sys.executable, "-c", _RESTARTS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    restarted = dict(zip(*[iter(result.stdout.split())] * 2))
    assert restarted == {"serve--c": "True", "t2t-run": "True", "--version": "False", "info-serve": "False",
                         "-h": "False", "t2t-export": "False"}  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "tunables"),
    [
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "QUIVER_HUGE_PAGES": "1"}, "glibc.malloc.hugetlb=1"),  # restarted
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "glibc.malloc.hugetlb=0"),  # the user's choice, carried
        ({"QUIVER_HUGE_PAGES": "0"}, None),
        ({}, "glibc.malloc.hugetlb=1"),  # what this process would have asked for
    ],
)
def test_a_replica_started_elsewhere_gets_this_process_choice_of_huge_pages(
    environ: dict[str, str], tunables: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(portable, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(portable, "_libc", lambda: ("glibc", "2.36"))
    assert portable.huge_page_tunables(environ) == tunables


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through the C library: Linux's")
def test_the_c_library_is_reached_through_portable_alone() -> None:
    """One handle, with the prototypes of the calls made: madvise (MADV_DONTNEED on private memory reads
    back as zeros, whole pages only), malloc_trim, fflush; a call the library lacks is None."""
    import ctypes
    import mmap

    memory = portable.zeros_on_demand(4 * mmap.PAGESIZE)
    memory[:] = b"\x01" * len(memory)
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    portable.advise_pages(start + 10, 2 * mmap.PAGESIZE, mmap.MADV_DONTNEED)  # covers page 1 only, whole
    assert memory[: mmap.PAGESIZE] == b"\x01" * mmap.PAGESIZE
    assert memory[mmap.PAGESIZE : 2 * mmap.PAGESIZE] == b"\x00" * mmap.PAGESIZE
    assert memory[2 * mmap.PAGESIZE :] == b"\x01" * (2 * mmap.PAGESIZE)
    portable.return_freed_memory()
    portable.flush_c_streams()
    assert portable.c_call("no_such_call") is None and portable.c_call("madvise") is not None


def test_a_file_read_afresh_keeps_its_bytes_under_a_live_mapping(tmp_path: Path) -> None:
    """`cache_afresh` drops a written file's cached pages and reads them back: a mapping of it, made before,
    reads the same bytes after, as does the file."""
    import mmap

    path = tmp_path / "weights"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        assert mapping[: 1 << 20] == data[: 1 << 20]  # some of its pages mapped, the rest not yet
        portable.cache_afresh(f.fileno())
        assert mapping[:] == data
        mapping.close()
    assert path.read_bytes() == data


def test_a_saved_context_is_read_afresh_once_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saving a context syncs it, then has the page cache read it afresh (its pages then mapped 2 MB at a
    time): the file advised is the one published."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import quiver

    advised: list[tuple[int, int]] = []
    cache_afresh = portable.cache_afresh

    def spy(fd: int) -> None:
        status = os.fstat(fd)
        advised.append((status.st_dev, status.st_ino))
        cache_afresh(fd)

    monkeypatch.setattr(portable, "cache_afresh", spy)
    weight = np.arange(12, dtype=np.float32).reshape(3, 4)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    with quiver.Context.create("reference", workdir=tmp_path) as context:
        context.add_graph("m", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        path = context.save(tmp_path / "m.qctx")
    status = path.stat()
    assert advised == [(status.st_dev, status.st_ino)]
    with quiver.Context.from_binary(path, backend="reference") as context:
        x = np.ones((2, 3), np.float32)
        assert np.array_equal(context.graph("m").execute({"x": x})["y"], x @ weight)

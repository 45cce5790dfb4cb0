"""File lifetime: files are replaced, never rewritten; reads are bounded; temp files do not outlive kills."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

import quiver
from quiver import portable
from quiver.formats.layout import PREAMBLE_SIZE, Preamble
from quiver.formats.reader import ContextFile
from quiver.formats.section import SectionFile
from quiver.formats.writer import TEMPORARY_PREFIX, ContextWriter
from tests.stress.concurrency import LoraProject, X, make_lora_project
from tests.support.cli import assert_one_line_error
from tests.support.cli import quiver as run_cli
from tests.support.lora_branch import branch_adapter as _adapter
from tests.support.lora_branch import branch_expected as _expected
from tests.support.lora_branch import lora_branch_model as _lora_model


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> LoraProject:
    return make_lora_project(tmp_path_factory.mktemp("lora"))


def _context(path: Path, seed: int) -> Path:
    """A context whose LoRA branch holds adapter `seed` (so two contexts differ in their weights)."""
    model = _lora_model()
    for tensor in model.graph.initializer:
        if tensor.name in ("lora_A", "lora_B"):
            tensor.CopyFrom(numpy_helper.from_array(_adapter(seed)[tensor.name], tensor.name))
    with quiver.Context.create("cpu", workdir=path.parent) as context:
        context.add_graph("lora", model, updateable=["lora_A", "lora_B"])
        return context.save(path)


def test_save_writes_the_bytes_the_context_holds_not_what_now_lies_at_its_path(tmp_path: Path) -> None:
    first = _context(tmp_path / "a.qctx", 1)
    held = first.read_bytes()
    with quiver.Context.from_binary(first) as context:
        os.replace(_context(tmp_path / "b.qctx", 2), first)  # replaced under the live context
        context.save(tmp_path / "copy.qctx")
    assert (tmp_path / "copy.qctx").read_bytes() == held


def test_a_replaced_context_is_loaded_anew_by_new_shared_sessions(tmp_path: Path) -> None:
    from quiver.ort.epcontext import wrap_context

    wrap_context(_context(tmp_path / "lora.qctx", 1), tmp_path)
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("ep.share_ep_contexts", "1")
    model = str(tmp_path / "lora_ctx.onnx")
    old = quiver.ort.InferenceSession(model, options)
    np.testing.assert_allclose(
        old.run(None, {"x": X[:, :16]})[0], _expected(X[:, :16], _adapter(1)), rtol=1e-4, atol=1e-4
    )
    os.replace(_context(tmp_path / "new.qctx", 2), tmp_path / "lora.qctx")
    new = quiver.ort.InferenceSession(model, options)
    np.testing.assert_allclose(
        new.run(None, {"x": X[:, :16]})[0], _expected(X[:, :16], _adapter(2)), rtol=1e-4, atol=1e-4
    )
    # the session opened before keeps the file it loaded
    np.testing.assert_allclose(
        old.run(None, {"x": X[:, :16]})[0], _expected(X[:, :16], _adapter(1)), rtol=1e-4, atol=1e-4
    )
    old.close()
    new.close()


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_only_regular_files_are_read_and_nothing_blocks(tmp_path: Path, kind: str) -> None:
    path = {"fifo": tmp_path / "pipe", "device": Path("/dev/zero"), "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    start = time.monotonic()
    for open_file in (ContextFile.open, SectionFile.open, quiver.Context.from_binary):
        with pytest.raises(quiver.FileAccessError, match="regular file|folder"):
            open_file(path)
    with pytest.raises(quiver.FileAccessError):
        quiver.Context.from_binary(_context(tmp_path / "c.qctx", 1)).apply_binary_section("lora", path)
    assert time.monotonic() - start < 5
    for command in ("inspect", "verify"):
        result = run_cli(command, path)
        if kind == "folder":  # refused by the command line parser: a usage error
            assert result.returncode == 2 and "is a directory" in result.stderr
        else:
            assert_one_line_error(result, "not a regular file")


def test_a_nul_in_a_path_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(quiver.FileAccessError, match="NUL"):
        quiver.Context.from_binary(str(tmp_path / "a\0b.qctx"))


def test_a_sparse_section_with_a_huge_hole_is_refused_without_reading_it(tmp_path: Path) -> None:
    with quiver.Context.from_binary(_context(tmp_path / "c.qctx", 1)) as context:
        data = context.get_binary_section("lora")
    magic, pre = Preamble.unpack(data[:PREAMBLE_SIZE])
    hole = 1 << 30
    header = data[pre.header_offset :]
    moved = Preamble(
        pre.major, pre.minor, pre.flags, pre.header_offset + hole, len(header), len(data) + hole, pre.header_sha256
    )
    path = tmp_path / "sparse.qsec"
    with open(path, "wb") as out:  # 1 GiB of hole before the header: a sparse file of a few KB on disk
        out.write(moved.pack(magic) + data[PREAMBLE_SIZE : pre.header_offset])
        out.seek(pre.header_offset + hole)
        out.write(header)
    start = time.monotonic()
    with pytest.raises(quiver.OutOfBoundsError, match="more than alignment allows"):
        SectionFile.open(path, persistent=False)
    assert time.monotonic() - start < 1


def test_a_npy_header_claiming_more_than_the_file_holds_is_an_input_list_error(tmp_path: Path) -> None:
    from quiver.runtime.netrun import parse_input_list

    np.save(tmp_path / "x.npy", np.zeros((2, 16), np.float32))
    data = (tmp_path / "x.npy").read_bytes().replace(b"(2, 16)", b"(10000000, 100000)")
    (tmp_path / "x.npy").write_bytes(data)
    (tmp_path / "list.txt").write_text(f"x:={tmp_path / 'x.npy'}\n")
    with quiver.Context.from_binary(_context(tmp_path / "c.qctx", 1)) as context:
        with pytest.raises(quiver.InputListError, match="not a readable .npy"):
            parse_input_list(tmp_path / "list.txt", context.graph("lora"))


_TRUNCATE_UNDER_A_LIVE_CONTEXT = """
import os, sys, numpy as np, quiver
path = sys.argv[1]
context = quiver.Context.from_binary(path)
graph = context.graph("lora")
x = np.ones((2, 16), np.float32)
graph.execute({"x": x})
os.truncate(path, 8192)  # someone else's in-place write: Quiver's own commands replace files
for attempt in (lambda: graph.execute({"x": x}), context.file.verify):
    try:
        attempt()
        print("no error")
    except quiver.FileChangedError as exc:
        print("FileChangedError")
"""


def test_a_context_file_truncated_in_place_is_refused_not_a_crash(tmp_path: Path) -> None:
    path = _context(tmp_path / "c.qctx", 1)
    result = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_UNDER_A_LIVE_CONTEXT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr  # 135 would be SIGBUS
    assert result.stdout.split() == ["FileChangedError", "FileChangedError"]


def test_an_applied_section_keeps_its_values_whatever_happens_to_its_file(project: LoraProject, tmp_path: Path) -> None:
    section = tmp_path / "strong.qsec"
    section.write_bytes(project.section("strong").read_bytes())
    with quiver.Context.from_binary(project.context) as context:
        context.apply_binary_section("model", section)
        before = context.graph("model").execute({"x": X})["y"]
        with open(section, "r+b") as handle:  # rewritten in place, then truncated
            handle.seek(4096)
            handle.write(b"\xff" * 64)
            handle.truncate(5000)
        np.testing.assert_array_equal(context.graph("model").execute({"x": X})["y"], before)


def test_lora_prepare_replaces_sections_so_live_processes_keep_theirs(project: LoraProject) -> None:
    before = {p.name: os.stat(p).st_ino for p in project.folder.glob("*.qsec")}
    from quiver.lora.prepare import prepare

    prepare(project.folder.parent / "lora.yaml", project.folder)
    after = {p.name: os.stat(p).st_ino for p in project.folder.glob("*.qsec")}
    assert before.keys() == after.keys() and all(before[n] != after[n] for n in before)


_KILLED_WRITER = """
import os, sys
from quiver.formats.writer import ContextWriter
writer = ContextWriter(sys.argv[1])
writer.add_weight("float32", [1024], [bytes(4096)])
print(writer._path, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
sys.stdin.read()  # a writer that lives until the test closes its stdin
"""


@pytest.mark.skipif(not portable.CAN_LOCK, reason="a killed writer is told from a living one by its file lock")
def test_temporary_files_of_killed_writers_are_removed_by_the_next_writer(tmp_path: Path) -> None:
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path), "kill"], capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -9
    left = Path(killed.stdout.strip())
    assert left.exists() and left.name.startswith(TEMPORARY_PREFIX)
    living = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path), "live"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert living.stdout is not None
    busy = Path(living.stdout.readline().strip())
    past = time.time() - 60  # both older than the grace period a just-created file gets
    os.utime(left, (past, past))
    os.utime(busy, (past, past))
    ContextWriter(tmp_path).abort()
    assert not left.exists()  # its writer is gone: removed
    assert busy.exists()  # its writer still holds its lock: kept
    living.communicate("", timeout=60)


def test_quiver_build_leaves_no_temporary_file_behind_after_a_kill(
    tmp_path: Path, family_files: dict[str, Path]
) -> None:
    base = family_files["base"]
    build = [sys.executable, "-m", "quiver", "build", str(base), "-o", str(tmp_path / "out.qctx")]
    process = subprocess.Popen(build, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f"{TEMPORARY_PREFIX}*")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.005)
    process.kill()
    process.wait()
    assert list(tmp_path.glob(f"{TEMPORARY_PREFIX}*")), "killed before or after its temporary file existed"
    for left in tmp_path.glob(f"{TEMPORARY_PREFIX}*"):
        os.utime(left, (time.time() - 60, time.time() - 60))
    result = run_cli("build", base, "-o", tmp_path / "out.qctx")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.qctx"]


def test_a_file_replaced_before_its_first_run_still_runs_the_weights_it_was_opened_with(
    family_files: dict[str, Path], tmp_path: Path, input_ids: np.ndarray
) -> None:
    """ORT reads weights from the context's file by name: a file replaced under a live context must not
    hand it the new file's bytes (its weights then go to ORT from the mapping, in memory)."""
    import onnx
    import onnxruntime as ort

    other = onnx.load(str(family_files["base"]))  # the same structure, every weight another value
    for index, tensor in enumerate(other.graph.initializer):
        value = numpy_helper.to_array(tensor)
        if value.dtype == np.float32:
            moved = (value * 1.5 + 0.01).astype(np.float32)  # float32 on numpy 1.26 too (0-d arrays promote)
            other.graph.initializer[index].CopyFrom(numpy_helper.from_array(moved, tensor.name))
    onnx.save(other, str(tmp_path / "other.onnx"))
    paths = {}
    for name, source in (("base", family_files["base"]), ("finetune_1", tmp_path / "other.onnx")):
        builder = quiver.Context.create("cpu")
        builder.add_graph("g", source)
        paths[name] = builder.save(tmp_path / f"{name}.qctx", prepare_ahead=False)  # ORT optimizes at open
        builder.close()
    with quiver.Context.from_binary(paths["base"]) as context:
        os.replace(paths["finetune_1"], paths["base"])  # replaced, not rewritten: the mapping stays the old file
        ours = context.graph("g").execute({"input_ids": input_ids})["last_hidden_state"]
    base = ort.InferenceSession(str(family_files["base"]), providers=["CPUExecutionProvider"])
    tuned = ort.InferenceSession(str(tmp_path / "other.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(ours, base.run(None, {"input_ids": input_ids})[0], atol=1e-5)
    assert not np.allclose(ours, tuned.run(None, {"input_ids": input_ids})[0], atol=1e-3)

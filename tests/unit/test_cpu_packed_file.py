"""Packed weights kept in a file (`CpuBackend(packed_weights=FOLDER)`): made once, checked, mapped by every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import quiver
from quiver.backends import cpu
from quiver.backends.cpu import packed_file
from quiver.errors import BackendError
from tests.support.helpers import executables

# Opens the family context with a packed-weights folder in a fresh process; prints what its graph gave, the
# folder its sessions come from, and whether this process maps that folder's weights file.
_OPEN = r"""
import json, sys
import numpy as np
import quiver
from quiver.backends import cpu
from tests.support.helpers import executables
context = quiver.Context.from_binary(sys.argv[1], backend=cpu.CpuBackend(packed_weights=sys.argv[2]))
ids = np.array(json.loads(sys.argv[3]), np.int64)
out = context.graph("base").execute({"input_ids": ids})["last_hidden_state"]
folder = executables(context)["base"].packed_file
maps = open("/proc/self/maps").read()
print(json.dumps({"out": out.tolist(), "folder": str(folder), "mapped": f"{folder}/weights.bin" in maps}))
"""


def _base(context: quiver.Context, ids: np.ndarray) -> np.ndarray:
    return context.graph("base").execute({"input_ids": ids})["last_hidden_state"]


def _packed_base(context_path: Path | bytes, folder: Path, ids: np.ndarray) -> np.ndarray:
    return _base(quiver.Context.from_binary(context_path, backend=cpu.CpuBackend(packed_weights=folder)), ids)


def _forms(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir())


def _open_elsewhere(context_path: Path, folder: Path, ids: np.ndarray) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", _OPEN, str(context_path), str(folder), json.dumps(ids.tolist())]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.getcwd())


def _result(process: subprocess.Popen[str]) -> dict:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-2000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_a_graph_opened_with_a_folder_runs_from_its_packed_file_with_the_same_outputs(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path
) -> None:
    expected = _base(quiver.Context.from_binary(family_context, backend=cpu.CpuBackend(lazy_prepack=False)), input_ids)
    context = quiver.Context.from_binary(family_context, backend=cpu.CpuBackend(packed_weights=tmp_path))
    np.testing.assert_array_equal(_base(context, input_ids), expected)
    executable = executables(context)["base"]
    assert isinstance(executable, cpu.CpuExecutable)
    (form,) = _forms(tmp_path)
    assert executable.packed_file == form and executable.is_packed and executable.private_bytes == 0
    manifest = json.loads((form / packed_file.MANIFEST).read_text())
    assert set(manifest["files"]) == {packed_file.MODEL, packed_file.WEIGHTS}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".making-")]


def test_another_process_maps_the_form_made_before_instead_of_making_one(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path
) -> None:
    context = quiver.Context.from_binary(family_context, backend=cpu.CpuBackend(packed_weights=tmp_path))
    expected = _base(context, input_ids)
    (form,) = _forms(tmp_path)
    made = (form / packed_file.WEIGHTS).stat()
    theirs = _result(_open_elsewhere(family_context, tmp_path, input_ids))
    np.testing.assert_array_equal(np.array(theirs["out"], np.float32), expected)
    assert theirs["folder"] == str(form) and theirs["mapped"]
    again = (form / packed_file.WEIGHTS).stat()
    assert (again.st_ino, again.st_mtime_ns) == (made.st_ino, made.st_mtime_ns)


def test_processes_that_start_together_make_one_form(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path
) -> None:
    processes = [_open_elsewhere(family_context, tmp_path, input_ids) for _ in range(3)]
    results = [_result(p) for p in processes]
    (form,) = _forms(tmp_path)
    assert all(r["folder"] == str(form) and r["mapped"] for r in results)
    assert results[0]["out"] == results[1]["out"] == results[2]["out"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".making-", ".damaged-"))]


def test_a_damaged_form_is_made_again_not_used(family_context: Path, input_ids: np.ndarray, tmp_path: Path) -> None:
    expected = _packed_base(family_context, tmp_path, input_ids)
    (form,) = _forms(tmp_path)
    weights = form / packed_file.WEIGHTS
    with open(weights, "r+b") as handle:  # a disk error: one byte changed under the form
        handle.seek(weights.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    damaged = weights.stat().st_ino
    context = quiver.Context.from_binary(family_context, backend=cpu.CpuBackend(packed_weights=tmp_path))
    np.testing.assert_array_equal(_base(context, input_ids), expected)
    assert _forms(tmp_path) == [form] and (form / packed_file.WEIGHTS).stat().st_ino != damaged


def _counting_crcs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files whose CRC-32 is read from now on."""
    read: list[str] = []
    crc = packed_file._file_crc

    def counted(path: Path) -> int:
        read.append(path.name)
        return crc(path)

    monkeypatch.setattr(packed_file, "_file_crc", counted)
    return read


def test_a_form_checked_whole_is_not_read_again_until_a_file_changes(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packed_file, "RACY_CHANGE_S", 0.05)
    expected = _packed_base(family_context, tmp_path, input_ids)
    (form,) = _forms(tmp_path)
    assert not (form / packed_file.CHECKED).exists()  # its files changed just before their check
    time.sleep(0.1)
    read = _counting_crcs(monkeypatch)
    np.testing.assert_array_equal(_packed_base(family_context, tmp_path, input_ids), expected)
    assert sorted(read) == [packed_file.MODEL, packed_file.WEIGHTS] and (form / packed_file.CHECKED).exists()
    read.clear()
    np.testing.assert_array_equal(_packed_base(family_context, tmp_path, input_ids), expected)
    assert read == []  # stamped: the same files, not read again
    weights = form / packed_file.WEIGHTS
    with open(weights, "r+b") as handle:  # one byte changed in place, after the stamp
        handle.seek(weights.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    damaged = weights.stat().st_ino
    np.testing.assert_array_equal(_packed_base(family_context, tmp_path, input_ids), expected)
    assert packed_file.WEIGHTS in read and (form / packed_file.WEIGHTS).stat().st_ino != damaged  # made again


def test_making_a_form_reads_each_file_once_for_its_crc(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = _counting_crcs(monkeypatch)
    _packed_base(family_context, tmp_path, input_ids)
    assert sorted(read) == [packed_file.MODEL, packed_file.WEIGHTS]  # for the manifest, not again after it


@pytest.mark.parametrize("stamp", ["not json", '{"format": 1, "files": {}}', "other files"])
def test_a_stamp_for_other_files_or_a_malformed_one_means_a_full_check(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stamp: str
) -> None:
    expected = _packed_base(family_context, tmp_path, input_ids)
    (form,) = _forms(tmp_path)
    if stamp == "other files":  # the stamp's shape, the files' identities off by one inode
        identity = packed_file._identity(form)
        identity[packed_file.WEIGHTS][1] += 1
        stamp = json.dumps({"format": 1, "files": identity})
    (form / packed_file.CHECKED).write_text(stamp)
    read = _counting_crcs(monkeypatch)
    np.testing.assert_array_equal(_packed_base(family_context, tmp_path, input_ids), expected)
    assert sorted(read) == [packed_file.MODEL, packed_file.WEIGHTS]


@pytest.mark.parametrize("damage", ["manifest", "truncated", "missing"])
def test_a_form_with_a_bad_manifest_or_file_is_not_used(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path, damage: str
) -> None:
    expected = _packed_base(family_context, tmp_path, input_ids)
    (form,) = _forms(tmp_path)
    if damage == "manifest":
        (form / packed_file.MANIFEST).write_text('{"format": 1, "files": {"model.onnx": 3}}')
    elif damage == "truncated":
        os.truncate(form / packed_file.MODEL, 100)
    else:
        (form / packed_file.WEIGHTS).unlink()
    context = quiver.Context.from_binary(family_context, backend=cpu.CpuBackend(packed_weights=tmp_path))
    np.testing.assert_array_equal(_base(context, input_ids), expected)
    assert json.loads((form / packed_file.MANIFEST).read_text())["files"][packed_file.MODEL]["size"] > 100


def test_a_folder_that_cannot_be_written_says_what_to_do(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with pytest.raises(BackendError, match="cannot keep packed weights in .*writable folder"):
        _packed_base(family_context, blocked, input_ids)


def test_a_context_held_in_memory_packs_in_its_process(
    family_context: Path, input_ids: np.ndarray, tmp_path: Path
) -> None:
    context = quiver.Context.from_binary(family_context.read_bytes(), backend=cpu.CpuBackend(packed_weights=tmp_path))
    _base(context, input_ids)
    assert executables(context)["base"].packed_file is None and not _forms(tmp_path)  # no file names its weights


@pytest.mark.parametrize(
    ("value", "expected"), [(None, None), ("off", None), ("", None), ("/srv/packed", Path("/srv/packed"))]
)
def test_folder_options(value: str | None, expected: Path | None) -> None:
    assert packed_file.folder_from(value) == expected


def test_the_default_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(packed_file.FOLDER_ENV, str(tmp_path / "here"))
    assert packed_file.folder_from("default") == tmp_path / "here"
    monkeypatch.setenv(packed_file.FOLDER_ENV, "off")
    assert packed_file.folder_from("default") is None
    monkeypatch.delenv(packed_file.FOLDER_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert packed_file.folder_from("default") == tmp_path / "cache" / "quiver" / "packed-weights"

"""Another program truncating a mapped context never kills the process that runs it (formats/file_guard)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quiver.formats import file_guard

pytestmark = pytest.mark.skipif(file_guard._LIBC is None, reason="file leases are Linux's")

# Runs each context named on stdin until it is refused: "ready" once it is open, then how it ended.
_RUNNER = """
import sys, numpy as np, quiver
import quiver.formats.file_guard
if sys.argv[1] == "unguarded":
    quiver.formats.file_guard._LIBC = None
for line in sys.stdin:
    with quiver.Context.from_binary(line.strip()) as context:
        graph = context.graph("base")
        print("ready", flush=True)
        outcome = "ran"
        for _ in range(500):
            try:
                graph.execute({"input_ids": np.ones((2, 12), np.int64)})
            except quiver.FileChangedError:
                outcome = "refused"
                break
        print(outcome, flush=True)
"""


def _truncate_during_first_runs(context: Path, folder: Path, count: int, mode: str) -> tuple[list[str], int]:
    """Opens `count` copies in one runner process and truncates each, at a random length, a random 0-50 ms
    after it opened; the outcomes, and the runner's exit status (negative: the signal that ended it)."""
    rng = random.Random(17)
    runner = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert runner.stdin is not None and runner.stdout is not None
    outcomes = []
    try:
        for i in range(count):
            copy = folder / f"copy{i}.qctx"
            shutil.copyfile(context, copy)
            runner.stdin.write(f"{copy}\n")
            runner.stdin.flush()
            if runner.stdout.readline().strip() != "ready":
                break
            time.sleep(rng.random() * 0.05)
            os.truncate(copy, rng.randrange(copy.stat().st_size))
            outcome = runner.stdout.readline().strip()
            copy.unlink()
            if not outcome:
                break  # the runner died
            outcomes.append(outcome)
        runner.stdin.close()
    finally:
        status = runner.wait(120)
    return outcomes, status


def test_truncating_a_context_at_random_points_of_its_first_runs_never_kills_the_process(
    family_context: Path, tmp_path: Path
) -> None:
    outcomes, status = _truncate_during_first_runs(family_context, tmp_path, 200, "guarded")
    assert status == 0 and len(outcomes) == 200
    assert outcomes.count("refused") == 200  # every truncation noticed: later runs refused, typed


def test_without_the_guard_the_same_truncations_kill_the_process(family_context: Path, tmp_path: Path) -> None:
    # what the guard prevents: a read of a truncated mapping is SIGBUS, which no Python code can catch
    _, status = _truncate_during_first_runs(family_context, tmp_path, 50, "unguarded")
    assert status == -7  # SIGBUS


def test_a_forked_child_is_guarded_too_and_a_closed_context_holds_no_lease(
    family_context: Path, tmp_path: Path
) -> None:
    import numpy as np

    import quiver

    copy = tmp_path / "copy.qctx"
    shutil.copyfile(family_context, copy)
    held = set(file_guard.WATCHER._files)  # other tests' contexts still open in this process
    context = quiver.Context.from_binary(copy)
    graph = context.graph("base")
    graph.execute({"input_ids": np.ones((2, 12), np.int64)})
    assert len(set(file_guard.WATCHER._files) - held) == 1
    ready, go = os.pipe()
    child = os.fork()
    if child == 0:  # runs until the parent truncates the file: refused, never killed
        os.write(go, b"r")
        outcome = 2
        for _ in range(2000):
            try:
                graph.execute({"input_ids": np.ones((2, 12), np.int64)})
            except quiver.FileChangedError:
                outcome = 0
                break
        os._exit(outcome)
    os.read(ready, 1)
    time.sleep(0.05)
    os.truncate(copy, 4096)
    assert os.waitpid(child, 0)[1] == 0  # exit status 0: refused; a signal would show here
    context.close()
    assert set(file_guard.WATCHER._files) == held
    shutil.copyfile(family_context, copy)
    start = time.monotonic()
    with quiver.Context.from_binary(copy):
        pass
    os.truncate(copy, 10)  # nothing to wait for once the context is closed: no lease is held
    assert time.monotonic() - start < 1.0


_REWRITE_IN_PLACE = """
import os, sys
path = sys.argv[1]
info = os.stat(path)
with open(path, "r+b") as f:  # the weights' bytes changed where they lie, size kept
    f.seek(info.st_size // 2)
    f.write(b"\\xff" * 4096)
os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))  # and the mtime put back
"""


def test_a_context_rewritten_in_place_with_its_mtime_restored_is_refused_not_run(
    family_context: Path, tmp_path: Path
) -> None:
    import numpy as np

    import quiver

    copy = tmp_path / "copy.qctx"
    shutil.copyfile(family_context, copy)
    feeds = {"input_ids": np.ones((2, 12), np.int64)}
    with quiver.Context.from_binary(copy) as context:
        graph = context.graph("base")
        before = graph.execute(feeds)
        subprocess.run([sys.executable, "-c", _REWRITE_IN_PLACE, str(copy)], check=True, timeout=60)
        with pytest.raises(quiver.FileChangedError):
            graph.execute(feeds)
    assert all(np.isfinite(v).all() for v in before.values())


@pytest.mark.skipif(file_guard._LIBC is None, reason="the guard needs Linux's memfd and mremap")
def test_a_mapping_that_goes_away_while_it_is_copied_is_skipped_not_a_crash() -> None:
    import mmap

    # ORT maps a context file while it makes a session and unmaps it after: the watcher may find such a
    # mapping in /proc/self/maps and see it gone by the time it copies it
    area = mmap.mmap(-1, mmap.PAGESIZE * 4)
    area.write(b"x" * len(area))
    start = ctypes_address(area)
    area.close()  # unmapped: reading it would fault
    assert file_guard._replace_with_copy(start, mmap.PAGESIZE * 4) is False


def ctypes_address(area: object) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(area))  # type: ignore[arg-type]


def test_a_guard_released_while_the_watcher_holds_its_lock_does_not_deadlock(tmp_path: Path) -> None:
    """The garbage collector may run a context's finalizer, which releases its guard, in a thread that
    holds the watcher's lock (the watcher's own, allocating while it lists the files): that release must
    go through, not wait on itself."""
    import threading

    path = tmp_path / "guarded.bin"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        handle = file_guard.WATCHER.guard(fd, lambda: None)
        assert handle is not None
        released = threading.Event()

        def release_under_the_lock() -> None:
            with file_guard.WATCHER._lock:  # as a finalizer run inside the watcher's locked section
                file_guard.WATCHER.release(handle)
            released.set()

        threading.Thread(target=release_under_the_lock, daemon=True).start()
        assert released.wait(10)
        assert handle not in file_guard.WATCHER._files
    finally:
        os.close(fd)

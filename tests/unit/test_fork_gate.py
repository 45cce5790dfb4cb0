"""A fork waits for the ONNX Runtime work inside the gate, and the child finds the gate open."""

from __future__ import annotations

import os
import threading

import pytest

from quiver.backends.cpu import fork_waits
from quiver.backends.cpu.fork_gate import ForkGate

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")


def _child_status(check: bool) -> int:
    """Forks; the child exits at once with 0 if `check()` held in it, else 1."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if check() else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_fork_waits_for_the_work_inside_and_the_child_sees_it_finished() -> None:
    inside, may_leave = threading.Event(), threading.Event()
    left: list[bool] = []

    def work() -> None:
        with fork_waits():
            inside.set()
            may_leave.wait()
            left.append(True)  # the last thing the work does inside the gate

    worker = threading.Thread(target=work)
    worker.start()
    assert inside.wait(10)
    # Let the work finish only later: a fork that did not wait for it would copy `left` still empty.
    threading.Timer(0.2, may_leave.set).start()
    status = _child_status(lambda: left == [True])
    worker.join()
    assert status == 0


def test_work_after_a_fork_passes_in_the_parent_and_in_the_child() -> None:
    def passes() -> bool:
        with fork_waits():
            return True

    assert _child_status(passes) == 0
    assert passes()


def test_the_gate_lets_threads_in_together_and_close_waits_for_the_last() -> None:
    gate = ForkGate()
    entered, release = threading.Barrier(3), threading.Event()
    order: list[str] = []

    def work(name: str) -> None:
        with gate.passing():
            entered.wait()  # both workers inside at once: passing excludes nobody
            release.wait()
            order.append(name)

    workers = [threading.Thread(target=work, args=(name,)) for name in ("a", "b")]
    for worker in workers:
        worker.start()
    entered.wait()
    threading.Timer(0.2, release.set).start()
    gate.close()
    order.append("closed")
    gate.reopen()
    for worker in workers:
        worker.join()
    assert sorted(order[:2]) == ["a", "b"] and order[2] == "closed"

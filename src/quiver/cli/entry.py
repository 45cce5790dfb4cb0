"""The `quiver` command's first step: a command that decodes restarts once, before the CLI loads, with
glibc's malloc on huge pages (`quiver.portable.huge_page_environment`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from quiver import portable

# Commands that read every weight again at each decode step, for as long as they run (a server, a dialog,
# the tuning of its steps): their weights' packed copies in huge pages made decode 3-15 % faster (measured,
# SmolLM2 fp32 and int4). `t2t export` decodes nothing: it starts as it is.
DECODING_COMMANDS = (("serve",), ("t2t", "run"), ("t2t", "tune"))


def restart_with_huge_pages(args: Sequence[str]) -> None:
    """Replaces this process (`os.execve`: the same pid, the same command line) with one whose malloc asks
    for huge pages, when `args` run a decoding command and that would change anything; else returns."""
    from quiver.cli.root import command_words  # click alone: the rest of the CLI loads after the restart

    words = command_words(list(args))
    if not any(words[: len(command)] == command for command in DECODING_COMMANDS) or not sys.orig_argv:
        return
    environ = portable.huge_page_environment(os.environ)
    if environ is None:
        return
    try:
        os.execve(sys.executable, sys.orig_argv, environ)
    except OSError:  # the interpreter cannot be run again (a frozen or embedded one): go on as we are
        return


def main() -> int:
    restart_with_huge_pages(sys.argv[1:])
    from quiver.cli.main import main as run_cli

    code = run_cli()
    leave_without_waiting_for_packing(code)
    return code


def leave_without_waiting_for_packing(code: int) -> None:
    """Ends the process now when a float model's packed session is still being made in the background
    (`quiver t2t run` answers from the mapped weights first): the command is done, nothing will run on
    that session, and the interpreter would wait for it at exit (seconds, for a 1B model) before tearing
    ONNX Runtime down. Exit callbacks run and the streams are flushed first; nothing else is skipped but the
    wait and the C++ destructors (as a forked child ends: `quiver.fork`)."""
    executable = sys.modules.get("quiver.backends.cpu.executable")  # not loaded: nothing packs
    if executable is None or not executable.packing_in_background():
        return
    import atexit

    from quiver.fork import leave_now

    atexit._run_exitfuncs()
    leave_now(code)

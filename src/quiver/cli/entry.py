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

    return run_cli()

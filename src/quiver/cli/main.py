"""The `quiver` entry point: every command family registered, errors mapped to one line and an exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import click

from quiver.cli import context, lora, quantize, serve, t2t, tune  # noqa: F401  (each registers its commands)
from quiver.cli.common import cli, err_console, printable
from quiver.errors import QuiverError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: one-line errors on stderr, exit 1 for Quiver errors, 2 for usage errors."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="quiver", standalone_mode=False)
    except QuiverError as exc:
        err_console.print(f"quiver: error: {printable(str(exc))}", markup=False, highlight=False, soft_wrap=True)
        return 1
    except click.ClickException as exc:  # a usage error: one line too, with where the usage is
        command = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx is not None else None
        hint = f" (see '{command} --help')" if command else ""
        err_console.print(f"quiver: error: {printable(exc.format_message())}{hint}", markup=False, highlight=False,
                          soft_wrap=True)  # fmt: skip
        return 2
    except click.Abort:
        err_console.print("quiver: aborted")
        return 130
    except Exception as exc:  # never a traceback for users; QUIVER_DEBUG=1 shows it
        if os.environ.get("QUIVER_DEBUG"):
            raise
        err_console.print(
            f"quiver: internal error: {type(exc).__name__}: {exc} (set QUIVER_DEBUG=1 for details)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every `quiver` command shares: the click group, the consoles, --json output, progress, options."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from quiver.cli.root import cli as cli  # the group itself (in a module of its own: the entry point reads it first)

console = Console()
err_console = Console(stderr=True)


def as_mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def emit_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2))


def progress_bar(quiet: bool) -> Any:
    """A progress bar on a terminal. Elsewhere (a pipe, a log, CI) none at all: rich would still end its
    live display with a newline, and an error after it would not be the one line it must be."""
    if quiet or not err_console.is_terminal:
        return contextlib.nullcontext(_Silent())
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


def status_line(message: str) -> Any:
    """A spinner line on a terminal; nothing elsewhere (see `progress_bar`)."""
    return err_console.status(message) if err_console.is_terminal else contextlib.nullcontext(_Silent())


class _Silent:
    """Stands in for a progress bar or a status line where none is shown."""

    def add_task(self, *_: object, **__: object) -> int:
        return 0

    def update(self, *_: object, **__: object) -> None:
        pass

    def advance(self, *_: object, **__: object) -> None:
        pass


def parse_model_arg(text: str) -> tuple[Path, str]:
    """`MODEL.onnx[:GRAPH_NAME]`; the graph name defaults to the file's stem."""
    path_text, sep, name = text.rpartition(":")
    if sep and path_text and name and "/" not in name and "\\" not in name:
        return Path(path_text), name
    return Path(text), Path(text).stem


def named_path(value: str, what: str) -> tuple[str, Path]:
    """`NAME=PATH` (an adapter by name: `--lora`); anything else a usage error saying `what` PATH is."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise click.BadParameter(f"{value!r}: give NAME=PATH ({what})")
    return name, Path(path)


def parse_shape_args(values: Sequence[str]) -> dict[str, list[int | str]]:
    shapes: dict[str, list[int | str]] = {}
    for value in values:
        name, sep, dims = value.partition("=")
        if not sep or not name or not dims:
            raise click.BadParameter(f"{value!r}: write NAME=D0,D1,... (e.g. input_ids=1,128)")
        shapes[name] = [int(d) if d.strip().isdigit() else d.strip() for d in dims.split(",")]
    return shapes


input_shape_option = click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    metavar="NAME=D0,D1",
    help="Shape of raw input files for an input with dynamic dimensions; repeat for more inputs.",
)


def input_list_arg(_: object, __: object, values: Sequence[str]) -> tuple[tuple[str | None, Path], ...]:
    """`LIST` or `GRAPH=LIST` (a list for one graph: prefill and decode take the same input names)."""
    parsed: list[tuple[str | None, Path]] = []
    for value in values:
        graph, sep, path = value.partition("=")
        parsed.append((graph, Path(path)) if sep and graph and path and "/" not in graph else (None, Path(value)))
    return tuple(parsed)


tuning_input_lists_option = click.option(
    "--input-list",
    "input_lists",
    multiple=True,
    metavar="[GRAPH=]LIST",
    callback=input_list_arg,
    help="Sample inputs for tuning (qnn-net-run input list); GRAPH= gives a list to one graph. Repeat for more.",
)


def parse_file_shapes(values: Sequence[str]) -> dict[str, list[int]]:
    """Shapes of raw input files: every dimension a number."""
    try:
        return {name: [int(d) for d in dims] for name, dims in parse_shape_args(values).items()}
    except ValueError:
        raise click.BadParameter("input file shapes are numbers: NAME=1,128") from None


def printable(value: Any) -> Any:
    """Strings with control characters (names read from files: escape codes, bells) shown escaped,
    so printing what a file says can never drive the terminal. Dicts and lists are walked."""
    if isinstance(value, str):
        return "".join(c if c.isprintable() or c == "\n" else ascii(c)[1:-1] for c in value)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value

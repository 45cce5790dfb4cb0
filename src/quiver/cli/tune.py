"""`quiver tune` and `quiver target-server`: tuning mode from the command line, with QNN's option names."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from quiver.cli.common import (
    cli,
    console,
    emit_json,
    input_shape_option,
    parse_file_shapes,
    printable,
    status_line,
    tuning_input_lists_option,
)
from quiver.errors import TuningError
from quiver.formats.files import user_cache_folder
from quiver.runtime.context import Context

TOKEN_ENVIRONMENT = "QUIVER_TARGET_TOKEN"


def default_cache_dir() -> Path:
    return user_cache_folder("performance-cache")


def tuning_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options `quiver tune` and `quiver build` share (QNN's tuning config keys, and Quiver's)."""
    options = [
        click.option(
            "--config-file",
            type=click.Path(dir_okay=False, path_type=Path),
            help='Tuning config JSON: {"tuning_mode": true, "performance_cache_dir": D, '
            '"invalidate_performance_cache": false}.',
        ),
        click.option(
            "--performance-cache-dir",
            type=click.Path(file_okay=False, path_type=Path),
            help=f"Performance cache folder, one file per device tier (default {default_cache_dir()}).",
        ),
        click.option(
            "--invalidate-performance-cache", is_flag=True, help="Delete this device's cache file and measure again."
        ),
        click.option(
            "--target",
            metavar="HOST:PORT",
            help="Measure on a `quiver target-server` (default: $TARGET_SERVER_SOCKET, else this machine).",
        ),
        click.option("--token", help=f"The target server's shared token (default: ${TOKEN_ENVIRONMENT})."),
        click.option("--budget-s", type=click.FloatRange(min=1), help="Time budget for measuring (default 600 s)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def run_tuning(
    context: Context,
    lists: Sequence[tuple[str | None, Path]],
    graphs: Sequence[str],
    shapes: dict[str, list[int]],
    output: Path,
    config_file: Path | None = None,
    performance_cache_dir: Path | None = None,
    invalidate_performance_cache: bool = False,
    target: str | None = None,
    token: str | None = None,
    budget_s: float | None = None,
    workloads: Sequence[Any] = (),
) -> Any:
    """Tunes `context` as the options say (command line over config file) and writes `output`; the inputs
    come from input lists, or are given as `workloads`."""
    from quiver.tuning import read_tuning_config, tune_context
    from quiver.tuning.client import RemoteProfiler, target_from_environment
    from quiver.tuning.workload import workloads_from_input_lists

    if config_file is not None:
        config = read_tuning_config(config_file)
        if not config.tuning_mode:
            raise TuningError(f'{config_file} does not set "tuning_mode": true; nothing to tune')
        performance_cache_dir = performance_cache_dir or config.performance_cache_dir
        invalidate_performance_cache = invalidate_performance_cache or config.invalidate_performance_cache
        budget_s = budget_s or config.budget_s
    if not workloads:
        if not lists:
            raise TuningError("tuning measures graphs on sample inputs: give --input-list (QNN's input list format)")
        workloads = workloads_from_input_lists(context, lists, graphs, shapes)
    target = target or target_from_environment()
    profiler = RemoteProfiler(target, token or os.environ.get(TOKEN_ENVIRONMENT)) if target else None
    try:
        with status_line("tuning") as status:
            return tune_context(
                context,
                workloads,
                output,
                profiler=profiler,
                cache_dir=performance_cache_dir or default_cache_dir(),
                invalidate=invalidate_performance_cache,
                budget_s=budget_s or 600.0,
                on_progress=lambda message: status.update(printable(message)),
            )
    finally:
        if profiler is not None:
            profiler.close()


def print_tuning(result: Any) -> None:
    table = Table(title=f"tuned for {result.tier}")
    for column in ("graph", "default", "tuned", "speedup", "measured", "chosen (non-default)"):
        table.add_column(column, justify="left" if column in ("graph", "chosen (non-default)") else "right")
    for name, graph in result.graphs.items():
        chosen = ", ".join(f"{k}={v}" for k, v in graph.changed.items()) or "defaults"
        speedup = graph.default_ms / graph.tuned_ms if graph.tuned_ms else 1.0
        table.add_row(
            printable(name),
            f"{graph.default_ms:.3f} ms",
            f"{graph.tuned_ms:.3f} ms",
            f"{speedup:.2f}x",
            str(graph.measured) if graph.measured else "0 (cache)",
            chosen,
        )
    console.print(table)
    for note in result.notes:
        console.print(printable(note))
    if result.output is not None:
        console.print(f"wrote {result.output}; performance cache {result.cache}")


@cli.command()
@click.argument("context_path", metavar="CONTEXT.qctx", type=click.Path(dir_okay=False, path_type=Path))
@tuning_input_lists_option
@click.option("--graph", "graphs", multiple=True, help="Tune only this graph; repeat for more (default: all).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Tuned .qctx.")
@input_shape_option
@tuning_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def tune(
    context_path: Path,
    input_lists: tuple[tuple[str | None, Path], ...],
    graphs: tuple[str, ...],
    output: Path,
    input_shapes: tuple[str, ...],
    as_json: bool,
    **options: Any,
) -> None:
    """Measure backend settings per graph on this device (or a target server) and store the best in the context."""
    with Context.from_binary(context_path) as context:
        result = run_tuning(
            context,
            input_lists,
            graphs,
            parse_file_shapes(input_shapes),
            output,
            **options,
        )
    if as_json:
        emit_json(result.to_json())
    else:
        print_tuning(result)


@cli.command("target-server")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on (loopback by default).")
@click.option("--port", default=22598, show_default=True, type=click.IntRange(0, 65535))
@click.option("--token", help=f"A shared token clients must present (default: ${TOKEN_ENVIRONMENT}).")
@click.option(
    "--max-store-mb", default=8192, show_default=True, type=click.IntRange(1),
    help="Memory budget for everything kept for clients (tensors, uploads, input copies, messages).",
)  # fmt: skip
@click.option("--idle-timeout-s", default=120.0, show_default=True, type=click.FloatRange(min=1))
@click.option(
    "--auth-timeout-s", default=10.0, show_default=True, type=click.FloatRange(min=0.1),
    help="How long a new connection has to present the token.",
)  # fmt: skip
@click.option(
    "--max-clients", default=16, show_default=True, type=click.IntRange(1, 1024),
    help="Clients served at once (after their hello).",
)  # fmt: skip
def target_server(
    host: str,
    port: int,
    token: str | None,
    max_store_mb: int,
    idle_timeout_s: float,
    auth_timeout_s: float,
    max_clients: int,
) -> None:
    """Serve this device to remote tuners: prepare, profile and run graph variants (qnn-gpu-target-server)."""
    from quiver.tuning.server import TargetServer, return_large_blocks_to_the_system

    return_large_blocks_to_the_system()
    server = TargetServer(
        host,
        port,
        token or os.environ.get(TOKEN_ENVIRONMENT),
        max_store_bytes=max_store_mb << 20,
        idle_timeout_s=idle_timeout_s,
        auth_timeout_s=auth_timeout_s,
        max_clients=max_clients,
    )
    console.print(f"quiver target server on {server.host}:{server.port} (Ctrl-C stops it)")
    # Ctrl-C (SIGINT) and SIGTERM stop it however it was started: a shell starts background jobs with
    # SIGINT ignored, and Python then leaves it ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()

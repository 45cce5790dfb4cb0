"""The `quiver` command line: a thin layer over the Python API; errors are one line and a non-zero exit."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from quiver._version import __version__
from quiver.backends import available_backends
from quiver.errors import QuiverError
from quiver.formats.reader import ContextFile
from quiver.formats.writer import write_atomically, write_text_atomically
from quiver.runtime.context import Context

console = Console()
err_console = Console(stderr=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def _emit_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2))


def _progress(quiet: bool) -> Any:
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


def _status(message: str) -> Any:
    """A spinner line on a terminal; nothing elsewhere (see `_progress`)."""
    return err_console.status(message) if err_console.is_terminal else contextlib.nullcontext(_Silent())


class _Silent:
    """Stands in for a progress bar or a status line where none is shown."""

    def add_task(self, *_: object, **__: object) -> int:
        return 0

    def update(self, *_: object, **__: object) -> None:
        pass

    def advance(self, *_: object, **__: object) -> None:
        pass


def _parse_model_arg(text: str) -> tuple[Path, str]:
    """`MODEL.onnx[:GRAPH_NAME]`; the graph name defaults to the file's stem."""
    path_text, sep, name = text.rpartition(":")
    if sep and path_text and name and "/" not in name and "\\" not in name:
        return Path(path_text), name
    return Path(text), Path(text).stem


def _parse_shape_args(values: Sequence[str]) -> dict[str, list[int | str]]:
    shapes: dict[str, list[int | str]] = {}
    for value in values:
        name, sep, dims = value.partition("=")
        if not sep or not name or not dims:
            raise click.BadParameter(f"{value!r}: write NAME=D0,D1,... (e.g. input_ids=1,128)")
        shapes[name] = [int(d) if d.strip().isdigit() else d.strip() for d in dims.split(",")]
    return shapes


_input_shape = click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    metavar="NAME=D0,D1",
    help="Shape of raw input files for an input with dynamic dimensions; repeat for more inputs.",
)


def _input_list_arg(_: object, __: object, values: Sequence[str]) -> tuple[tuple[str | None, Path], ...]:
    """`LIST` or `GRAPH=LIST` (a list for one graph: prefill and decode take the same input names)."""
    parsed: list[tuple[str | None, Path]] = []
    for value in values:
        graph, sep, path = value.partition("=")
        parsed.append((graph, Path(path)) if sep and graph and path and "/" not in graph else (None, Path(value)))
    return tuple(parsed)


_tuning_input_lists = click.option(
    "--input-list",
    "input_lists",
    multiple=True,
    metavar="[GRAPH=]LIST",
    callback=_input_list_arg,
    help="Sample inputs for tuning (qnn-net-run input list); GRAPH= gives a list to one graph. Repeat for more.",
)


def _parse_file_shapes(values: Sequence[str]) -> dict[str, list[int]]:
    """Shapes of raw input files: every dimension a number."""
    try:
        return {name: [int(d) for d in dims] for name, dims in _parse_shape_args(values).items()}
    except ValueError:
        raise click.BadParameter("input file shapes are numbers: NAME=1,128") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quiver")
def cli() -> None:
    """Quiver: one base model, many fine-tunes, in one weight-shared context binary."""


@cli.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), help="Keep the models and context here.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def demo(workdir: Path | None, as_json: bool) -> None:
    """Build a base model and two fine-tunes into one context, run them, check them against ONNX Runtime."""
    from quiver.tools.demo import run_demo

    with _status("starting") as status:
        result = run_demo(workdir, on_step=lambda step: status.update(step))
    if as_json:
        _emit_json(
            {
                "context": str(result.path) if result.path else None,
                "context_bytes": result.context_bytes,
                "separate_bytes": result.separate_bytes,
                "unique_weight_bytes": result.unique_weight_bytes,
                "graphs": [dict(vars(r), matches=r.matches) for r in result.rows],
            }
        )
    else:
        table = Table(title="quiver demo: three graphs, one context (cpu backend vs. ONNX Runtime)")
        for column in ("graph", "own .onnx", "first output", "latency", "ORT latency", "max |diff|", "check"):
            table.add_column(column, justify="left" if column == "graph" else "right", no_wrap=column == "graph")
        for r in result.rows:
            table.add_row(
                r.graph,
                _mb(r.separate_bytes),
                f"{r.first_output_ms:.1f} ms",
                f"{r.latency_ms:.2f} ms",
                f"{r.ort_latency_ms:.2f} ms",
                f"{r.max_abs_diff:.1e}",
                "ok" if r.matches else "MISMATCH",
            )
        console.print(table)
        summary = Table(show_header=False, box=None)
        summary.add_row("stored separately", _mb(result.separate_bytes))
        summary.add_row(
            "one context",
            f"{_mb(result.context_bytes)} ({result.context_bytes / result.separate_bytes:.0%} of separate)",
        )
        summary.add_row("unique weights", _mb(result.unique_weight_bytes))
        summary.add_row("load (from_binary)", f"{result.rows[0].load_ms:.1f} ms")
        summary.add_row("context file", str(result.path) if result.path else "removed (--workdir DIR keeps it)")
        console.print(summary)
    if not all(r.matches for r in result.rows):
        raise QuiverError("outputs differ from ONNX Runtime by more than 1e-4; please report this")


@cli.command()
@click.argument("models", nargs=-1, required=True)
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The .qctx to write."
)
@click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    metavar="NAME=D0,D1",
    help="Fix an input's shape (every graph that has it); repeat for more inputs.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the sharing report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--config-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help='Tuning config JSON (QNN\'s keys): with "tuning_mode": true the context is tuned for this device.',
)
@_tuning_input_lists
def build(
    models: tuple[str, ...],
    output: Path,
    input_shapes: tuple[str, ...],
    as_json: bool,
    quiet: bool,
    config_file: Path | None,
    input_lists: tuple[tuple[str | None, Path], ...],
) -> None:
    """Pack MODEL.onnx[:GRAPH_NAME] ... into one context binary, each distinct weight stored once."""
    from quiver.passes.load import load_model
    from quiver.tools.report import describe_context

    shapes = _parse_shape_args(input_shapes)
    parsed = [_parse_model_arg(m) for m in models]
    output.parent.mkdir(parents=True, exist_ok=True)
    context = Context.create("cpu", workdir=output.parent)
    with _progress(quiet) as progress:
        task = progress.add_task("building", total=len(parsed))
        for path, name in parsed:
            progress.update(task, description=f"adding {name}")
            fixed = None
            if shapes:  # fix only the inputs this model has (a family may differ in its inputs)
                model_inputs = {i.name for i in load_model(path)[0].graph.input}
                fixed = {k: v for k, v in shapes.items() if k in model_inputs} or None
            context.add_graph(name, path, fixed)
            progress.advance(task)
        progress.update(task, description="writing")
        context.save(output)
    if config_file is not None:
        _tune_built(context, output, config_file, input_lists)
    report = describe_context(context, str(output))
    context.close()
    if as_json:
        _emit_json(report)  # JSON escapes control characters itself
        return
    report = printable(report)
    _print_graph_table(report, f"built {output}")
    _print_summary(report)


def _tune_built(
    context: Context, output: Path, config_file: Path, input_lists: Sequence[tuple[str | None, Path]]
) -> None:
    """`build --config-file`: QNN tunes while it generates the context binary; here, right after."""
    from quiver.tools.tune_cli import run_tuning
    from quiver.tuning import read_tuning_config

    config = read_tuning_config(config_file)
    if not config.tuning_mode:
        return  # a config without tuning mode (and without cache options: those are an error) tunes nothing
    run_tuning(context, input_lists, (), {}, output, config_file=config_file)


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


def _print_graph_table(report: dict[str, Any], title: str) -> None:
    table = Table(title=title)
    for column in ("graph", "inputs", "outputs", "weights", "own", "shared"):
        table.add_column(column, justify="right" if column in ("weights", "own", "shared") else "left")

    def io(tensors: list[dict[str, Any]]) -> str:
        return "\n".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in tensors)

    for g in report["graphs"]:
        w = g["weights"]
        table.add_row(
            g["name"], io(g["inputs"]), io(g["outputs"]), _mb(w["bytes"]), _mb(w["own_bytes"]), _mb(w["shared_bytes"])
        )
    console.print(table)


def _print_summary(report: dict[str, Any]) -> None:
    w = report["weights"]
    summary = Table(show_header=False, box=None)
    summary.add_row("referenced by the graphs", f"{_mb(w['referenced_bytes'])} ({w['referenced_count']} tensors)")
    summary.add_row("stored (unique)", f"{_mb(w['unique_bytes'])} ({w['unique_count']} tensors)")
    summary.add_row("saved by sharing", _mb(w["saved_bytes"]))
    conflicts = report.get("encoding_conflicts", [])
    if conflicts:
        extra = sum(c["bytes"] * (len(c["copies"]) - 1) for c in conflicts)
        summary.add_row(
            "not shared: encodings differ",
            f"{len(conflicts)} tensors, {_mb(extra)} extra: "
            + "; ".join(" / ".join(", ".join(copy["tensors"]) for copy in c["copies"]) for c in conflicts[:3])
            + (" ..." if len(conflicts) > 3 else ""),
        )
    summary.add_row(
        "context file",
        f"{_mb(report['size_bytes'])} ({report['size_bytes'] / max(w['unique_bytes'], 1):.4f} x unique weights)",
    )
    runtimes = sorted({runtime for g in report["graphs"] for runtime in g.get("prepared_for", [])})
    for runtime in runtimes:
        count = sum(runtime in g.get("prepared_for", []) for g in report["graphs"])
        summary.add_row("prepared for", f"{runtime} ({count} of {len(report['graphs'])} graphs)")
    console.print(summary)


def _starts_with(path: Path, magic: bytes) -> bool:
    """Whether a regular file starts with `magic` (a FIFO or a device is refused, never read)."""
    from quiver.formats.files import open_regular

    with open_regular(path) as file:
        return file.read(len(magic)) == magic


def _inspect_section(path: Path, as_json: bool) -> None:
    from rich.markup import escape

    from quiver.formats.section import SectionFile
    from quiver.tools.report import describe_section

    report = describe_section(SectionFile.open(path), str(path))
    if as_json:
        _emit_json(report)  # JSON escapes control characters itself
        return
    report = printable(report)
    table = Table(title=escape(f"{path}: binary section for context {report['context'][:16]}…"))
    for column in ("graph", "tensor", "dtype", "shape", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left", overflow="fold")
    for graph, rows in report["graphs"].items():
        for row in rows:
            table.add_row(escape(graph), escape(row["tensor"]), row["dtype"], str(row["shape"]), f"{row['bytes']:,}")
    console.print(table)
    lora = report["metadata"].get("lora") if isinstance(report["metadata"], dict) else None
    if isinstance(lora, dict):
        console.print(
            escape(f"use case {lora.get('use_case')!r}: adapters {lora.get('active')}, alphas {lora.get('alphas')}")
        )
    console.print(f"{_mb(report['bytes'])} of tensors")


@cli.command()
@click.argument("context_path", metavar="CONTEXT.qctx", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the metadata as JSON.")
@click.option("--tensors", is_flag=True, help="Also list every stored tensor and the graphs using it.")
def inspect(context_path: Path, as_json: bool, tensors: bool) -> None:
    """Print a context binary's graphs, inputs/outputs, tensors and sharing (or a .qsec section's tensors)."""
    from quiver.formats._layout import SECTION_MAGIC
    from quiver.tools.report import describe_context

    if _starts_with(context_path, SECTION_MAGIC):
        _inspect_section(context_path, as_json)
        return
    with Context.from_binary(context_path, backend="reference") as context:
        report = describe_context(context, str(context_path))
    if as_json:
        _emit_json(report)  # JSON escapes control characters itself
        return
    report = printable(report)
    _print_graph_table(report, f"{context_path} (format {report['format_version']}, {report['producer']})")
    if tensors:
        table = Table(title="stored tensors")
        for column in ("#", "dtype", "shape", "bytes", "graphs"):
            table.add_column(column)
        for t in report["tensors"]:
            table.add_row(str(t["index"]), t["dtype"], str(t["shape"]), f"{t['bytes']:,}", ", ".join(t["graphs"]))
        console.print(table)
    if report["tuning"]:
        tuned = Table(title="tuned configurations (quiver tune)")
        for column in ("device tier", "graph", "configuration"):
            tuned.add_column(column)
        for entry in report["tuning"]:
            for graph, chosen in entry["graphs"].items():
                settings = ", ".join(f"{k}={v}" for k, v in chosen["config"].items())
                tuned.add_row(entry["tier"], graph, settings)
        console.print(tuned)
    _print_summary(report)


@cli.command()
@click.argument("context_path", metavar="CONTEXT.qctx", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--graph", "graph_name", help="Graph to run (default: the only graph).")
@click.option(
    "--input-list",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="qnn-net-run input list: `name:=file.raw ...` per line (.raw or .npy).",
)
@click.option("--output-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--backend", type=click.Choice(available_backends()), default="cpu", show_default=True)
@click.option("--npy", is_flag=True, help="Also write each output as .npy.")
@_input_shape
@click.option(
    "--section",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A binary section (.qsec) to apply before running, e.g. a LoRA use case.",
)
@click.option(
    "--lora-strength",
    "strengths",
    multiple=True,
    metavar="ADAPTER=VALUE",
    help="Set an adapter's strength (after --section); repeat for more adapters.",
)
def run(
    context_path: Path,
    graph_name: str | None,
    input_list: Path,
    output_dir: Path,
    backend: str,
    npy: bool,
    input_shapes: tuple[str, ...],
    section: Path | None,
    strengths: tuple[str, ...],
) -> None:
    """Execute a graph for every line of an input list (qnn-net-run compatible outputs)."""
    from quiver.tools.netrun import run_input_list

    with Context.from_binary(context_path, backend=backend) as context:
        if graph_name is None:
            if len(context.graph_names) != 1:
                raise QuiverError(f"the context holds {context.graph_names}; choose one with --graph")
            graph_name = context.graph_names[0]
        if section is not None:
            context.apply_binary_section(graph_name, section)
        for strength in strengths:
            adapter, _, value = strength.partition("=")
            try:
                number = float(value)
            except ValueError:
                raise click.BadParameter(f"{strength!r}: write ADAPTER=VALUE, e.g. elementary=0.5") from None
            context.graph(graph_name).set_lora_strength(adapter, number)
        start = time.perf_counter()
        shapes = _parse_file_shapes(input_shapes)
        with _progress(quiet=False) as progress:
            task = progress.add_task(f"running {graph_name}", total=None)
            written = run_input_list(
                context.graph(graph_name),
                input_list,
                output_dir,
                npy=npy,
                shapes=shapes,
                on_result=lambda done, total: progress.update(task, completed=done, total=total),
            )
        elapsed = time.perf_counter() - start
    results = len({p.parent for p in written})
    err_console.print(f"{results} result(s), {len(written)} output file(s) in {output_dir} ({elapsed:.2f} s)")


@cli.command()
@click.argument("model_a", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model_b", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def compare(model_a: Path, model_b: Path, as_json: bool) -> None:
    """Which weights two models share by content, which differ, and the bytes one context saves."""
    from quiver.tools.compare import compare_models

    result = compare_models(model_a, model_b)
    if as_json:
        _emit_json(result.to_json())
        return
    table = Table(title=f"{model_a.name} vs {model_b.name}")
    for column in ("", "tensors", "bytes (A)"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row("identical (shareable)", str(len(result.identical)), _mb(sum(a.nbytes for a, _ in result.identical)))
    table.add_row("different (same role)", str(len(result.different)), _mb(sum(a.nbytes for a, _ in result.different)))
    conflicts = result.encoding_conflicts
    table.add_row("same bytes, other encoding", str(len(conflicts)), _mb(sum(a.nbytes for a, _ in conflicts)))
    table.add_row("only in A", str(len(result.only_a)), _mb(sum(t.nbytes for t in result.only_a)))
    table.add_row("only in B", str(len(result.only_b)), _mb(sum(t.nbytes for t in result.only_b)))
    console.print(table)
    summary = Table(show_header=False, box=None)
    summary.add_row("stored separately", _mb(result.separate_bytes))
    summary.add_row("in one context", _mb(result.context_bytes))
    summary.add_row("saved", f"{_mb(result.shared_bytes)} ({result.shared_bytes / max(result.separate_bytes, 1):.0%})")
    console.print(summary)
    for title, pairs in (("different tensors", result.different), ("not shareable: encodings differ", conflicts)):
        if pairs:
            detail = Table(title=title)
            for column in ("A", "B", "dtype", "shape", "bytes"):
                detail.add_column(column)
            for a, b in pairs:
                detail.add_row(a.name, b.name, a.dtype, str(list(a.shape)), f"{a.nbytes:,}")
            console.print(detail)


@cli.command()
@click.argument("context_path", metavar="CONTEXT.qctx", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def verify(context_path: Path, as_json: bool) -> None:
    """Check every checksum and padding of a context binary (or a .qsec section); exit 0 only if all hold."""
    from quiver.formats._layout import SECTION_MAGIC
    from quiver.formats.section import SectionFile

    start = time.perf_counter()
    is_section = _starts_with(context_path, SECTION_MAGIC)
    file = (SectionFile if is_section else ContextFile).open(context_path)
    problems = file.verify()
    elapsed = time.perf_counter() - start
    if as_json:
        _emit_json(
            {
                "path": str(context_path),
                "ok": not problems,
                "problems": problems,
                "weights": len(file.weights),
                "graphs": list(file.graphs),
                "bytes": file.size,
            }
        )
    elif not problems:
        console.print(
            f"{context_path}: ok ({len(file.weights)} weights, {len(file.graphs)} graphs, "
            f"{_mb(file.size)} checked in {elapsed:.2f} s)"
        )
    file.close()
    if problems:
        raise QuiverError(
            f"{context_path}: {len(problems)} problem(s): {'; '.join(problems[:5])}; rebuild or copy it again"
        )


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def check(model: Path, as_json: bool) -> None:
    """List a model's operators and every one Quiver does not support."""
    from quiver.tools.check import check_model

    report = check_model(model)
    if as_json:
        _emit_json(report.to_json())
    else:
        table = Table(title=f"{model.name}: operators")
        for column in ("operator", "nodes", "supported"):
            table.add_column(column)
        for op, count in sorted(report.operators.items()):
            table.add_row(op, str(count), "no" if op in report.unsupported else "yes")
        console.print(table)
        console.print(f"quiver.ort runs it on: {report.path}")
        if report.ok:
            console.print(f"{model}: ok, Quiver can build it")
    if report.unsupported:
        raise QuiverError(f"{model} uses unsupported operators: {', '.join(report.unsupported)}")
    if report.problem:
        raise QuiverError(report.problem)


def _print_accuracy(report: Any) -> None:
    outputs = Table(title=f"accuracy vs. float ({report.samples} samples)")
    for column in ("output", "SQNR dB", "cosine", "max |diff|"):
        outputs.add_column(column, justify="left" if column == "output" else "right")
    for o in report.outputs:
        outputs.add_row(o.name, f"{o.sqnr_db:.2f}", f"{o.cosine:.6f}", f"{o.max_abs_diff:.4g}")
    console.print(outputs)
    layers = Table(title="least accurate tensors: promote these to 16 bit first")
    layers.add_column("tensor")
    layers.add_column("output of")
    layers.add_column("SQNR dB", justify="right")
    for name, op, value in report.layers[:10]:
        layers.add_row(name, op, f"{value:.2f}")
    console.print(layers)


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="QDQ model.")
@click.option("--act-bitwidth", type=click.Choice(["8", "16"]), default="8", show_default=True)
@click.option("--weight-bitwidth", type=click.Choice(["4", "8", "16"]), default="8", show_default=True)
@click.option("--bias-bitwidth", type=click.Choice(["32"]), default="32", show_default=True)
@click.option("--per-channel", is_flag=True, help="One weight scale per output channel.")
@click.option("--block-size", type=int, default=0, help="4-bit weights in blocks of N along the reduction axis.")
@click.option(
    "--input-list",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Calibration inputs: a QNN input list (`name:=file.raw ...` per line).",
)
@click.option(
    "--float-fallback", is_flag=True, help="Tensors without an encoding in the overrides stay float (no calibration)."
)
@click.option(
    "--quantization-overrides",
    type=click.Path(dir_okay=False, path_type=Path),
    help="AIMET encodings (0.6.1/1.0.0/2.0.0) or ORT TensorQuantOverrides JSON.",
)
@click.option("--calibration", type=click.Choice(["minmax", "percentile", "entropy"]), default="minmax")
@click.option("--encodings-out", type=click.Path(dir_okay=False, path_type=Path), help="Write the encodings used.")
@click.option("--encodings-version", type=click.Choice(["0.6.1", "1.0.0", "2.0.0"]), default="1.0.0")
@_input_shape
@click.option("--report", is_flag=True, help="Accuracy vs. float on the calibration inputs, per output and layer.")
@click.option("--json", "as_json", is_flag=True, help="Print sizes, encodings counts and the report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def quantize(
    model: Path,
    output: Path,
    act_bitwidth: str,
    weight_bitwidth: str,
    bias_bitwidth: str,
    per_channel: bool,
    block_size: int,
    input_list: Path | None,
    float_fallback: bool,
    quantization_overrides: Path | None,
    calibration: str,
    encodings_out: Path | None,
    encodings_version: str,
    input_shapes: tuple[str, ...],
    report: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Quantize MODEL.onnx to a QDQ model (runnable by ONNX Runtime), as qairt-quantizer does."""
    from quiver.passes.mask_fills import mask_fills_of
    from quiver.passes.quantize import QuantizeOptions
    from quiver.tools.quantize import read_overrides, run_quantize

    if input_list is None and not float_fallback:
        raise click.UsageError("give --input-list (calibration inputs), or --float-fallback with overrides")
    encodings, ort_overrides = read_overrides(quantization_overrides) if quantization_overrides else (None, {})
    options = QuantizeOptions(
        int(act_bitwidth), int(weight_bitwidth), int(bias_bitwidth), per_channel, block_size, calibration,
        float_fallback, encodings, ort_overrides,
    )  # fmt: skip
    with _progress(quiet) as progress:
        progress.add_task("calibrating and quantizing" + (", then measuring accuracy" if report else ""), total=None)
        result = run_quantize(
            model, output, options, input_list, _parse_file_shapes(input_shapes), encodings_out, encodings_version,
            report,
        )  # fmt: skip
    mask_fills = mask_fills_of(result.model)
    summary = {
        "output": str(output),
        "float_weight_bytes": result.float_bytes,
        "quantized_weight_bytes": result.quantized_bytes,
        "param_encodings": len(result.encodings.params()),
        "activation_encodings": len(result.encodings.activations()),
        "encodings_out": str(encodings_out) if encodings_out else None,
        "accuracy": result.report.to_json() if result.report else None,
        "mask_fills": [vars(m) for m in mask_fills],
    }
    if as_json:
        _emit_json(summary)
        return
    table = Table(show_header=False, box=None, title=f"quantized {model.name} -> {output}")
    table.add_row("weights", f"{_mb(result.float_bytes)} float -> {_mb(result.quantized_bytes)}")
    table.add_row("encodings", f"{summary['param_encodings']} params, {summary['activation_encodings']} activations")
    if encodings_out:
        table.add_row("encodings file", f"{encodings_out} (AIMET {encodings_version})")
    console.print(table)
    if mask_fills:
        fills = Table(title="mask fills clamped before calibration (Softmax unchanged in float32)")
        for column in ("tensor", "was", "now", "reaches Softmax of"):
            fills.add_column(column)
        for m in mask_fills:
            fills.add_row(m.tensor, f"{m.original:.4g}", f"{m.fill:.4g}", ", ".join(m.softmax_inputs[:3]))
        console.print(fills)
    if result.report:
        _print_accuracy(result.report)


@cli.command("eval")
@click.argument("float_model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("quantized_model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--input-list", required=True, type=click.Path(dir_okay=False, path_type=Path))
@_input_shape
@click.option("--json", "as_json", is_flag=True)
def eval_(
    float_model: Path, quantized_model: Path, input_list: Path, input_shapes: tuple[str, ...], as_json: bool
) -> None:
    """Accuracy of a quantized model vs. its float model: SQNR and cosine per output, SQNR per layer."""
    from quiver.tools.quantize import run_eval

    report = run_eval(float_model, quantized_model, input_list, _parse_file_shapes(input_shapes))
    if as_json:
        _emit_json(report.to_json())
        return
    _print_accuracy(report)


_lora_config = click.option(
    "--lora-config",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="QNN-style YAML: adapters (PEFT folders), use cases, the base model.",
)


@cli.group()
def lora() -> None:
    """LoRA adapters as binary sections (QNN's LoRA v3 flow from PEFT adapters)."""


@lora.command("map")
@_lora_config
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the map (module -> node name) as JSON, usable as attach_point_onnx_mapping.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the attach points as JSON.")
def lora_map(lora_config: Path, output: Path | None, as_json: bool) -> None:
    """Find the ONNX attach point (MatMul/Gemm) of every adapted module; list those with none."""
    from quiver.lora.prepare import load_adapters, load_lora_config, map_attach_points

    project = load_lora_config(lora_config)
    points, missing = map_attach_points(project, load_adapters(project))
    if output is not None:
        nodes = {module: point.node for module, point in sorted(points.items())}
        write_text_atomically(output, json.dumps(nodes, indent=2))
    if as_json:
        _emit_json({"attach_points": {m: vars(p) for m, p in sorted(points.items())}, "missing": missing})
    else:
        table = Table(title=f"attach points in {project.base_model.name}")
        for column in ("module", "node", "op", "weight", "in x out", "found by"):
            table.add_column(column)
        for module, point in sorted(points.items()):
            table.add_row(
                module,
                point.node,
                point.op_type,
                point.weight,
                f"{point.in_features} x {point.out_features}",
                point.found_by,
            )
        console.print(table)
    if missing:
        raise QuiverError(
            f"{len(missing)} adapted module(s) found no attach point: {', '.join(missing[:5])}; "
            "give them in an attach_point_onnx_mapping JSON (module -> node name)"
        )


@lora.command("create")
@_lora_config
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The max-rank LoRA graph (.onnx), LoRA weights zero.",
)
def lora_create(lora_config: Path, output: Path) -> None:
    """Write one ONNX graph with a LoRA branch at every attach point, serving every use case."""
    from quiver.lora.prepare import create_graph, load_adapters, load_lora_config

    project = load_lora_config(lora_config)
    graph = create_graph(project, load_adapters(project))
    write_atomically(output, graph.model.SerializeToString())  # weights zero-filled: far below protobuf's 2 GB
    table = Table(title=f"{output}: {len(graph.slots)} LoRA branches, lora_alpha[{len(graph.adapter_order)}]")
    for column in ("module", "node", "rank"):
        table.add_column(column)
    for slot in graph.slots:
        table.add_row(slot.attach.module, slot.attach.node, str(slot.rank))
    console.print(table)


@lora.command("import")
@click.option("--lora-config", type=click.Path(dir_okay=False, path_type=Path), help="The LoRA YAML (PEFT adapters).")
@click.option(
    "--onnx-adapter",
    type=click.Path(dir_okay=False, path_type=Path),
    help="ONNX Runtime's adapter file (.onnx_adapter) to turn into a section of --context.",
)
@click.option("--context", "context_path", type=click.Path(dir_okay=False, path_type=Path), help="With --onnx-adapter.")
@click.option("--graph", "graphs", multiple=True, help="With --onnx-adapter: the graphs it updates (default: all).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Folder (--lora-config) or .qsec.")
def lora_import(
    lora_config: Path | None,
    onnx_adapter: Path | None,
    context_path: Path | None,
    graphs: tuple[str, ...],
    output: Path,
) -> None:
    """Import adapters: a LoRA YAML's use cases (<use case>.safetensors, zero-padded, and use_cases.json in
    the -o folder), or an ONNX Runtime .onnx_adapter as a binary section of a context (-o FILE.qsec)."""
    if (lora_config is None) == (onnx_adapter is None):
        raise click.UsageError("give --lora-config (PEFT adapters) or --onnx-adapter with --context")
    if onnx_adapter is not None:
        from quiver.lora.onnx_adapter import section_from_onnx_adapter

        if context_path is None:
            raise click.UsageError("--onnx-adapter needs --context CONTEXT.qctx (the context it updates)")
        written = section_from_onnx_adapter(onnx_adapter, context_path, output, graphs)
        err_console.print(f"wrote {written}")
        return
    assert lora_config is not None
    from safetensors.numpy import save

    from quiver.lora.prepare import create_graph, import_use_cases, load_adapters, load_lora_config

    project = load_lora_config(lora_config)
    adapters = load_adapters(project)
    graph = create_graph(project, adapters)
    output.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name, (values, alphas) in import_use_cases(project, adapters, graph).items():
        write_atomically(output / f"{name}.safetensors", save(values))
        summary[name] = {"tensors": f"{name}.safetensors", "adapters": graph.adapter_order, "alphas": alphas}
    write_text_atomically(output / "use_cases.json", json.dumps(summary, indent=2))
    err_console.print(f"{len(summary)} use case(s) in {output}")


@lora.command("prepare")
@_lora_config
@click.option("-o", "--output-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--genie-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write a Genie-style config with the 'lora' block for this folder.",
)
@click.option(
    "--input-list",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Quantize (LoRA-aware): calibration inputs of the base model, a QNN input list.",
)
@_input_shape
@click.option("--act-bitwidth", type=click.Choice(["8", "16"]), default="16", show_default=True)
@click.option("--weight-bitwidth", type=click.Choice(["8", "16"]), default="8", show_default=True)
@click.option("--lora-weight-bitwidth", type=click.Choice(["8", "16"]), help="Keep adapter weights at this width.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def lora_prepare(
    lora_config: Path,
    output_dir: Path,
    genie_config: Path | None,
    input_list: Path | None,
    input_shapes: tuple[str, ...],
    act_bitwidth: str,
    weight_bitwidth: str,
    lora_weight_bitwidth: str | None,
    as_json: bool,
) -> None:
    """Map, create, import: one context, one section per use case, and manifest.json (quantized with --input-list)."""
    from quiver.lora.prepare import LoraQuantization, load_lora_config, prepare
    from quiver.passes.quantize import QuantizeOptions
    from quiver.tools.quantize import load_float_model, read_samples

    quantization = None
    if input_list is not None:
        base = load_float_model(load_lora_config(lora_config).base_model)
        quantization = LoraQuantization(
            read_samples(base, input_list, _parse_file_shapes(input_shapes)),
            QuantizeOptions(activation_bits=int(act_bitwidth), weight_bits=int(weight_bitwidth)),
            int(lora_weight_bitwidth) if lora_weight_bitwidth else None,
        )
    with _status("preparing") as status:
        manifest = prepare(
            lora_config, output_dir, genie_config, on_step=lambda step: status.update(step), quantization=quantization
        )
    if as_json:
        _emit_json(manifest)
        return
    table = Table(title=f"{output_dir / manifest['context']}: graph {manifest['graph']}")
    for column in ("use case", "adapters", "alphas", "section", "bytes"):
        table.add_column(column)
    for name, case in manifest["use_cases"].items():
        size = (output_dir / case["section"]).stat().st_size
        table.add_row(name, ", ".join(case["adapters"]) or "-", str(case["alphas"]), case["section"], f"{size:,}")
    console.print(table)


@cli.command("ort-wrap")
@click.argument("context_path", metavar="CONTEXT.qctx", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
def ort_wrap(context_path: Path, output_dir: Path) -> None:
    """One <graph>_ctx.onnx (EPContext model) per graph, all naming one .qctx: for quiver.ort sessions."""
    from quiver.formats.reader import ContextFile
    from quiver.ort.epcontext import wrap_context

    ContextFile.open(context_path).close()  # a missing or damaged file fails here, with its own error
    for path in wrap_context(context_path, output_dir):
        console.print(str(path))


from quiver.tools import t2t_cli as _t2t_cli  # noqa: E402,F401  (registers `quiver t2t`; it imports this module)
from quiver.tools import tune_cli as _tune_cli  # noqa: E402,F401  (registers `quiver tune`, `quiver target-server`)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: one-line errors on stderr, exit 1 for Quiver errors, 2 for usage errors."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="quiver", standalone_mode=False)
    except QuiverError as exc:
        err_console.print(f"quiver: error: {printable(str(exc))}", markup=False, highlight=False, soft_wrap=True)
        return 1
    except click.ClickException as exc:
        exc.show()
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

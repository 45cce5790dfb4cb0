"""`quiver demo`, `build`, `inspect`, `run`, `compare`, `verify`, `check`, `ort-wrap`: contexts and models."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.progress import TaskID
from rich.table import Table

from quiver.backends import available_backends
from quiver.cli.common import (
    as_mb,
    cli,
    console,
    emit_json,
    err_console,
    input_shape_option,
    parse_file_shapes,
    parse_model_arg,
    parse_shape_args,
    printable,
    progress_bar,
    status_line,
    tuning_input_lists_option,
)
from quiver.errors import QuiverError, TensorUpdateError
from quiver.formats.files import read_text
from quiver.formats.reader import ContextFile
from quiver.runtime.context import Context


@cli.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), help="Keep the models and context here.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def demo(workdir: Path | None, as_json: bool) -> None:
    """Build a base model and two fine-tunes into one context, run them, check them against ONNX Runtime."""
    from quiver.commands.demo import run_demo

    with status_line("starting") as status:
        result = run_demo(workdir, on_step=lambda step: status.update(step))
    if as_json:
        emit_json(
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
                as_mb(r.separate_bytes),
                f"{r.first_output_ms:.1f} ms",
                f"{r.latency_ms:.2f} ms",
                f"{r.ort_latency_ms:.2f} ms",
                f"{r.max_abs_diff:.1e}",
                "ok" if r.matches else "MISMATCH",
            )
        console.print(table)
        summary = Table(show_header=False, box=None)
        summary.add_row("stored separately", as_mb(result.separate_bytes))
        summary.add_row(
            "one context",
            f"{as_mb(result.context_bytes)} ({result.context_bytes / result.separate_bytes:.0%} of separate)",
        )
        summary.add_row("unique weights", as_mb(result.unique_weight_bytes))
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
    metavar="[GRAPH:]NAME=D0,D1",
    help="Fix an input's shape in every graph that has it, or with GRAPH: in that graph alone (one model "
    "added twice under two names may take two shapes); repeat for more. A name no graph has is an error.",
)
@click.option(
    "--updateable",
    metavar="NAMES|@FILE",
    help="Weights a binary section or an update may replace later (a generic updateable context): names "
    "separated by commas, or @FILE with one per line; each must be a weight of some graph.",
)
@click.option(
    "--quantization-overrides",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Quantize every graph from these encodings (AIMET 0.6.1/1.0.0/2.0.0 or ORT TensorQuantOverrides), "
    "what they leave out kept float and named, as qairt's converter with --float_fallback.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the sharing report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--config-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help='Tuning config JSON (QNN\'s keys): with "tuning_mode": true the context is tuned for this device.',
)
@tuning_input_lists_option
def build(
    models: tuple[str, ...],
    output: Path,
    input_shapes: tuple[str, ...],
    updateable: str | None,
    quantization_overrides: Path | None,
    as_json: bool,
    quiet: bool,
    config_file: Path | None,
    input_lists: tuple[tuple[str | None, Path], ...],
) -> None:
    """Pack MODEL.onnx[:GRAPH_NAME] ... into one context binary, each distinct weight stored once."""
    from quiver.commands.quantize import quantize_from_overrides, read_overrides, stored_names
    from quiver.commands.report import describe_context
    from quiver.passes.load import load_model

    parsed = [parse_model_arg(m) for m in models]
    shapes = _graph_shapes(parse_shape_args(input_shapes), [name for _, name in parsed])
    wanted = _tensor_names(updateable) if updateable else []
    overrides = read_overrides(quantization_overrides) if quantization_overrides else None
    if config_file is not None:
        _check_tuning(config_file, input_lists)  # before anything is written: no untuned file left behind
    found: set[str] = set()
    shaped: set[tuple[str | None, str]] = set()
    output.parent.mkdir(parents=True, exist_ok=True)
    context = Context.create("cpu", workdir=output.parent)
    with progress_bar(quiet) as progress:
        task = progress.add_task("building", total=len(parsed))
        for path, name in parsed:
            progress.update(task, description=f"adding {name}")
            fixed: dict[str, list[int | str]] | None = None
            names: list[str] = []
            if shapes or wanted:  # fix only the inputs this model has (a family may differ in its inputs)
                source = load_model(path)[0].graph
                model_inputs = {i.name for i in source.input}
                given: dict[str, list[int | str]] = {}
                for (graph, input_name), dims in shapes.items():  # the graph's own shapes after the shared ones
                    if graph in (None, name) and input_name in model_inputs:
                        given[input_name] = dims
                        shaped.add((graph, input_name))
                fixed = given or None
                weights = {t.name for t in source.initializer}
                names = [n for n in wanted if n in weights]
                found.update(names)
            if overrides is not None:
                progress.update(task, description=f"quantizing {name}")
                quantized, _ = quantize_from_overrides(path, overrides, fixed)
                # its inputs fixed already; a quantized weight is updated as its integers, scale and zero point
                context.add_graph(name, quantized, updateable=stored_names(quantized, names))
            else:
                context.add_graph(name, path, fixed, updateable=names)
            progress.advance(task)
        unshaped = [f"{g}:{n}" if g else n for g, n in shapes if (g, n) not in shaped]
        if unshaped:
            context.close()
            raise QuiverError(
                f"--input-shape names {unshaped}, which no graph given has as an input (GRAPH:NAME for one "
                "graph); `quiver check MODEL.onnx` lists a model's inputs"
            )
        missing = [n for n in wanted if n not in found]
        if missing:
            context.close()
            raise TensorUpdateError(
                f"--updateable names {missing[:3]}, which no graph given has as a weight; `quiver inspect "
                "--tensors` or the model's initializers list the names"
            )
        progress.update(task, description="writing")
        context.save(output)
    if config_file is not None:
        _tune_built(context, output, config_file, input_lists)
    report = describe_context(context, str(output))
    context.close()
    if as_json:
        emit_json(report)  # JSON escapes control characters itself
        return
    report = printable(report)
    _print_graph_table(report, f"built {output}")
    _print_summary(report)


def _graph_shapes(
    shapes: dict[str, list[int | str]], graphs: Sequence[str]
) -> dict[tuple[str | None, str], list[int | str]]:
    """`--input-shape` keyed by (graph or None for every graph, input): `GRAPH:NAME` when GRAPH is a graph
    of this build (an input's own name may hold a colon, as TensorFlow's `input:0`), else the input name;
    the shared shapes first, so that a graph's own shape is applied after them."""
    keyed: dict[tuple[str | None, str], list[int | str]] = {}
    for key, dims in shapes.items():
        graph, sep, name = key.partition(":")
        keyed[(graph, name) if sep and graph in graphs and name else (None, key)] = dims
    return dict(sorted(keyed.items(), key=lambda item: item[0][0] is not None))


def _tensor_names(spec: str) -> list[str]:
    """`--updateable`'s names: comma-separated, or @FILE with one per line."""
    if spec.startswith("@"):
        text = read_text(Path(spec[1:]), limit=16 << 20, what="the --updateable list")
        names = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    else:
        names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise TensorUpdateError("--updateable names no tensor: give names separated by commas, or @FILE")
    return names


def _check_tuning(config_file: Path, input_lists: Sequence[tuple[str | None, Path]]) -> None:
    """A tuning config that tunes needs sample inputs: refused before the build writes anything."""
    from quiver.errors import TuningError
    from quiver.tuning import read_tuning_config

    if read_tuning_config(config_file).tuning_mode and not input_lists:
        raise TuningError("tuning measures graphs on sample inputs: give --input-list (QNN's input list format)")


def _tune_built(
    context: Context, output: Path, config_file: Path, input_lists: Sequence[tuple[str | None, Path]]
) -> None:
    """`build --config-file`: QNN tunes while it generates the context binary; here, right after."""
    from quiver.cli.tune import run_tuning
    from quiver.tuning import read_tuning_config

    config = read_tuning_config(config_file)
    if not config.tuning_mode:
        return  # a config without tuning mode (and without cache options: those are an error) tunes nothing
    run_tuning(context, input_lists, (), {}, output, config_file=config_file)


def _print_graph_table(report: dict[str, Any], title: str) -> None:
    table = Table(title=title)
    for column in ("graph", "inputs", "outputs", "weights", "own", "shared"):
        table.add_column(column, justify="right" if column in ("weights", "own", "shared") else "left")

    def io(tensors: list[dict[str, Any]]) -> str:
        return "\n".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in tensors)

    for g in report["graphs"]:
        w = g["weights"]
        table.add_row(
            g["name"],
            io(g["inputs"]),
            io(g["outputs"]),
            as_mb(w["bytes"]),
            as_mb(w["own_bytes"]),
            as_mb(w["shared_bytes"]),
        )
    console.print(table)


def _print_summary(report: dict[str, Any]) -> None:
    w = report["weights"]
    summary = Table(show_header=False, box=None)
    summary.add_row("referenced by the graphs", f"{as_mb(w['referenced_bytes'])} ({w['referenced_count']} tensors)")
    summary.add_row("stored (unique)", f"{as_mb(w['unique_bytes'])} ({w['unique_count']} tensors)")
    summary.add_row("saved by sharing", as_mb(w["saved_bytes"]))
    conflicts = report.get("encoding_conflicts", [])
    if conflicts:
        extra = sum(c["bytes"] * (len(c["copies"]) - 1) for c in conflicts)
        summary.add_row(
            "not shared: encodings differ",
            f"{len(conflicts)} tensors, {as_mb(extra)} extra: "
            + "; ".join(" / ".join(", ".join(copy["tensors"]) for copy in c["copies"]) for c in conflicts[:3])
            + (" ..." if len(conflicts) > 3 else ""),
        )
    summary.add_row(
        "context file",
        f"{as_mb(report['size_bytes'])} ({report['size_bytes'] / max(w['unique_bytes'], 1):.4f} x unique weights)",
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

    from quiver.commands.report import describe_section
    from quiver.formats.section import SectionFile

    report = describe_section(SectionFile.open(path), str(path))
    if as_json:
        emit_json(report)  # JSON escapes control characters itself
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
    console.print(f"{as_mb(report['bytes'])} of tensors")


@cli.command()
@click.argument("context_path", metavar="CONTEXT.qctx", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the metadata as JSON.")
@click.option("--tensors", is_flag=True, help="Also list every stored tensor and the graphs using it.")
@click.option("--export-weights", type=click.Path(file_okay=False, path_type=Path),
              help="Write every stored weight to DIR as a raw file, with weights.json indexing them.")  # fmt: skip
def inspect(context_path: Path, as_json: bool, tensors: bool, export_weights: Path | None) -> None:
    """Print a context binary's graphs, inputs/outputs, tensors and sharing (or a .qsec section's tensors)."""
    from quiver.commands.report import describe_context
    from quiver.commands.report import export_weights as write_weights
    from quiver.formats.layout import SECTION_MAGIC

    if _starts_with(context_path, SECTION_MAGIC):
        if export_weights is not None:
            raise click.BadParameter("--export-weights reads a context binary (.qctx), not a section")
        _inspect_section(context_path, as_json)
        return
    with Context.from_binary(context_path, backend="reference") as context:
        report = describe_context(context, str(context_path))
        if export_weights is not None:
            written = write_weights(context.file, export_weights)
            console.print(f"{len(written['tensors'])} weights written to {export_weights} (index: weights.json)")
    if as_json:
        emit_json(report)  # JSON escapes control characters itself
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
@click.option(
    "--graph",
    "graphs",
    multiple=True,
    metavar="NAME[:LIST]",
    help="A graph to run (default: the only graph), with its own input list after a colon; repeat for more.",
)
@click.option(
    "--input-list",
    help="qnn-net-run input list(s): `name:=file.raw ...` per line (.raw or .npy); several graphs take one "
    "each, comma-separated, in the order of --graph (or of the context's graphs).",
)
@click.option(
    "--config-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="qnn-net-run's backend extensions JSON (context_configs beside backend_extensions, or the backend "
    "config it names, or that config itself): enable_graphs limits the graphs that may run, in priority "
    "order; memory_limit_hint (MB) releases the least recently used graphs past it; is_persistent_binary "
    "false copies the context into memory. Hardware settings are warned about: they do nothing here.",
)
@click.option("--output-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--backend",
    default="cpu",
    show_default=True,
    callback=lambda _, __, value: _backend_choice(value),
    help=f"A Quiver backend ({', '.join(available_backends())}), or QNN's (htp, gpu, or a library such as "
    "libQnnHtp.so / QnnHtp.dll: run on cpu here, with a warning, as quiver.ort runs them).",
)
@click.option("--npy", is_flag=True, help="Also write each output as .npy.")
@input_shape_option
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
    graphs: tuple[str, ...],
    input_list: str | None,
    config_file: Path | None,
    output_dir: Path,
    backend: str,
    npy: bool,
    input_shapes: tuple[str, ...],
    section: Path | None,
    strengths: tuple[str, ...],
) -> None:
    """Execute a graph for every line of an input list (qnn-net-run compatible outputs); several graphs, each
    with its list, write to a folder per graph."""
    from quiver.runtime.backend_extensions import BackendExtensions, read_backend_extensions
    from quiver.runtime.netrun import run_input_list

    extensions = read_backend_extensions(config_file) if config_file is not None else BackendExtensions(Path())
    for line in extensions.without_effect:
        err_console.print(f"quiver: warning: {line}", markup=False, highlight=False, soft_wrap=True)
    with Context.from_binary(
        context_path,
        backend=backend,
        enable_graphs=extensions.enable_graphs,
        memory_limit_hint_mb=extensions.memory_limit_mb,
        persistent=extensions.persistent,
    ) as context:
        extensions.check([graph.partition(":")[0] for graph in graphs])
        plan = _run_plan(context.graph_names, graphs, input_list)
        shapes = parse_file_shapes(input_shapes)
        adapter_strengths = [_strength(given) for given in strengths]
        written: list[Path] = []
        start = time.perf_counter()
        for graph_name, list_path in plan:
            if section is not None:
                context.apply_binary_section(graph_name, section)
            for adapter, number in adapter_strengths:
                context.graph(graph_name).set_lora_strength(adapter, number)
            with progress_bar(quiet=False) as progress:
                task = progress.add_task(f"running {graph_name}", total=None)

                def advance(done: int, total: int, task: TaskID = task) -> None:
                    progress.update(task, completed=done, total=total)

                written += run_input_list(
                    context.graph(graph_name),
                    list_path,
                    output_dir / graph_name if len(plan) > 1 else output_dir,
                    npy=npy,
                    shapes=shapes,
                    on_result=advance,
                )
        elapsed = time.perf_counter() - start
    results = len({p.parent for p in written})
    err_console.print(f"{results} result(s), {len(written)} output file(s) in {output_dir} ({elapsed:.2f} s)")


def _backend_choice(given: str) -> str:
    """`--backend`: a Quiver backend, or QNN's backend type or library as `quiver.ort` maps it (the
    hardware ones to cpu, said once on stderr)."""
    from quiver.ort.provider import QNN_HARDWARE, backend_from_path

    if given in available_backends():
        return given
    backend = backend_from_path(given)
    if backend in QNN_HARDWARE:
        err_console.print(
            f"quiver: warning: QNN backend {given!r} is {QNN_HARDWARE[backend]}, which this machine does not "
            "have; running on Quiver's cpu backend",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return "cpu"
    if backend in available_backends():
        return backend
    raise click.BadParameter(
        f"{given!r} is no backend here; use one of {available_backends()} or QNN's htp, gpu (or their libraries)"
    )


def _strength(given: str) -> tuple[str, float]:
    """`--lora-strength ADAPTER=VALUE`."""
    adapter, _, value = given.partition("=")
    try:
        return adapter, float(value)
    except ValueError:
        raise click.BadParameter(f"{given!r}: write ADAPTER=VALUE, e.g. elementary=0.5") from None


def _run_plan(names: Sequence[str], graphs: Sequence[str], input_list: str | None) -> list[tuple[str, Path]]:
    """(graph, input list) pairs from `--graph NAME[:LIST]` and `--input-list A[,B...]`, in order."""
    given = [graph.partition(":") for graph in graphs] or [(name, "", "") for name in names]
    lists = input_list.split(",") if input_list else []
    if not graphs and len(names) > 1 and len(lists) != len(names):
        raise QuiverError(
            f"the context holds {list(names)}; choose one with --graph (or give one input list per graph, "
            "comma-separated)"
        )
    if lists and any(path for _, _, path in given):
        raise QuiverError("give input lists either with --graph NAME:LIST or with --input-list, not both")
    if lists and len(lists) != len(given):
        raise QuiverError(f"{len(lists)} input list(s) for {len(given)} graph(s): give one per graph, comma-separated")
    plan = []
    for index, (name, _, path) in enumerate(given):
        if name not in names:
            raise QuiverError(f"no graph {name!r} in the context; it holds {list(names)}")
        chosen = path or (lists[index] if lists else "")
        if not chosen:
            raise QuiverError(f"no input list for graph {name!r}: give --input-list or --graph {name}:LIST")
        plan.append((name, Path(chosen)))
    return plan


@cli.command()
@click.argument("model_a", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model_b", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def compare(model_a: Path, model_b: Path, as_json: bool) -> None:
    """Which weights two models share by content, which differ, and the bytes one context saves."""
    from quiver.passes.compare import compare_models

    result = compare_models(model_a, model_b)
    if as_json:
        emit_json(result.to_json())
        return
    table = Table(title=f"{model_a.name} vs {model_b.name}")
    for column in ("", "tensors", "bytes (A)"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row(
        "identical (shareable)", str(len(result.identical)), as_mb(sum(a.nbytes for a, _ in result.identical))
    )
    table.add_row(
        "different (same role)", str(len(result.different)), as_mb(sum(a.nbytes for a, _ in result.different))
    )
    conflicts = result.encoding_conflicts
    table.add_row("same bytes, other encoding", str(len(conflicts)), as_mb(sum(a.nbytes for a, _ in conflicts)))
    table.add_row("only in A", str(len(result.only_a)), as_mb(sum(t.nbytes for t in result.only_a)))
    table.add_row("only in B", str(len(result.only_b)), as_mb(sum(t.nbytes for t in result.only_b)))
    console.print(table)
    summary = Table(show_header=False, box=None)
    summary.add_row("stored separately", as_mb(result.separate_bytes))
    summary.add_row("in one context", as_mb(result.context_bytes))
    summary.add_row(
        "saved", f"{as_mb(result.shared_bytes)} ({result.shared_bytes / max(result.separate_bytes, 1):.0%})"
    )
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
    from quiver.formats.layout import SECTION_MAGIC
    from quiver.formats.section import SectionFile

    start = time.perf_counter()
    is_section = _starts_with(context_path, SECTION_MAGIC)
    file = (SectionFile if is_section else ContextFile).open(context_path)
    problems = file.verify()
    elapsed = time.perf_counter() - start
    if as_json:
        emit_json(
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
            f"{as_mb(file.size)} checked in {elapsed:.2f} s)"
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
    from quiver.commands.check import check_model

    report = check_model(model)
    if as_json:
        emit_json(report.to_json())
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

"""`quiver lora map / create / import / prepare`: PEFT adapters as LoRA graphs, use cases and sections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from quiver.cli.common import (
    cli,
    console,
    emit_json,
    err_console,
    input_shape_option,
    parse_file_shapes,
    status_line,
)
from quiver.errors import QuiverError
from quiver.formats.writer import write_atomically, write_text_atomically

if TYPE_CHECKING:
    import numpy as np

    from quiver.formats.encodings import EncodingSet
    from quiver.ir.tensors import TensorInfo

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
        emit_json({"attach_points": {m: vars(p) for m, p in sorted(points.items())}, "missing": missing})
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
@click.option(
    "--tensor-names",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the LoRA tensor names, one a line (default: <output stem>_lora_tensor_names.txt), "
    "for the converter step: `quiver build --updateable @FILE` (qairt-converter's --lora_weight_list).",
)
def lora_create(lora_config: Path, output: Path, tensor_names: Path | None) -> None:
    """Write one ONNX graph with a LoRA branch at every attach point, serving every use case, and the
    list of its LoRA tensors."""
    from quiver.lora.create import updateable_tensors
    from quiver.lora.prepare import create_graph, load_adapters, load_lora_config

    project = load_lora_config(lora_config)
    graph = create_graph(project, load_adapters(project))
    write_atomically(output, graph.model.SerializeToString())  # weights zero-filled: far below protobuf's 2 GB
    names = tensor_names or output.with_name(f"{output.stem}_lora_tensor_names.txt")
    write_text_atomically(names, "".join(f"{name}\n" for name in updateable_tensors(graph.slots)))
    err_console.print(f"wrote {output} and {names}")
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
@click.option(
    "--quantization-overrides",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --lora-config: AIMET encodings for every use case (a use case's quant_overrides win).",
)
def lora_import(
    lora_config: Path | None,
    onnx_adapter: Path | None,
    context_path: Path | None,
    graphs: tuple[str, ...],
    output: Path,
    quantization_overrides: Path | None,
) -> None:
    """Import adapters: a LoRA YAML's use cases (<use case>.safetensors, zero-padded, <use case>.encodings
    where it has encodings, and use_cases.json in the -o folder), or an ONNX Runtime .onnx_adapter as a
    binary section of a context (-o FILE.qsec)."""
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
    from quiver.lora.prepare import write_use_cases

    summary = write_use_cases(lora_config, output, _aimet_overrides(quantization_overrides))
    err_console.print(f"{len(summary)} use case(s) in {output}")


@lora.command("sections")
@click.option(
    "--context",
    "context_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The context built from `lora create`'s graph with `build --updateable @<its tensor names>`.",
)
@click.option(
    "--import-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="`quiver lora import`'s folder: use_cases.json and each use case's tensors (and encodings).",
)
@click.option("--graph", "graphs", multiple=True, help="The graphs the sections update (default: all updateable).")
@click.option("-o", "--output-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
def lora_sections(context_path: Path, import_dir: Path, graphs: tuple[str, ...], output_dir: Path) -> None:
    """One binary section per imported use case (the context binary generator's --adapter_weight_config step)."""
    from quiver.lora.generate import write_sections

    with status_line("writing sections") as status:
        written = write_sections(context_path, import_dir, output_dir, graphs, on_step=lambda s: status.update(s))
    table = Table(title=f"sections of {context_path} in {output_dir}")
    for column in ("use case", "section", "bytes"):
        table.add_column(column)
    for name, files in written.items():
        for file in files:
            table.add_row(name, file, f"{(output_dir / file).stat().st_size:,}")
    console.print(table)


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
@input_shape_option
@click.option("--act-bitwidth", type=click.Choice(["8", "16"]), default="16", show_default=True)
@click.option("--weight-bitwidth", type=click.Choice(["8", "16"]), default="8", show_default=True)
@click.option("--lora-weight-bitwidth", type=click.Choice(["8", "16"]), help="Keep adapter weights at this width.")
@click.option(
    "--quantization-overrides",
    type=click.Path(dir_okay=False, path_type=Path),
    help="AIMET encodings (0.6.1/1.0.0/2.0.0) for every use case; a use case's quant_overrides win, tensor by tensor.",
)
@click.option(
    "--float-fallback",
    is_flag=True,
    help="Quantize from the encodings alone (no --input-list): tensors without one stay float, each op named.",
)
@click.option(
    "--share-adapters-between-graphs",
    "share",
    flag_value=True,
    default=None,
    help="With several base exports: one section per use case for all graphs (a super adapter); "
    "default: the YAML's share_adapters_between_graphs.",
)
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
    quantization_overrides: Path | None,
    float_fallback: bool,
    share: bool | None,
    as_json: bool,
) -> None:
    """Map, create, import: one context, one section per use case, and manifest.json (quantized with --input-list
    or --float-fallback, from the use cases' quant_overrides and --quantization-overrides where given)."""
    from quiver.commands.quantize import load_float_model, read_samples
    from quiver.lora.prepare import LoraQuantization, load_lora_config, prepare, section_files
    from quiver.passes.qdq import QuantizeOptions

    if quantization_overrides is not None and input_list is None and not float_fallback:
        raise click.UsageError("--quantization-overrides quantizes: add --input-list (calibration) or --float-fallback")
    quantization = None
    if input_list is not None or float_fallback:
        base = load_float_model(load_lora_config(lora_config).base_model)
        quantization = LoraQuantization(
            _calibration_samples(read_samples(base, input_list, parse_file_shapes(input_shapes), [_alpha_input()])),
            QuantizeOptions(
                activation_bits=int(act_bitwidth),
                weight_bits=int(weight_bitwidth),
                float_fallback=float_fallback,
                encodings=_aimet_overrides(quantization_overrides),
            ),
            int(lora_weight_bitwidth) if lora_weight_bitwidth else None,
        )
    with status_line("preparing") as status:
        manifest = prepare(
            lora_config,
            output_dir,
            genie_config,
            on_step=lambda step: status.update(step),
            quantization=quantization,
            share_adapters_between_graphs=share,
        )
    if as_json:
        emit_json(manifest)
        return
    shared = " (one section for all: shared adapters)" if manifest["shared_between_graphs"] else ""
    table = Table(title=f"{output_dir / manifest['context']}: graph(s) {', '.join(manifest['graphs'])}{shared}")
    for column in ("use case", "adapters", "alphas", "section", "bytes"):
        table.add_column(column)
    for name, case in manifest["use_cases"].items():
        for file in section_files(case):
            size = (output_dir / file).stat().st_size
            table.add_row(name, ", ".join(case["adapters"]) or "-", str(case["alphas"]), file, f"{size:,}")
    console.print(table)


def _alpha_input() -> TensorInfo:
    from quiver.ir.tensors import LORA_ALPHA_INPUT, TensorInfo, TensorType

    return TensorInfo(LORA_ALPHA_INPUT, "float32", ("adapters",), TensorType.APP_WRITE)


def _calibration_samples(samples: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The base model's feeds of a calibration list. A list may carry `lora_alpha`, as the seed's lists
    for the LoRA graph do: each use case is calibrated at its own `adapter_alphas` (one list serves every
    use case), so the list's values are set aside, and said to be."""
    from quiver.ir.tensors import LORA_ALPHA_INPUT

    if any(LORA_ALPHA_INPUT in sample for sample in samples):
        err_console.print(
            f"quiver: note: the input list's {LORA_ALPHA_INPUT} is set per use case from its adapter_alphas while "
            "calibrating (one list serves every use case)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    return [{k: v for k, v in sample.items() if k != LORA_ALPHA_INPUT} for sample in samples]


def _aimet_overrides(path: Path | None) -> EncodingSet | None:
    """`--quantization-overrides` for LoRA: AIMET encodings (any version), as the YAML's quant_overrides."""
    if path is None:
        return None
    from quiver.formats.encodings import load_encodings

    return load_encodings(path)

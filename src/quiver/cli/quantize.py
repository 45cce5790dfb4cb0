"""The `quiver quantize` and `quiver eval` commands: their options and what they print (the work:
`commands.quantize`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from quiver.cli.common import (
    as_mb,
    cli,
    console,
    emit_json,
    input_shape_option,
    parse_file_shapes,
    progress_bar,
)
from quiver.passes.gptq import WEIGHT_QUANTIZERS


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
@click.option("--quantizer", type=click.Choice(WEIGHT_QUANTIZERS), default="rtn", show_default=True,
              help="How 4-bit blocks are made: round to nearest or GPTQ (from the calibration inputs), "
                   "symmetric or with a zero point per block (-asym).")  # fmt: skip
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
@input_shape_option
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
    quantizer: str,
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
    from quiver.commands.quantize import read_overrides, run_quantize
    from quiver.passes.mask_fills import mask_fills_of
    from quiver.passes.qdq import QuantizeOptions

    if input_list is None and not float_fallback:
        raise click.UsageError("give --input-list (calibration inputs), or --float-fallback with overrides")
    encodings, ort_overrides = read_overrides(quantization_overrides) if quantization_overrides else (None, {})
    options = QuantizeOptions(
        int(act_bitwidth), int(weight_bitwidth), int(bias_bitwidth), per_channel, block_size, calibration,
        float_fallback, encodings, ort_overrides, quantizer,
    )  # fmt: skip
    with progress_bar(quiet) as progress:
        progress.add_task("calibrating and quantizing" + (", then measuring accuracy" if report else ""), total=None)
        result = run_quantize(
            model, output, options, input_list, parse_file_shapes(input_shapes), encodings_out, encodings_version,
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
        emit_json(summary)
        return
    table = Table(show_header=False, box=None, title=f"quantized {model.name} -> {output}")
    table.add_row("weights", f"{as_mb(result.float_bytes)} float -> {as_mb(result.quantized_bytes)}")
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
@input_shape_option
@click.option("--json", "as_json", is_flag=True)
def eval_(
    float_model: Path, quantized_model: Path, input_list: Path, input_shapes: tuple[str, ...], as_json: bool
) -> None:
    """Accuracy of a quantized model vs. its float model: SQNR and cosine per output, SQNR per layer."""
    from quiver.commands.quantize import run_eval

    report = run_eval(float_model, quantized_model, input_list, parse_file_shapes(input_shapes))
    if as_json:
        emit_json(report.to_json())
        return
    _print_accuracy(report)

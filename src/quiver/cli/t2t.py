"""`quiver t2t export|run`: text generation from the command line, as Genie's genie-t2t-run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from quiver.cli.common import as_mb, cli, console, emit_json, err_console, named_path, status_line
from quiver.cli.tune import print_tuning, run_tuning, tuning_options
from quiver.formats.files import read_text
from quiver.t2t.quantizers import DEFAULT_QUANTIZER, MINIMUM_FORM, QUANTIZERS, parse_override

if TYPE_CHECKING:
    from quiver.t2t.config import DialogConfig
    from quiver.t2t.quality import QualityReport


@cli.group()
def t2t() -> None:
    """Text generation: export an LLM with its adapters, then generate (Genie's role)."""


@t2t.command("export")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="A transformers causal-LM folder (config.json, *.safetensors, tokenizer.json), a GGUF file (llama.cpp's; "
    "its weights dequantized, its tokenizer and chat template), or a decoder already exported to ONNX with a KV "
    "cache (onnxruntime-genai's or optimum's folder), packed as it is.",
)
@click.option("-o", "--output-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--lora", "loras", multiple=True, metavar="NAME=PEFT_DIR", help="An adapter; one use case each.")
@click.option(
    "--lora-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A LoRA YAML (adapters and use cases, as `quiver lora prepare` reads) instead of --lora.",
)
@click.option(
    "--weight-bitwidth", type=click.Choice(["4", "8"]), help="Quantize MatMul weights (MatMulNBits) and experts (QMoE)."
)
@click.option("--block-size", type=int, default=32, show_default=True, help="Quantization block size.")
@click.option("--gguf-blocks", type=click.Choice(["carry", "dequantize"]), default="carry", show_default=True,
              help="A GGUF file's Q4_0/Q4_1 weights without --weight-bitwidth: run its blocks as they are (4-bit; "
                   "exact, as rtn-min's), or as float32.")  # fmt: skip
@click.option("--quantizer", type=click.Choice(QUANTIZERS), default=DEFAULT_QUANTIZER, show_default=True,
              help="rtn: symmetric blocks; rtn-asym: a 4-bit zero point per block; rtn-min: a scale and a float "
                   "minimum per block (GGUF's Q4_1; exact for weights on such a grid); hqq: "
                   "the same with HQQ's fitted minimum; gptq, gptq-asym: GPTQ from --calibration prompts, "
                   "symmetric or with zero points.")  # fmt: skip
@click.option(
    "--calibration",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Prompts the gptq quantizers run the float model on, one per line (\\n for a newline).",
)
@click.option("--accuracy-level", type=click.IntRange(0, 4),
              help="ORT's compute for quantized weights: 0 float activations ... 4 int8 (faster) "
                   "[default: the backend's, 4; rtn-min's blocks set their own].")  # fmt: skip
@click.option("--override", "overrides", multiple=True, metavar="PATTERN=4|8|float",
              help="Bits for the weights whose names match (fnmatch; in order, the last match wins), e.g. "
                   "'lm_head.weight=4' or 'model.layers.0.*=8'; 'lm_head.weight=shortlist': 4-bit, its best 32 "
                   "logits from the table's rows; 'lm_head.weight=table': a tied head's 4-bit blocks are the "
                   "token table too; beside a GGUF file's carried blocks, lm_head.weight alone. [default: a tied "
                   "LM head a table with rtn and rtn-asym at 4 bits, else a shortlist (a GGUF file's carried "
                   "blocks too); an untied one 8-bit, float with rtn-min, hqq and carried blocks]")  # fmt: skip
@click.option("--report", is_flag=True,
              help="With --weight-bitwidth: what quantizing cost, against a float export made aside: greedy "
                   "agreement per prompt, perplexity on a text, sizes.")  # fmt: skip
@click.option("--report-prompts", type=click.Path(dir_okay=False, path_type=Path),
              help="The report's prompts, one per line (\\n for a newline) [default: five built in].")  # fmt: skip
@click.option("--report-text", type=click.Path(dir_okay=False, path_type=Path),
              help="The report's perplexity text (UTF-8; its first 512 tokens) [default: built in].")  # fmt: skip
@click.option("--report-tokens", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Greedy tokens per prompt the report compares.")  # fmt: skip
@click.option("--context-size", type=int, default=2048, show_default=True, help="KV cache positions.")
@click.option("--prefill-window", type=int, default=128, show_default=True, help="Prompt tokens per prefill step.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def t2t_export(
    model_dir: Path,
    output_dir: Path,
    loras: tuple[str, ...],
    lora_config: Path | None,
    weight_bitwidth: str | None,
    block_size: int,
    gguf_blocks: str,
    quantizer: str,
    calibration: Path | None,
    accuracy_level: int | None,
    overrides: tuple[str, ...],
    report: bool,
    report_prompts: Path | None,
    report_text: Path | None,
    report_tokens: int,
    context_size: int,
    prefill_window: int,
    as_json: bool,
) -> None:
    """A prefill + decode context sharing every weight, a section per use case, and genie_config.json."""
    from quiver.lora.prepare import read_adapters_and_use_cases
    from quiver.t2t.export import ExportOptions, export
    from quiver.t2t.onnx_decoder import import_decoder, is_onnx_decoder_folder

    if is_onnx_decoder_folder(model_dir):
        given = {
            "--lora": loras,
            "--lora-config": lora_config,
            "--weight-bitwidth": weight_bitwidth,
            "--calibration": calibration,
            "--override": overrides,
            "--report": report or report_prompts or report_text,
        }
        refused = [option for option, value in given.items() if value]
        if refused:
            raise click.BadParameter(
                f"{model_dir} is a decoder exported to ONNX, packed as it is; {', '.join(refused)} work on a "
                "transformers folder (the weights Quiver builds its own graph from)"
            )
        with status_line("packing") as status:
            dialog = import_decoder(model_dir, output_dir, context_size, prefill_window, lambda s: status.update(s))
        _print_files(dialog, [dialog.ctx_bins[0], dialog.tokenizer, dialog.path], as_json, None)
        return

    adapters: dict[str, Path] = dict(named_path(v, "a PEFT folder") for v in loras)
    use_cases = None
    if lora_config is not None:
        if adapters:
            raise click.BadParameter("give --lora or --lora-config, not both")
        _, adapters, use_cases = read_adapters_and_use_cases(lora_config)
    if overrides and not weight_bitwidth and model_dir.suffix.lower() != ".gguf":
        raise click.BadParameter("--override sets bits of quantized weights: give --weight-bitwidth too")
    reporting = bool(report or report_prompts or report_text)
    if reporting and not weight_bitwidth:
        raise click.BadParameter("--report compares quantized weights with float ones: give --weight-bitwidth too")
    # the report's inputs read before the export, so a bad one fails first
    from quiver.t2t.quality import DEFAULT_PROMPTS, DEFAULT_TEXT, MAX_TEXT_BYTES, read_prompts

    chosen_prompts = read_prompts(report_prompts) if report_prompts else list(DEFAULT_PROMPTS)
    chosen_text = read_text(report_text, limit=MAX_TEXT_BYTES, what="the report text") if report_text else DEFAULT_TEXT
    options = ExportOptions(
        context_size=context_size,
        prefill_window=prefill_window,
        weight_bits=int(weight_bitwidth) if weight_bitwidth else None,
        block_size=block_size,
        quantizer=quantizer,
        calibration=tuple(read_prompts(calibration)) if calibration else (),
        accuracy_level=accuracy_level,
        overrides=tuple(parse_override(rule) for rule in overrides),
        gguf_blocks=gguf_blocks,
    )
    with status_line("exporting") as status:
        dialog = export(model_dir, output_dir, adapters, use_cases, options, on_step=lambda s: status.update(s))
    files = [
        dialog.ctx_bins[0],
        *(p for a in dialog.adapters.values() for p in a.bin_sections),
        dialog.tokenizer,
        dialog.path,
    ]
    quality = (
        _quality(model_dir, dialog.path, context_size, chosen_prompts, chosen_text, report_tokens)
        if reporting
        else None
    )
    _print_files(dialog, files, as_json, quality)
    carried = model_dir.suffix.lower() == ".gguf" and gguf_blocks == "carry" and not weight_bitwidth
    if carried or (weight_bitwidth == "4" and quantizer in MINIMUM_FORM):
        _say_if_the_kernel_is_missing()


def _say_if_the_kernel_is_missing() -> None:
    """A float-minimum export runs on Quiver's own 4-bit kernel where it is built: say so where it is not
    (built now if need be, as the first run would)."""
    from quiver.backends.cpu.native_ops import native_ops

    missing = native_ops().reason
    if missing:
        err_console.print(f"quiver: note: Quiver's 4-bit kernel is not used here ({missing}): these blocks run on "
                          "ONNX Runtime's operators instead, the same tokens, slower", markup=False,
                          highlight=False, soft_wrap=True)  # fmt: skip


def _print_files(dialog: DialogConfig, files: list[Path], as_json: bool, quality: QualityReport | None) -> None:
    """What an export wrote: a table of its files (or JSON), and the quality report where one was made."""
    if as_json:
        emit_json(
            {"config": str(dialog.path), "files": {str(p): p.stat().st_size for p in files}}
            | ({"report": quality.as_json()} if quality else {})
        )
        return
    table = Table(title=f"{dialog.path}")
    table.add_column("file")
    table.add_column("size", justify="right")
    for path in files:
        table.add_row(path.name, as_mb(path.stat().st_size))
    console.print(table)
    if quality is not None:
        _print_quality(quality)


def _quality(
    model_dir: Path, config: Path, context_size: int, prompts: list[str], text: str, tokens: int
) -> QualityReport:
    """The quality report of a quantized export against a float one made in a temporary folder."""
    import tempfile

    from quiver.t2t.export import ExportOptions, export
    from quiver.t2t.quality import quality_report

    with tempfile.TemporaryDirectory(prefix="quiver-report-") as folder, status_line("reporting") as status:
        status.update("exporting the float model to compare with")
        reference = export(model_dir, Path(folder), options=ExportOptions(context_size=context_size)).path
        return quality_report(reference, config, prompts, text, tokens, on_step=status.update)


def _print_quality(report: QualityReport) -> None:
    table = Table(title=f"what quantizing cost (greedy tokens of {report.tokens} equal to the float model's)")
    table.add_column("prompt")
    table.add_column("equal tokens", justify="right")
    for prompt, kept in zip(report.prompts, report.agreement):
        table.add_row(prompt.replace("\n", " ")[:48], str(kept))
    table.add_row("mean", f"{report.mean_agreement:.1f}", style="bold")
    console.print(table)
    sizes = Table(title=f"perplexity over {report.text_tokens} tokens, and size")
    for column in ("", "float", "quantized", "ratio"):
        sizes.add_column(column, justify="right" if column else "left")
    sizes.add_row(
        "perplexity",
        f"{report.float_perplexity:.3f}",
        f"{report.quantized_perplexity:.3f}",
        f"{report.quantized_perplexity / report.float_perplexity:.3f}x",
    )
    sizes.add_row(
        "context", as_mb(report.float_bytes), as_mb(report.quantized_bytes),
        f"{report.quantized_bytes / report.float_bytes:.3f}x",
    )  # fmt: skip
    console.print(sizes)


def _lora_choice(value: str) -> tuple[str, list[tuple[str, float]]]:
    """`NAME[,ALPHA_NAME,VALUE...]` as genie-t2t-run takes it."""
    name, *rest = value.split(",")
    if not name or len(rest) % 2:
        raise click.BadParameter(f"{value!r}: give NAME or NAME,ALPHA_NAME,VALUE[,ALPHA_NAME,VALUE...]")
    try:
        pairs = [(rest[i], float(rest[i + 1])) for i in range(0, len(rest), 2)]
    except ValueError:
        raise click.BadParameter(f"{value!r}: strengths are numbers") from None
    return name, pairs


_dialog_config = click.option(
    "-c",
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A Genie dialog config (genie_config.json).",
)


@t2t.command("run")
@_dialog_config
@click.option("-p", "--prompt", help="The prompt (raw text: apply the model's chat template yourself).")
@click.option("--prompt-file", type=click.Path(dir_okay=False, path_type=Path), help="Read the prompt from a file.")
@click.option("-l", "--lora", "lora", metavar="NAME[,ALPHA_NAME,VALUE...]", help="Apply an adapter, set strengths.")
@click.option("--greedy", is_flag=True, help="Take the most likely token each step.")
@click.option("--temp", "temperature", type=float, help="Sampling temperature (0: greedy).")
@click.option("--top-k", type=int)
@click.option("--top-p", type=float)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True, help="Drop tokens below this x the likeliest's.")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True, help="OpenAI's, over the reply.")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True, help="OpenAI's, over the reply.")
@click.option("--seed", type=int)
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--min-new-tokens", type=int, default=0, show_default=True)
@click.option("--stop", multiple=True, help="Stop when the text contains this (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def t2t_run(
    config_path: Path,
    prompt: str | None,
    prompt_file: Path | None,
    lora: str | None,
    greedy: bool,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float,
    min_p: float,
    presence_penalty: float,
    frequency_penalty: float,
    seed: int | None,
    max_new_tokens: int,
    min_new_tokens: int,
    stop: tuple[str, ...],
    as_json: bool,
) -> None:
    """Generate text, streamed as it comes (genie-t2t-run)."""
    from quiver.t2t.dialog import Dialog

    if (prompt is None) == (prompt_file is None):
        raise click.BadParameter("give -p PROMPT or --prompt-file F")
    text = prompt if prompt is not None else read_text(prompt_file, what="prompt file")  # type: ignore[arg-type]
    with Dialog.from_config(config_path) as dialog:
        if lora is not None:
            name, strengths = _lora_choice(lora)
            dialog.apply_lora(name)
            for alpha, value in strengths:
                dialog.set_lora_strength(alpha, value)

        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        result = dialog.query(
            text,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            greedy=True if greedy else None,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            on_token=None if as_json else stream,
            stop=stop,
            min_p=min_p,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
        )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "prompt_ids": result.prompt_ids,
                    "new_ids": result.new_ids,
                    "text": result.text,
                    "stop_reason": result.stop_reason,
                    "prefill_tok_s": round(result.prefill_tok_s, 2),
                    "decode_tok_s": round(result.decode_tok_s, 2),
                }
            )
        )
    else:
        sys.stdout.write("\n")


# A paragraph of plain English: tuning measures steps on real text (repeated to the length asked for).
_SAMPLE_TEXT = (
    "The history of the river begins in the mountains, where snow melts each spring and feeds small streams "
    "that join below the pass. Farmers along its banks have measured the floods for centuries, and their "
    "records tell of dry years, wet years, and the slow change of the valley as towns grew and bridges rose. "
)


@t2t.command("tune")
@_dialog_config
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Tuned .qctx.")
@click.option("--prompt-tokens", type=click.IntRange(1), default=128, show_default=True, help="Sample prompt length.")
@tuning_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def t2t_tune(config_path: Path, output: Path, prompt_tokens: int, as_json: bool, **options: Any) -> None:
    """Tune the prefill and decode graphs on steps of a real prompt; greedy tokens must not change.

    Point the config's ctx-bins at the output (or write the output over the context: it is replaced
    atomically) and generation uses the tuned settings on this device tier.
    """
    from quiver.t2t.dialog import Dialog
    from quiver.tuning.workload import workload_of

    with Dialog.from_config(config_path) as dialog:
        ids: list[int] = []
        while len(ids) < prompt_tokens:
            ids += dialog.tokenizer.encode(_SAMPLE_TEXT)
        samples = dialog.sample_feeds(ids[:prompt_tokens])
        workloads = [workload_of(dialog.context, graph, feeds) for graph, feeds in samples.items()]
        result = run_tuning(dialog.context, [], (), {}, output, workloads=workloads, **options)
    if as_json:
        emit_json(result.to_json())
    else:
        print_tuning(result)

"""`quiver t2t export`: a transformers causal-LM folder (and PEFT adapters) -> prefill + decode context.

Writes into OUT: `model.qctx` (graphs "prefill" and "decode", and "batch", the batched graph `quiver
serve` decodes many sequences with, each row on its own adapter slot, with "batch_decode", its decode step,
where that is a graph of its own; one copy of every weight), one super
section per adapter (`<name>.qsec`, updating both graphs), `tokenizer.json` and `genie_config.json`.
Reads safetensors directly and builds the graph itself (`quiver.t2t.graph`): no torch needed.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quiver import portable
from quiver.errors import ExportResourceError, FileAccessError, ModelFolderError, QuantizationError
from quiver.formats.files import read_regular, read_text
from quiver.formats.writer import write_atomically, write_text_atomically
from quiver.ir.deferred import Deferred
from quiver.lora.create import ALPHA_INPUT, use_case_values
from quiver.lora.peft import load_peft_adapter
from quiver.lora.prepare import UseCase, lora_graph, section_metadata
from quiver.passes.load import materialized
from quiver.runtime.context import Context
from quiver.t2t.config import (
    BATCH_DECODE_GRAPH,
    BATCH_GRAPH,
    DECODE_GRAPH,
    DEFAULT_PREFILL_WINDOW,
    PREFILL_GRAPH,
    DialogConfig,
    LoraAdapterConfig,
    SamplerConfig,
    dialog_config_document,
)
from quiver.t2t.families import DecoderConfig, read_config
from quiver.t2t.gguf_model import GgufModel, is_gguf
from quiver.t2t.graph import HEAD_ROWS, INPUT_IDS, LM_HEAD_NODE, build_decoder, decode_step_graph
from quiver.t2t.hf import SafetensorsWeights, token_ids
from quiver.t2t.quantizers import (
    ACCURACY_LEVELS,
    CALIBRATED,
    DEFAULT_QUANTIZER,
    HEAD_WEIGHT,
    MINIMUM_FORM,
    SHORTLIST,
    TABLE_BITS,
    Override,
    calibration_moments,
    carried_head,
    head_bits,
    joined_blocks,
    quantize_weights,
    with_given_blocks,
)
from quiver.t2t.tokenizer import TextTokenizer

if TYPE_CHECKING:
    import onnx

    from quiver.passes.gptq import BlockWeights
    from quiver.t2t.quantizers import Blocks

DEFAULT_CONTEXT_SIZE = 2048
BASE_USE_CASE = "base"  # the use case written beside the adapters' with every adapter off (Genie's base)
CONTEXT_FILE, TOKENIZER_FILE, CONFIG_FILE = "model.qctx", "tokenizer.json", "genie_config.json"
CHAT_FILES = ("tokenizer_config.json", "chat_template.jinja")
_FOREIGN_ADAPTER = (
    "they are not projections of this model (q/k/v/o_proj, gate/up/down_proj): is the adapter for another model?"
)


@dataclass(frozen=True)
class ExportOptions:
    context_size: int = DEFAULT_CONTEXT_SIZE
    prefill_window: int = DEFAULT_PREFILL_WINDOW
    weight_bits: int | None = None  # 4 or 8: MatMul weights quantized blockwise (ORT's MatMulNBits)
    block_size: int = 32
    n_threads: int = 0
    quantizer: str = DEFAULT_QUANTIZER  # how (`quiver.t2t.quantizers.QUANTIZERS`)
    calibration: tuple[str, ...] = ()  # prompts the calibrated quantizers (GPTQ) run the float model on
    # ORT's compute for quantized weights, written into the config (None: the quantizer's choice)
    accuracy_level: int | None = None
    # per-weight bits, `quiver.t2t.quantizers.parse_override`'s rules in order (the LM head: lm_head.weight)
    overrides: tuple[Override, ...] = ()
    # a GGUF file's Q4_0/Q4_1 blocks without --weight-bitwidth: "carry" them as they are, or "dequantize"
    gguf_blocks: str = "carry"


def _accuracy_level(options: ExportOptions) -> int | None:
    """The accuracy level the config asks for: the user's, else the quantizer's (None for float weights)."""
    if options.accuracy_level is not None or options.weight_bits is None:
        return options.accuracy_level
    return ACCURACY_LEVELS.get(options.quantizer)


def _copied(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a graph's skeleton (its large weights are placeholders: cheap)."""
    copy = type(model)()
    copy.CopyFrom(model)
    return copy


def _packs_weights(model: onnx.ModelProto, updateable: set[str]) -> bool:
    """Whether ORT packs stored weights of this graph in each session, a copy no other session shares: a
    float MatMul's, Gemm's or FusedMatMul's B (adapters' small updateable ones aside), or the experts of a
    MoE or QMoE node (1.32's QMoE packs its own copy per session: 581 MB again for a second session of a
    1.6B Qwen3-MoE-shaped int4 model, measured)."""
    stored = {t.name for t in model.graph.initializer} - updateable
    return any(
        (n.op_type in ("MatMul", "Gemm", "FusedMatMul") and len(n.input) > 1 and n.input[1] in stored)
        or n.op_type in ("MoE", "QMoE")
        for n in model.graph.node
    )


def _carried_blocks(
    weights: GgufModel, config: DecoderConfig
) -> tuple[dict[str, Callable[[], Blocks]], dict[str, bool]]:
    """A GGUF file's 4-bit tensors to run as they are, by weight name, and whether q/k/v and gate/up can run
    as one MatMul each (every layer's parts carried: their blocks side by side, fewer nodes a step)."""
    blocks: dict[str, Callable[[], Blocks]] = {
        name: partial(weights.blocks, name) for name in weights.names() if weights.has_blocks(name)
    }
    joinable = {}
    for key, joined, parts in (
        ("fuse_qkv", "self_attn.qkv_proj", (config.q, config.k, config.v)),
        ("fuse_gate_up", "mlp.gate_up_proj", (config.gate, config.up)),
    ):
        names = [[config.module(layer, f"{part}.weight") for part in parts] for layer in range(config.layers)]
        joinable[key] = all(name in blocks for layer in names for name in layer)
        for layer, layer_names in enumerate(names if joinable[key] else []):
            blocks[config.module(layer, f"{joined}.weight")] = partial(joined_blocks, [blocks[n] for n in layer_names])
    return blocks, joinable


def _generation_config(folder: Path) -> dict[str, Any]:
    """generation_config.json (sampling defaults, extra eos ids) where the model ships one, else {}."""
    path = folder / "generation_config.json"
    try:
        raw = json.loads(read_text(path, limit=1 << 20, what="generation_config.json")) if path.is_file() else {}
    except (FileAccessError, ValueError, RecursionError) as exc:
        raise ModelFolderError(f"{path}: not readable JSON ({exc})") from None
    return raw if isinstance(raw, dict) else {}


def _number(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else default


def _sampler_defaults(generation: dict[str, Any]) -> SamplerConfig:
    """The model's own sampling settings, where it ships them (greedy unless it samples)."""
    defaults = SamplerConfig()
    return SamplerConfig(
        seed=defaults.seed,
        temperature=_number(generation, "temperature", defaults.temperature),
        top_k=int(_number(generation, "top_k", 0)),
        top_p=min(_number(generation, "top_p", 1.0), 1.0),
        greedy=generation.get("do_sample") is not True,
    )


def _eos_tokens(folder: Path, config: DecoderConfig, generation: dict[str, Any]) -> tuple[int, ...]:
    """Every end-of-sequence id the model names (config.json and generation_config.json), in order."""
    ids = tuple(dict.fromkeys(config.eos_token_ids + token_ids(generation.get("eos_token_id"))))
    if not ids:
        raise ModelFolderError(f"{folder}: no eos_token_id in config.json or generation_config.json")
    return ids


@dataclass(frozen=True)
class _Need:
    memory: int  # bytes of memory the export's largest step takes, about
    disk: int  # bytes the context takes


# What writing takes beyond the largest tensor it makes (float32, from a source it reads whole and a
# transposed slice of columns being quantized): measured peaks were 1.9-2.0x the largest tensor plus the
# interpreter, ONNX Runtime and the graphs (Llama-3.2-1B/3B shapes, fp32 and int4)
_MEMORY_OVERHEAD = 512 << 20


def _check_room(out: Path, stored: int, largest: int) -> _Need:
    """Refuses (one line) an export the machine has not the free memory or disk for, before it starts
    writing: the kernel would otherwise kill it without a word, or it would stop half-way."""
    need = _Need(memory=2 * largest + _MEMORY_OVERHEAD, disk=stored + (64 << 20))
    free = shutil.disk_usage(out).free
    if free < need.disk:
        raise ExportResourceError(f"{out}: the context needs about {need.disk / 1e9:.1f} GB on disk and "
                                  f"{free / 1e9:.1f} GB are free there: free space or choose another "
                                  "--output-dir")  # fmt: skip
    available = portable.available_memory()
    if available is not None and available < need.memory:
        raise ExportResourceError(f"the export needs about {need.memory / 1e9:.1f} GB of memory (its largest "
                                  f"tensor is {largest / 1e9:.1f} GB in float32) and {available / 1e9:.1f} GB are "
                                  "available: close other programs or export on a larger machine")  # fmt: skip
    return need


def copy_tokenizer(folder: Path, out: Path) -> None:
    """The model's tokenizer.json, and its chat template where it has one (`quiver serve` renders it),
    into the export's folder."""
    if (folder / TOKENIZER_FILE).resolve() != (out / TOKENIZER_FILE).resolve():
        write_atomically(out / TOKENIZER_FILE, read_regular(folder / TOKENIZER_FILE))
    for chat_file in CHAT_FILES:
        source = folder / chat_file
        if source.is_file() and source.resolve() != (out / chat_file).resolve():
            write_atomically(out / chat_file, read_regular(source, limit=16 << 20, what=chat_file))


def export(
    model_dir: str | Path,
    out_dir: str | Path,
    adapters: Mapping[str, str | Path] | None = None,
    use_cases: Sequence[UseCase] | None = None,
    options: ExportOptions = ExportOptions(),
    on_step: Callable[[str], object] = lambda _: None,
    on_weight: Callable[[str], object] = lambda _: None,
) -> DialogConfig:
    """Exports the model and a section per use case (default: each adapter alone, at strength 1); returns
    the dialog config it wrote. Use cases without adapters need no section: the context runs as the base.
    Streams: each weight is read, converted, quantized and written on its own (`on_weight(name)` before
    each), so memory holds about one tensor, not the model."""
    folder, out = Path(model_dir), Path(out_dir)
    weights: SafetensorsWeights | GgufModel
    if is_gguf(folder):  # llama.cpp's file: config, weights and tokenizer from it
        weights = GgufModel(folder)
        config, generation = weights.config, {}
        weights.write_tokenizer(out)
        tokenizer = out / TOKENIZER_FILE
    else:
        config = read_config(folder)
        generation = _generation_config(folder)
        tokenizer = folder / TOKENIZER_FILE
        if not tokenizer.is_file():
            raise ModelFolderError(f"{folder} has no tokenizer.json (save the tokenizer with a fast tokenizer)")
        weights = SafetensorsWeights(folder)  # the headers only: each tensor is read when the graph needs it
    size = min(options.context_size, config.max_positions)
    if size < 2 or options.prefill_window < 1:
        raise ModelFolderError(
            f"context size {options.context_size} and prefill window {options.prefill_window} must be >= 2 and >= 1"
        )
    if options.weight_bits is not None and options.quantizer in CALIBRATED and not options.calibration:
        raise QuantizationError(f"the {options.quantizer} quantizer needs calibration prompts: give --calibration FILE")
    out.mkdir(parents=True, exist_ok=True)
    loaded = {name: load_peft_adapter(path, name) for name, path in (adapters or {}).items()}
    on_step("reading weights and building the graph")
    # q, k and v in one MatMul (fewer, larger kernels: ~4 % faster decoding), and gate and up in another (~3 %
    # more before malloc used huge pages; level within the noise since), unless adapters attach to them
    adapted = {module.rsplit(".", 1)[-1] for adapter in loaded.values() for module in adapter.modules}
    if config.qkv_layout == "per_head" and config.qkv is not None and config.qkv.rsplit(".", 1)[-1] in adapted:
        raise ModelFolderError(f"an adapter on {config.architecture}'s {config.qkv} (q, k and v fused head by head) "
                               "is not supported; adapt the other projections")  # fmt: skip
    # the LM head its own MatMul where it is quantized; a float head multiplies by the tied embedding itself
    tied = config.tie_embeddings
    head = head_bits(options.quantizer, options.overrides, tied, options.weight_bits) if options.weight_bits else None
    # a GGUF file's 4-bit blocks run as they are (unless asked to quantize again), fused where every part is
    carried = isinstance(weights, GgufModel) and options.weight_bits is None and options.gguf_blocks == "carry"
    blocks, joinable = _carried_blocks(weights, config) if isinstance(weights, GgufModel) and carried else ({}, {})
    if blocks:  # its tied head a shortlist (the file's own rows give the best tokens' logits), unless told
        head = carried_head(options.overrides, tied)
    elif options.overrides and not options.weight_bits:
        raise QuantizationError("--override sets bits of quantized weights: give --weight-bitwidth too (a GGUF "
                                f"file's carried blocks take {HEAD_WEIGHT}=... alone)")  # fmt: skip
    # a shortlist head rescores with float rows: a tied head's embedding, an untied one's kept copy
    rows = f"{config.embedding}.weight" if tied else HEAD_ROWS if head == SHORTLIST else None
    fused = {
        key: joinable.get(key, not carried) and not adapted & set(parts)
        for key, parts in (("fuse_qkv", ("q_proj", "k_proj", "v_proj")), ("fuse_gate_up", ("gate_proj", "up_proj")))
    }
    # every large weight a placeholder, its values read, converted and quantized when the context stores
    # it, once for all the graphs (they share it by name): one tensor in memory at a time
    deferred: dict[str, Deferred] = {}
    model, batched = (
        build_decoder(config, weights.deferred, size, **fused, head_as_matmul=head is not None, batched=b,
                      head_rows=head == SHORTLIST, deferred=deferred)
        for b in (False, True)
    )  # fmt: skip
    if config.tie_embeddings and isinstance(weights, SafetensorsWeights) and f"{config.head}.weight" in weights:
        weights.ignore(f"{config.head}.weight")  # transformers ties a saved head copy to the embedding too
    unused = weights.unused()
    if unused:  # a tensor the family's recipe has no place for: the model computes something Quiver does not
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        raise ModelFolderError(f"{folder}: the weights hold {unused[0]!r}{more}, which Quiver's "
                               f"{config.architecture} has no place for; the text would differ")  # fmt: skip
    cases = (
        [UseCase(n, [n], [1.0], None) for n in loaded] if use_cases is None else [u for u in use_cases if u.adapters]
    )  # use cases without adapters are the base model: the one base section below serves them all
    updateable: list[str] = []
    values: dict[str, dict[str, Any]] = {}
    if cases:
        on_step("attaching the LoRA adapters")
        # each attach point its own A, as in the batched graph, whose slots the sections fill by name
        graph = lora_graph(model, loaded, cases, PREFILL_GRAPH, remedy=_FOREIGN_ADAPTER, share_down_projections=False)
        model, updateable = graph.model, graph.updateable
        batched = lora_graph(batched, loaded, cases, BATCH_GRAPH, remedy=_FOREIGN_ADAPTER, per_row=True).model
        if BASE_USE_CASE not in {u.name for u in cases}:  # Genie's base use case: every adapter off, selectable
            cases.append(UseCase(BASE_USE_CASE, [], [], None))
        values = {u.name: use_case_values(graph.slots, loaded, u.adapters, graph.adapter_order) for u in cases}
    # float-minimum blocks (carried Q4_1, rtn-min, hqq) take another form in a decode step's graph, which
    # then is a graph of its own (sharing every weight): exact rows at int8 speed (see t2t.quantize)
    minimum_form = bool(blocks) or (options.weight_bits is not None and options.quantizer in MINIMUM_FORM)
    decode = _copied(model) if minimum_form else model
    if blocks:
        on_step(f"carrying {len(blocks)} 4-bit tensors of the GGUF file as they are")
        model, batched = (with_given_blocks(m, 32, blocks, deferred) for m in (model, batched))
        decode = with_given_blocks(decode, 32, blocks, deferred, exact_rows=True)
        if head is not None:  # the head alone (every other weight carried, or float as the file has it) and
            # the token table in 8-bit blocks (a file's Q8_0 table comes back as it is)
            def only_head(m: onnx.ModelProto, exact_rows: bool = False) -> onnx.ModelProto:
                others = {n.input[1] for n in m.graph.node if n.op_type == "MatMul" and n.name != LM_HEAD_NODE}
                return quantize_weights(
                    m, bits=4, block_size=32, exclude=others | set(updateable), head=LM_HEAD_NODE, quantizer="rtn-min",
                    overrides=((HEAD_WEIGHT, head),), head_rows=rows, deferred=deferred, table_bits=TABLE_BITS,
                    exact_rows=exact_rows,
                )  # fmt: skip

            model, batched, decode = only_head(model), only_head(batched), only_head(decode, exact_rows=True)
    if options.weight_bits is not None:
        moments = None
        solved: dict[str, BlockWeights] = {}  # GPTQ's blocks, found for the prefill graph, reused by the batched one
        if options.quantizer in CALIBRATED:
            on_step(f"measuring the float model's inputs on {len(options.calibration)} calibration prompts")
            text = TextTokenizer(tokenizer)
            prompts = [text.encode(p)[:size] for p in options.calibration]  # no longer than the cache
            # the float model run in memory: the one step that holds every weight at once
            moments = calibration_moments(materialized(model, deferred), prompts, updateable)
        on_step(f"quantizing weights to {options.weight_bits} bits ({options.quantizer})")
        quantize = partial(
            quantize_weights,
            bits=options.weight_bits,
            block_size=options.block_size,
            exclude=set(updateable),
            head=LM_HEAD_NODE,
            quantizer=options.quantizer,
            overrides=options.overrides,
            moments=moments,
            solved=solved,
            head_rows=rows,
            deferred=deferred,
            table_bits=TABLE_BITS,
        )
        model, batched = (quantize(m) for m in (model, batched))
        decode = quantize(decode, exact_rows=True) if minimum_form else model
    # a decode step's graph of its own (every weight shared) runs Quiver's attention for one row; where ORT
    # would pack weights of it, the step stays the prefill graph's body: one session packs them once
    if decode is not model or not _packs_weights(model, set(updateable)):
        decode = decode_step_graph(decode)
    # the server's decode steps likewise, in a graph of their own where no weight is packed (its prompts stay
    # on the batched graph); else steps and prompts share one session, as before
    batch_step = None if _packs_weights(batched, set(updateable)) else decode_step_graph(batched)
    graphs = (model, decode, batched, *([batch_step] if batch_step is not None else []))
    stored = sorted({t.name for m in graphs for t in m.graph.initializer if t.name in deferred})
    need = _check_room(
        out, sum(deferred[n].nbytes for n in stored), max((d.nbytes for d in deferred.values()), default=0)
    )
    counted = iter(range(1, len(stored) + 1))
    on_step("writing the context (prefill and decode share every weight)")

    def storing(name: str) -> None:
        on_weight(name)
        on_step(f"writing weight {next(counted, len(stored))} of {len(stored)}: {name}")

    context = Context.create("reference", workdir=out)
    add = partial(context.add_graph, on_weight=storing, deferred=deferred)
    try:
        add(PREFILL_GRAPH, model, updateable=updateable)
        add(DECODE_GRAPH, decode, input_shapes={INPUT_IDS: [1, 1]}, updateable=updateable)
        add(BATCH_GRAPH, batched)
        if batch_step is not None:
            add(BATCH_DECODE_GRAPH, batch_step)
        context.finalize()
        context.save(out / CONTEXT_FILE)
        sections = {}
        for case in cases:
            on_step(f"writing the section of use case {case.name}")
            context.update_context_tensors(values[case.name])
            context.finalize()
            sections[case.name] = out / f"{case.name}.qsec"
            metadata = section_metadata(case, list(loaded))
            write_atomically(sections[case.name], context.get_binary_section(None, metadata))
    except MemoryError:
        raise ExportResourceError(f"the export ran out of memory; it needs about {need.memory / 1e9:.1f} GB "
                                  "free: close other programs or export on a larger machine") from None  # fmt: skip
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ExportResourceError(f"{out}: the disk filled up; the context needs about {need.disk / 1e9:.1f} GB "
                                  "there: free space or choose another --output-dir") from None  # fmt: skip
    finally:
        context.close()
    if not isinstance(weights, GgufModel):
        copy_tokenizer(folder, out)
    dialog = DialogConfig(
        path=out / CONFIG_FILE,
        context_size=size,
        n_vocab=config.vocab,
        bos_token=config.bos_token_id,
        eos_tokens=_eos_tokens(folder, config, generation),
        pad_token=config.pad_token_id,
        sampler=_sampler_defaults(generation),
        tokenizer=out / TOKENIZER_FILE,
        n_threads=options.n_threads,
        backend="cpu",
        ctx_bins=(out / CONTEXT_FILE,),
        alpha_tensor=ALPHA_INPUT if cases else None,
        adapters={c.name: LoraAdapterConfig(c.name, tuple(c.adapters), (sections[c.name],)) for c in cases},
        prefill_window=options.prefill_window,
        accuracy_level=_accuracy_level(options),
    )
    write_text_atomically(dialog.path, json.dumps(dialog_config_document(dialog, out), indent=2) + "\n")
    return dialog

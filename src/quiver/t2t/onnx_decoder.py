"""Decoders already exported to ONNX with KV-cache inputs and outputs (onnxruntime-genai's model builder,
optimum's exporter), packed into a context and a Genie config that `quiver t2t run` drives.

The graph's inputs are checked first: `input_ids`, `attention_mask`, optionally `position_ids`, and a
`past_key_values.N.key/value` pair per layer (each `present.N.key/value` the step's cache out), `logits`
out. Anything else is refused in one line naming it. genai's `genai_config.json` says whether past and
present share one buffer of the whole context (`past_present_share_buffer`, GroupQueryAttention's
in-place mode: "shared") or the past grows by each step's present ("growing"); without it the cache
grows, as optimum's graphs need.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiver.errors import FileAccessError, ModelFolderError
from quiver.formats.files import read_text
from quiver.formats.writer import write_text_atomically
from quiver.runtime.context import Context
from quiver.t2t.config import (
    DECODE_GRAPH,
    DEFAULT_PREFILL_WINDOW,
    PREFILL_GRAPH,
    DialogConfig,
    SamplerConfig,
    dialog_config_document,
)
from quiver.t2t.export import CONFIG_FILE, CONTEXT_FILE, TOKENIZER_FILE, copy_tokenizer
from quiver.t2t.graph import PAST, PRESENT
from quiver.t2t.hf import token_ids

INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"
GENAI_CONFIG = "genai_config.json"
MODEL_FILES = ("model.onnx", "decoder_model_merged.onnx", "decoder_with_past_model.onnx")
_PAST_NAME = re.compile(r"past_key_values\.(\d+)\.(key|value)")
_INT64, _FLOAT = 7, 1  # ONNX element types


@dataclass(frozen=True)
class OnnxDecoder:
    """What the importer found: the model file, its layers' cache shape and the optional inputs it takes."""

    model: Path
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    position_ids: bool
    shared_buffer: bool
    context_length: int | None  # the most positions the model was built for, where it says


def _dims(value: Any) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in value.type.tensor_type.shape.dim]


def _known_dims(genai: dict[str, Any], hf: dict[str, Any]) -> tuple[object, object]:
    """kv_heads and head_dim as the model's configs say (genai's graphs leave head_dim symbolic)."""
    decoder = genai.get("model", {}).get("decoder", {}) if genai else {}
    if isinstance(decoder, dict) and "head_size" in decoder:
        return decoder.get("num_key_value_heads"), decoder.get("head_size")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = hf.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    )
    return hf.get("num_key_value_heads", heads), head_dim


def read_decoder(folder: Path, genai: dict[str, Any], hf: dict[str, Any] | None = None) -> OnnxDecoder:
    """The folder's decoder graph, its inputs and outputs checked against what a step feeds and reads."""
    import onnx

    decoder = genai.get("model", {}).get("decoder", {}) if genai else {}
    named = decoder.get("filename") if isinstance(decoder, dict) else None
    candidates = [named] if isinstance(named, str) else list(MODEL_FILES)
    model = next((folder / c for c in candidates if Path(c).name == c and (folder / c).is_file()), None)
    if model is None:
        raise ModelFolderError(f"{folder}: no decoder model ({', '.join(candidates)}); give an ONNX decoder's folder")
    try:  # the graph's structure only: weights stay in their external data file
        graph = onnx.load(str(model), load_external_data=False).graph
    except Exception as exc:
        raise ModelFolderError(f"{model}: not a readable ONNX model ({str(exc)[:200]})") from None
    initializers = {t.name for t in graph.initializer}
    inputs = {v.name: v for v in graph.input if v.name not in initializers}
    outputs = {v.name: v for v in graph.output}
    past = {name: _PAST_NAME.fullmatch(name) for name in inputs if name.startswith(PAST)}
    unknown = [n for n in inputs if n not in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS) and not past.get(n)]
    if unknown:
        raise ModelFolderError(
            f"{model}: input(s) {unknown[:4]} are not a decoder step's (input_ids, attention_mask, position_ids, "
            "past_key_values.N.key/value); Quiver cannot feed them"
        )
    missing = [n for n in (INPUT_IDS, ATTENTION_MASK) if n not in inputs] + [n for n in (LOGITS,) if n not in outputs]
    layers = len(past) // 2
    pairs = [(f"{PAST}{i}.key", f"{PAST}{i}.value") for i in range(layers)]
    missing += [n for pair in pairs for n in pair if n not in inputs]
    missing += [PRESENT + n[len(PAST) :] for pair in pairs for n in pair if PRESENT + n[len(PAST) :] not in outputs]
    if missing or not layers or len(past) % 2:
        raise ModelFolderError(
            f"{model}: a decoder with a KV cache takes input_ids, attention_mask and past_key_values.N.key/value "
            f"and gives logits and present.N.key/value; {missing[:4] or 'no past_key_values'} missing"
        )
    if (
        inputs[INPUT_IDS].type.tensor_type.elem_type != _INT64
        or inputs[ATTENTION_MASK].type.tensor_type.elem_type != _INT64
    ):
        raise ModelFolderError(f"{model}: input_ids and attention_mask must be int64")
    shapes = {tuple(_dims(inputs[n])) for pair in pairs for n in pair}
    said = _known_dims(genai, hf or {})
    kv = {
        tuple(d if isinstance(d, int) else said[i] for i, d in enumerate((s[1], s[3]))) for s in shapes if len(s) == 4
    }
    logits = _dims(outputs[LOGITS])
    if len(kv) != 1 or not all(isinstance(d, int) for d in next(iter(kv))) or not isinstance(logits[-1], int):
        raise ModelFolderError(
            f"{model}: every past_key_values input must be [batch, kv_heads, positions, head_dim] with fixed "
            f"kv_heads and head_dim, and logits end in the vocabulary size; found {sorted(shapes)[:2]}, logits {logits}"
        )
    if any(inputs[n].type.tensor_type.elem_type != _FLOAT for pair in pairs for n in pair):
        raise ModelFolderError(f"{model}: a float32 KV cache is what Quiver feeds; this model's is another type")
    kv_heads, head_dim = (d if isinstance(d, int) else 0 for d in next(iter(kv)))  # ints: checked above
    search = genai.get("search", {}) if genai else {}
    length = genai.get("model", {}).get("context_length") if genai else None
    return OnnxDecoder(
        model=model,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=int(logits[-1]),
        position_ids=POSITION_IDS in inputs,
        shared_buffer=bool(search.get("past_present_share_buffer", False)) if isinstance(search, dict) else False,
        context_length=length if isinstance(length, int) and length > 1 else None,
    )


def is_onnx_decoder_folder(folder: Path) -> bool:
    """Whether `folder` holds an ONNX decoder rather than a transformers model (no safetensors weights)."""
    return (folder / GENAI_CONFIG).is_file() or (
        any((folder / f).is_file() for f in MODEL_FILES) and not any(folder.glob("*.safetensors"))
    )


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(read_text(path, limit=1 << 20, what=path.name))
    except (FileAccessError, ValueError, RecursionError) as exc:
        raise ModelFolderError(f"{path}: not readable JSON ({exc})") from None
    return raw if isinstance(raw, dict) else {}


def import_decoder(
    model_dir: str | Path,
    out_dir: str | Path,
    context_size: int,
    prefill_window: int = DEFAULT_PREFILL_WINDOW,
    on_step: Callable[[str], object] = lambda _: None,
) -> DialogConfig:
    """Packs the folder's decoder into `out_dir/model.qctx` (graphs "prefill" and "decode", weights once)
    and writes the tokenizer, chat template and `genie_config.json`; returns the dialog config."""
    folder, out = Path(model_dir), Path(out_dir)
    genai = _json(folder / GENAI_CONFIG)
    hf = _json(folder / "config.json")
    decoder = read_decoder(folder, genai, hf)
    tokenizer = folder / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise ModelFolderError(f"{folder} has no tokenizer.json: save the model's fast tokenizer beside it")
    size = min(context_size, decoder.context_length or context_size)
    if size < 2 or prefill_window < 1:
        raise ModelFolderError(f"context size {context_size} and prefill window {prefill_window} must be >= 2 and >= 1")
    model_info = genai.get("model", {}) if genai else hf
    eos = token_ids(model_info.get("eos_token_id")) or token_ids(hf.get("eos_token_id"))
    if not eos:
        raise ModelFolderError(f"{folder}: no eos_token_id in {GENAI_CONFIG} or config.json")
    bos = token_ids(model_info.get("bos_token_id"))
    pad = token_ids(model_info.get("pad_token_id"))
    positions: int | str = size if decoder.shared_buffer else "past_sequence_length"
    kv: list[int | str] = [1, decoder.kv_heads, positions, decoder.head_dim]
    cache = {f"{PAST}{i}.{part}": kv for i in range(decoder.layers) for part in ("key", "value")}
    optional: dict[str, list[int | str]] = {POSITION_IDS: [1, "sequence_length"]} if decoder.position_ids else {}
    shapes: dict[str, list[int | str]] = {ATTENTION_MASK: [1, "total_sequence_length"], **optional, **cache}
    out.mkdir(parents=True, exist_ok=True)
    on_step(f"packing {decoder.model.name} (prefill and decode share every weight)")
    context = Context.create("reference", workdir=out)
    try:
        context.add_graph(PREFILL_GRAPH, decoder.model, {INPUT_IDS: [1, "sequence_length"], **shapes})
        one = {POSITION_IDS: [1, 1]} if decoder.position_ids else {}
        context.add_graph(DECODE_GRAPH, decoder.model, {INPUT_IDS: [1, 1], **shapes, **one})
        context.finalize()
        context.save(out / CONTEXT_FILE)
    finally:
        context.close()
    copy_tokenizer(folder, out)
    dialog = DialogConfig(
        path=out / CONFIG_FILE,
        context_size=size,
        n_vocab=decoder.vocab,
        bos_token=bos[0] if bos else None,
        eos_tokens=eos,
        pad_token=pad[0] if pad else None,
        sampler=SamplerConfig(greedy=True),
        tokenizer=out / TOKENIZER_FILE,
        n_threads=0,
        backend="cpu",
        ctx_bins=(out / CONTEXT_FILE,),
        prefill_window=prefill_window,
        kv_cache="shared" if decoder.shared_buffer else "growing",
    )
    write_text_atomically(dialog.path, json.dumps(dialog_config_document(dialog, out), indent=2) + "\n")
    return dialog

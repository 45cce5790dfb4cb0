"""Genie's dialog config (`genie_config.json`): read with typed errors, written by `quiver t2t export`.

The keys are Genie's (`dialog` → `context`, `sampler`, `tokenizer`, `engine` → `model` → `binary` →
`ctx-bins`, `lora`). Quiver adds one block of its own, `engine.model.binary.quiver` (graph names and
the prefill window), which Genie ignores; a config without it gets the defaults `quiver t2t export`
writes. QNN backend types (QnnHtp, QnnGpu, QnnGenAiTransformer…) run on Quiver's cpu backend.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quiver.errors import DialogConfigError
from quiver.formats.files import read_text

if TYPE_CHECKING:
    from quiver.backends.cpu import CpuBackend

PREFILL_GRAPH, DECODE_GRAPH = "prefill", "decode"
BATCH_GRAPH = "batch"  # many sequences per step, each row on its own adapter slot (`quiver serve`)
# the batch graph's decode step, where it is a graph of its own (Quiver's attention for one row a sequence)
BATCH_DECODE_GRAPH = "batch_decode"
# How the graphs take their KV cache and positions: "quiver" (`quiver t2t export`'s: seqlens_k and
# total_sequence_length, one fixed buffer); for decoders exported elsewhere (`quiver.t2t.onnx_decoder`), an
# attention mask with one fixed buffer that past and present share ("shared": onnxruntime-genai's
# past_present_share_buffer), or a past that grows by each step's present ("growing": optimum's, genai's other).
KV_CACHES = ("quiver", "shared", "growing")
DEFAULT_PREFILL_WINDOW = 128
_QNN_BACKENDS = {"QnnHtp", "QnnGpu", "QnnGenAiTransformer", "QnnCpu", "QnnDsp"}


@dataclass(frozen=True)
class SamplerConfig:
    seed: int = 42
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    greedy: bool = False


@dataclass(frozen=True)
class LoraAdapterConfig:
    name: str
    alphas: tuple[str, ...]  # the adapters (entries of the alpha tensor) this use case sets
    bin_sections: tuple[Path, ...]


@dataclass(frozen=True)
class DialogConfig:
    path: Path
    context_size: int
    n_vocab: int
    bos_token: int | None
    eos_tokens: tuple[int, ...]
    pad_token: int | None
    sampler: SamplerConfig
    tokenizer: Path
    n_threads: int
    backend: str
    ctx_bins: tuple[Path, ...]
    alpha_tensor: str | None = None
    adapters: dict[str, LoraAdapterConfig] = field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    prefill_graph: str = PREFILL_GRAPH
    decode_graph: str = DECODE_GRAPH
    prefill_window: int = DEFAULT_PREFILL_WINDOW
    # ORT's MatMulNBits compute for 4/8-bit weights (0: float activations; 4: int8); None: the backend's
    accuracy_level: int | None = None
    kv_cache: str = "quiver"  # one of KV_CACHES


def adapter_use_cases(config: DialogConfig) -> dict[str, LoraAdapterConfig]:
    """The config's use cases that apply adapters; one without any (Genie's base use case) is the base
    model, which a server serves under the model's own name."""
    return {name: adapter for name, adapter in config.adapters.items() if adapter.alphas}


def cpu_backend_for(
    config: DialogConfig, packed_weights: str | Path | None = None, lazy_prepack: bool = True
) -> CpuBackend:
    """The cpu backend the config's engine asks for: its threads, its accuracy level, its threads idle between
    runs (a prefill and the decode steps after it may run on different sessions, each with its own threads:
    one's spinning would slow the other's runs). Packed lazily (`lazy_prepack`), as the backend packs by
    default: a float model's first token comes from its mapped weights (Llama-3.2-1B fp32: 0.85 s to the
    first token instead of 5.7), its packed session replacing that one when ready; 4-bit weights are
    packed before their first run (the unpacked kernel computes otherwise, and far slower). Servers pack
    before they take requests (`lazy_prepack=False`)."""
    from quiver.backends.cpu import DEFAULT_ACCURACY_LEVEL, CpuBackend  # ORT loads with a model, not a config

    level = DEFAULT_ACCURACY_LEVEL if config.accuracy_level is None else config.accuracy_level
    return CpuBackend(
        config.n_threads,
        lazy_prepack=lazy_prepack,
        packed_weights=packed_weights,
        accuracy_level=level,
        spin_between_runs=False,
    )


def _object(raw: Any, where: str, source: Path) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise DialogConfigError(f"{source}: {where} must be a JSON object")
    return raw


def _number(raw: dict[str, Any], key: str, where: str, source: Path, kind: type, default: Any = None) -> Any:
    value = raw.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise DialogConfigError(
            f"{source}: {where}.{key} must be a{'' if kind is float else 'n integer'} number, not {value!r}"
        )
    return kind(value)


def _tokens(value: Any, where: str, source: Path) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise DialogConfigError(f"{source}: {where} must be a token id or a list of them, not {value!r}")
    return tuple(values)


def _file(base: Path, value: Any, where: str, source: Path, present: bool = True) -> Path:
    if not isinstance(value, str) or not value or "\0" in value:
        raise DialogConfigError(f"{source}: {where} must be a path, not {str(value)[:80]!r}")
    path = (base / value).resolve()
    if present and not path.is_file():
        raise DialogConfigError(f"{source}: {where} names {value!r}, which is not a file ({path}); check the config")
    return path


def read_dialog_config(path: str | Path, files_present: bool = True) -> DialogConfig:
    """A Genie dialog config; paths in it are relative to its folder, as Genie resolves them (and must name
    files, unless `files_present` is False: a config whose files are yet to be copied)."""
    source = Path(path)
    try:
        raw = json.loads(read_text(source, limit=16 << 20, what="dialog config"))
    except (OSError, ValueError, RecursionError) as exc:
        raise DialogConfigError(f"{source}: not a readable JSON dialog config ({exc})") from None
    base = source.resolve().parent
    dialog = _object(_object(raw, "the config", source).get("dialog"), "dialog", source)
    context = _object(dialog.get("context"), "dialog.context", source)
    sampler = _object(dialog.get("sampler", {}), "dialog.sampler", source)
    tokenizer = _object(dialog.get("tokenizer"), "dialog.tokenizer", source)
    engine = _object(dialog.get("engine"), "dialog.engine", source)
    backend = _object(engine.get("backend", {"type": "cpu"}), "dialog.engine.backend", source)
    model = _object(engine.get("model"), "dialog.engine.model", source)
    binary = _object(model.get("binary"), "dialog.engine.model.binary", source)
    ctx_bins = binary.get("ctx-bins")
    if not isinstance(ctx_bins, list) or len(ctx_bins) != 1:
        raise DialogConfigError(f"{source}: engine.model.binary.ctx-bins must list one context binary (.qctx)")
    kind = backend.get("type", "cpu")
    if not isinstance(kind, str):
        raise DialogConfigError(f'{source}: dialog.engine.backend.type must be a name such as "cpu", not {kind!r}')
    if kind in _QNN_BACKENDS:
        warnings.warn(f"{source}: backend {kind} is QNN's; Quiver runs this dialog on its cpu backend", stacklevel=2)
        kind = "cpu"
    if kind not in ("cpu", "reference"):
        raise DialogConfigError(f"{source}: backend type {kind!r} is unknown; use cpu (or a QNN type)")
    quiver = _object(binary.get("quiver", {}), "engine.model.binary.quiver", source)
    config = DialogConfig(
        path=source,
        context_size=_number(context, "size", "context", source, int),
        n_vocab=_number(context, "n-vocab", "context", source, int),
        bos_token=_tokens(context["bos-token"], "context.bos-token", source)[0] if "bos-token" in context else None,
        eos_tokens=_tokens(context.get("eos-token"), "context.eos-token", source),
        pad_token=_tokens(context["pad-token"], "context.pad-token", source)[0] if "pad-token" in context else None,
        sampler=SamplerConfig(
            seed=_number(sampler, "seed", "sampler", source, int, 42),
            temperature=_number(sampler, "temp", "sampler", source, float, 0.8),
            top_k=_number(sampler, "top-k", "sampler", source, int, 40),
            top_p=_number(sampler, "top-p", "sampler", source, float, 0.95),
            greedy=_flag(sampler, "greedy", "sampler", source),
        ),
        tokenizer=_file(base, tokenizer.get("path"), "tokenizer.path", source, files_present),
        n_threads=_number(engine, "n-threads", "engine", source, int, 0),
        backend=kind,
        ctx_bins=tuple(_file(base, p, "engine.model.binary.ctx-bins", source, files_present) for p in ctx_bins),
        prefill_graph=str(quiver.get("prefill-graph", PREFILL_GRAPH)),
        decode_graph=str(quiver.get("decode-graph", DECODE_GRAPH)),
        prefill_window=_number(quiver, "prefill-window", "quiver", source, int, DEFAULT_PREFILL_WINDOW),
        accuracy_level=_number(quiver, "accuracy-level", "quiver", source, int) if "accuracy-level" in quiver else None,
        kv_cache=_choice(quiver, "kv-cache", KV_CACHES, source),
        **_lora(binary.get("lora"), base, source, files_present),
    )
    _check_ranges(config)
    return config


def _choice(raw: dict[str, Any], key: str, choices: tuple[str, ...], source: Path) -> str:
    value = raw.get(key, choices[0])
    if value not in choices:
        raise DialogConfigError(f"{source}: quiver.{key} must be one of {list(choices)}, not {str(value)[:80]!r}")
    return str(value)


def _flag(raw: dict[str, Any], key: str, where: str, source: Path) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise DialogConfigError(f"{source}: {where}.{key} must be true or false, not {value!r}")
    return value


def _check_ranges(config: DialogConfig) -> None:
    """Every number within what it can mean on this machine; the first one out of range is named."""
    cores = os.cpu_count() or 1
    sampler = config.sampler
    checks: list[tuple[bool, str, object, str]] = [
        (config.context_size >= 2, "context.size", config.context_size, "at least 2"),
        (config.n_vocab >= 1, "context.n-vocab", config.n_vocab, "at least 1"),
        (0 <= config.n_threads <= cores, "engine.n-threads", config.n_threads, f"0 (all cores) to {cores}"),
        (config.prefill_window >= 1, "quiver.prefill-window", config.prefill_window, "at least 1"),
        (config.accuracy_level in (None, 0, 1, 2, 3, 4), "quiver.accuracy-level", config.accuracy_level,
         "0 (float activations), 1 (fp32), 2 (fp16), 3 (bf16) or 4 (int8)"),
        (0 <= sampler.seed < 2**63, "sampler.seed", sampler.seed, "0 to 2^63 - 1"),
        (0 <= sampler.temperature <= 100 and math.isfinite(sampler.temperature), "sampler.temp",
         sampler.temperature, "0 (greedy) to 100"),
        (sampler.top_k >= 0, "sampler.top-k", sampler.top_k, "0 (all) or more"),
        (0 < sampler.top_p <= 1, "sampler.top-p", sampler.top_p, "above 0, at most 1"),
    ]  # fmt: skip
    tokens = [("context.bos-token", config.bos_token), ("context.pad-token", config.pad_token)]
    tokens += [("context.eos-token", t) for t in config.eos_tokens]
    checks += [(t is None or t < config.n_vocab, name, t, f"a token id below n-vocab ({config.n_vocab})")
               for name, t in tokens]  # fmt: skip
    for holds, name, value, expected in checks:
        if not holds:
            raise DialogConfigError(f"{config.path}: {name} is {value!r}; it must be {expected}")


def _lora(raw: Any, base: Path, source: Path, files_present: bool) -> dict[str, Any]:
    if raw is None:
        return {}
    lora = _object(raw, "engine.model.binary.lora", source)
    alpha = lora.get("alpha-tensor-name")
    if not isinstance(alpha, str):
        raise DialogConfigError(f"{source}: lora.alpha-tensor-name must be the name of the alpha input")
    adapters = {}
    for entry in _list(lora, "adapters", source):
        entry = _object(entry, "lora.adapters[]", source)
        name = entry.get("name")
        alphas = entry.get("alphas", [])
        sections = entry.get("bin-sections")
        if not isinstance(name, str) or not isinstance(alphas, list) or not isinstance(sections, list) or not sections:
            raise DialogConfigError(f"{source}: each lora adapter needs a name, alphas and bin-sections")
        adapters[name] = LoraAdapterConfig(
            name,
            tuple(str(a) for a in alphas),
            tuple(_file(base, s, f"lora adapter {name!r} bin-sections", source, files_present) for s in sections),
        )
    groups = {}
    for group in _list(lora, "groups", source):
        group = _object(group, "lora.groups[]", source)
        members = _list(group, "members", source)
        if not isinstance(group.get("name"), str) or not all(isinstance(m, str) and m in adapters for m in members):
            raise DialogConfigError(f"{source}: lora group {group.get('name')!r} names adapters the config lacks")
        groups[group["name"]] = tuple(members)
    return {"alpha_tensor": alpha, "adapters": adapters, "groups": groups}


def _list(raw: dict[str, Any], key: str, source: Path) -> list[Any]:
    value = raw.get(key, [])
    if not isinstance(value, list):
        raise DialogConfigError(f"{source}: lora {key} must be a JSON list, not {value!r}")
    return value


def dialog_config_document(config: DialogConfig, relative_to: Path) -> dict[str, Any]:
    """The config as Genie's JSON, its paths relative to `relative_to` (the folder it is written in)."""

    def where(path: Path) -> str:
        try:
            return str(path.resolve().relative_to(relative_to.resolve()))
        except ValueError:
            return str(path.resolve())

    sampler = config.sampler
    binary: dict[str, Any] = {
        "version": 1,
        "ctx-bins": [where(p) for p in config.ctx_bins],
        "quiver": {
            "prefill-graph": config.prefill_graph,
            "decode-graph": config.decode_graph,
            "prefill-window": config.prefill_window,
        },
    }
    if config.accuracy_level is not None:
        binary["quiver"]["accuracy-level"] = config.accuracy_level
    if config.kv_cache != KV_CACHES[0]:
        binary["quiver"]["kv-cache"] = config.kv_cache
    if config.alpha_tensor is not None:
        binary["lora"] = {
            "version": 1,
            "alpha-tensor-name": config.alpha_tensor,
            "adapters": [
                {
                    "version": 1,
                    "name": a.name,
                    "alphas": list(a.alphas),
                    "bin-sections": [where(p) for p in a.bin_sections],
                }
                for a in config.adapters.values()
            ],
            "groups": [{"name": g, "members": list(m)} for g, m in config.groups.items()],
        }
    context: dict[str, Any] = {"version": 1, "size": config.context_size, "n-vocab": config.n_vocab}
    if config.bos_token is not None:
        context["bos-token"] = config.bos_token
    context["eos-token"] = list(config.eos_tokens) if len(config.eos_tokens) > 1 else config.eos_tokens[0]
    if config.pad_token is not None:
        context["pad-token"] = config.pad_token
    return {
        "dialog": {
            "version": 1,
            "type": "basic",
            "context": context,
            "sampler": {
                "version": 1,
                "seed": sampler.seed,
                "temp": sampler.temperature,
                "top-k": sampler.top_k,
                "top-p": sampler.top_p,
                "greedy": sampler.greedy,
            },
            "tokenizer": {"version": 1, "path": where(config.tokenizer)},
            "engine": {
                "version": 1,
                "n-threads": config.n_threads,
                "backend": {"version": 1, "type": config.backend},
                "model": {"version": 1, "type": "binary", "binary": binary},
            },
        }
    }

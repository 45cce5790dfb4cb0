"""Reads PEFT LoRA adapter folders (`adapter_config.json` + `adapter_model.safetensors`) without torch."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError  # type: ignore[attr-defined,unused-ignore]  # untyped before 0.5

from quiver.errors import AdapterError, FileAccessError
from quiver.formats.files import read_text

_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")
PEFT_PREFIX = _PREFIX
_DEFAULT_LAYER_PATTERNS = ("layers", "h", "block", "blocks", "layer")
MAX_SCALING = 1000.0  # |lora_alpha / r| (or / sqrt(r)): trained adapters are near 1 (PEFT's default: 1 to 2)
# Config options that change the math in ways Quiver does not implement.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "LoRA bias terms",
}


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{value!r} is not an integer")
    number = int(value)
    if number != float(value) or not 0 <= number < 1 << 31:
        raise ValueError(f"{value!r} is not a whole number in range")
    return number


def _integers(values: Any) -> list[int] | None:
    return None if values is None else [_integer(v) for v in values]


def _finite(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _texts(values: Any) -> list[str] | None:
    return None if values is None else [_text(v) for v in values]


def _regex_parser() -> Any:
    """The standard library's regex parser (`re._parser`, Python 3.11 on: the versions Quiver runs on)."""
    from re import _parser  # type: ignore[attr-defined]

    return _parser


def _check_regex(pattern: str, source: str) -> None:
    """Refuses a pattern that does not compile, or that nests repeats (exponential backtracking)."""
    try:
        parsed = _regex_parser().parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise AdapterError(f"{source}: {pattern!r} is not a valid regular expression ({exc})") from None

    def nested(items: Any, inside_repeat: bool) -> bool:
        for op, value in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                low, high, body = value
                repeats = high > 1
                if (inside_repeat and repeats) or nested(body, inside_repeat or repeats):
                    return True
            elif name == "SUBPATTERN":
                if nested(value[-1], inside_repeat):
                    return True
            elif name == "BRANCH":  # alternatives under a repeat can overlap: (a|a)* backtracks exponentially
                if inside_repeat or any(nested(branch, inside_repeat) for branch in value[1]):
                    return True
        return False

    if nested(parsed, False):
        raise AdapterError(
            f"{source}: pattern {pattern!r} repeats a repeat or alternatives (like (a+)+ or (a|b)*), which can "
            "take exponential time to match; write it without them"
        )


def _pattern_value(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rule: a pattern key applies when the module name ends with it at a dot boundary."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return None


@dataclass(frozen=True)
class LoraConfig:
    """The parts of PEFT's `LoraConfig` that decide which modules are adapted and how much. Not
    `fan_in_fan_out`: it says how the base layer stores its weight (GPT-2's Conv1D, [in, out]); the LoRA
    matrices are stored alike either way, and Quiver's branches (x Aᵀ Bᵀ beside the layer, or merged into
    an ONNX MatMul's [in, out] weight) read only them."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: list[int] | None = None
    layers_pattern: list[str] | None = None

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise AdapterError(f"adapter_config.json: r must be positive, got {self.r}")

    @classmethod
    def from_json(cls, raw: dict[str, Any], source: str) -> LoraConfig:
        if "rank" in raw and "r" not in raw:  # QNN/QAIRT adapter parameters: {name, rank, alpha, target_modules}
            raw = {**raw, "r": raw["rank"], "lora_alpha": raw.get("alpha", raw["rank"])}
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise AdapterError(f"{source}: peft_type {peft_type!r} is not LoRA; Quiver reads LoRA adapters only")
        for key, what in _UNSUPPORTED.items():
            if raw.get(key):
                raise AdapterError(f"{source}: {what} ({key}=true) is not supported; train a plain LoRA adapter")
        try:
            layers = raw.get("layers_to_transform")
            pattern = raw.get("layers_pattern")
            targets = raw.get("target_modules") or []
            config = cls(
                r=_integer(raw["r"]),
                lora_alpha=_finite(raw.get("lora_alpha", raw["r"])),
                target_modules=targets if isinstance(targets, str) else [_text(t) for t in targets],
                use_rslora=bool(raw.get("use_rslora", False)),
                rank_pattern={_text(k): _integer(v) for k, v in (raw.get("rank_pattern") or {}).items()},
                alpha_pattern={_text(k): _finite(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
                layers_to_transform=[_integer(layers)] if isinstance(layers, int) else _integers(layers),
                layers_pattern=[pattern] if isinstance(pattern, str) else _texts(pattern),
            )
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise AdapterError(f"{source}: not a valid LoRA config ({type(exc).__name__}: {exc})") from None
        # Every pattern is a regular expression (as in PEFT): compiled now, and refused when it could
        # take exponential time to match (nested repeats, the usual ReDoS shape).
        regexes = [*config.rank_pattern, *config.alpha_pattern, *(config.layers_pattern or [])]
        if isinstance(config.target_modules, str) and config.target_modules != "all-linear":
            regexes.append(config.target_modules)
        for regex in regexes:
            _check_regex(regex, source)
        return config

    def targets(self, module: str) -> bool:
        """Whether PEFT adapts this module (target_modules, then layers_to_transform)."""
        if self.target_modules == "all-linear":
            pass  # PEFT's shorthand for every linear layer
        elif isinstance(self.target_modules, str):
            if not re.fullmatch(self.target_modules, module):
                return False
        elif not any(module == t or module.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        patterns = self.layers_pattern or list(_DEFAULT_LAYER_PATTERNS)
        for pattern in patterns:
            found = re.match(rf".*\.{pattern}\.(\d+)\.", module)
            if found:
                return int(found.group(1)) in self.layers_to_transform
        return False

    def rank(self, module: str) -> int:
        value = _pattern_value(self.rank_pattern, module)
        return self.r if value is None else int(value)

    def scaling(self, module: str) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, per module after the patterns."""
        alpha = _pattern_value(self.alpha_pattern, module)
        alpha = self.lora_alpha if alpha is None else float(alpha)
        rank = self.rank(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


@dataclass(frozen=True)
class LoraModule:
    """One adapted module in PEFT's layout; scaling as PEFT computes it.

    Linear: A is [r, in], B is [out, r]. Conv: A is [r, in, kh, kw] (a conv like the base one), B is
    [out, r, 1, 1] (a 1x1 conv).
    """

    name: str
    lora_a: np.ndarray
    lora_b: np.ndarray
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])

    @property
    def is_conv(self) -> bool:
        return self.lora_a.ndim == 4

    def delta(self) -> np.ndarray:
        """ΔW in torch's layout ([out, in], or [out, in, kh, kw] for a conv): scaling · B·A."""
        if self.is_conv:
            return self.scaling * np.einsum("or,rihw->oihw", self.lora_b[:, :, 0, 0], self.lora_a)
        return self.scaling * (self.lora_b @ self.lora_a)


@dataclass(frozen=True)
class PeftAdapter:
    name: str
    config: LoraConfig
    modules: dict[str, LoraModule]  # module path as in the base model ("model.layers.0.self_attn.q_proj")


def _locate(path: Path) -> tuple[Path, Path]:
    """(config, weights) of a PEFT adapter folder, or of a QNN adapter-config JSON with its safetensors beside it."""
    if path.is_file() and path.suffix == ".json":
        beside = [path.with_suffix(".safetensors"), path.parent / "adapter_model.safetensors"]
        weights = next((p for p in beside if p.is_file()), None)
        if weights is None:
            raise AdapterError(f"{path}: no {beside[0].name} or adapter_model.safetensors beside it")
        return path, weights
    config, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config.is_file():
        raise AdapterError(f"{path}: no adapter_config.json; pass a PEFT adapter folder (save_pretrained output)")
    if not weights.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterError(
                f"{path}: only adapter_model.bin (a pickle) is there; Quiver does not unpickle. Save the adapter "
                "with safe_serialization=True to get adapter_model.safetensors"
            )
        raise AdapterError(f"{path}: no adapter_model.safetensors")
    return config, weights


def load_peft_adapter(source: str | Path, name: str | None = None) -> PeftAdapter:
    """Reads a PEFT LoRA adapter folder (or a QNN adapter-config JSON beside PEFT-layout safetensors).

    Refuses what Quiver cannot apply exactly, saying why.
    """
    source = Path(source)
    config_path, weights_path = _locate(source)
    config = read_lora_config(config_path)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    try:
        from safetensors import safe_open  # here: beside the import above, sorting would merge them

        opened: Any = safe_open(str(weights_path), framework="numpy")  # typed as a context manager from 0.5 on
        with opened as weights:  # the header first: nothing read yet
            keys = _checked_keys(weights, config, str(weights_path))
            for key, (module, which) in keys.items():
                pairs.setdefault(module, {})[which] = np.asarray(weights.get_tensor(key), dtype=np.float32)
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise AdapterError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    name = name or (source.stem if source.suffix == ".json" else source.name)
    return adapter_of(name, config, pairs, str(weights_path))


_FLOATS = {"F16", "BF16", "F32", "F64"}
MAX_ADAPTER_BYTES = 8 << 30  # rank 64 on every projection of a 70B model is ~1.7 GB in fp16


def _checked_keys(weights: Any, config: LoraConfig, source: str) -> dict[str, tuple[str, str]]:
    """{key: (module, "A" | "B")} from the file's header alone: every name a LoRA weight, float, each
    module's pair whole and of the config's rank, and the total within reason — before any data is read."""
    found: dict[str, tuple[str, str]] = {}
    shapes: dict[str, dict[str, list[int]]] = {}
    total = 0
    for key in weights.keys():
        if "lora_embedding" in key or "lora_magnitude_vector" in key:
            raise AdapterError(f"{source}: {key!r} is an embedding/DoRA adapter tensor; not supported")
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{source}: {key!r} is not a LoRA A/B weight; is this a LoRA adapter?")
        part = weights.get_slice(key)
        dtype, shape = str(part.get_dtype()), [int(d) for d in part.get_shape()]
        if dtype not in _FLOATS:
            raise AdapterError(f"{source}: {key!r} holds {dtype} values; LoRA weights are floating point")
        total += int(np.prod(shape, dtype=np.int64)) * (8 if dtype == "F64" else 4 if dtype == "F32" else 2)
        module, which = match.group("module").removeprefix(_PREFIX), match.group("which")
        found[key] = (module, which)
        shapes.setdefault(module, {})[which] = shape
    for module, pair in shapes.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{source}: module {module!r} has lora_{''.join(pair)} but not both A and B")
        rank = config.rank(module)
        if pair["A"][:1] != [rank] or pair["B"][1:2] != [rank]:
            raise AdapterError(
                f"{source}: module {module!r} has A {pair['A']} and B {pair['B']}; the config says rank {rank} "
                "(A is [r, in] and B [out, r], or for a conv [r, in, kh, kw] and [out, r, 1, 1])"
            )
    if total > MAX_ADAPTER_BYTES:
        raise AdapterError(f"{source}: {total / 2**30:.1f} GiB of LoRA weights is more than an adapter holds")
    return found


def config_path_of(source: str | Path) -> Path:
    """The adapter config of a PEFT folder, or a QNN adapter-config JSON itself."""
    source = Path(source)
    return source if source.is_file() and source.suffix == ".json" else source / "adapter_config.json"


def has_weights(source: str | Path) -> bool:
    """Whether the adapter's LoRA weights are in safetensors beside its config (else in an export)."""
    source = Path(source)
    if source.is_file() and source.suffix == ".json":
        return source.with_suffix(".safetensors").is_file() or (source.parent / "adapter_model.safetensors").is_file()
    return (source / "adapter_model.safetensors").is_file() or not (source / "adapter_config.json").is_file()


def read_lora_config(config_path: Path) -> LoraConfig:
    try:
        raw = json.loads(read_text(config_path, limit=16 << 20, what="PEFT config"))
    except (FileAccessError, ValueError, RecursionError) as exc:  # ValueError: JSON, or an integer too long
        raise AdapterError(f"{config_path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{config_path}: must hold a JSON object")
    return LoraConfig.from_json(raw, str(config_path))


def adapter_of(
    name: str, config: LoraConfig, pairs: dict[str, dict[str, np.ndarray]], weights_path: str
) -> PeftAdapter:
    """The adapter of these (module -> {"A", "B"}) weights in PEFT's layout, checked against its config."""
    modules = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{weights_path}: module {module!r} has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]
        rank = config.rank(module)
        linear = a.ndim == 2 and b.ndim == 2
        conv = a.ndim == 4 and b.ndim == 4 and b.shape[2:] == (1, 1)
        if not (linear or conv) or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"{weights_path}: module {module!r} has A {list(a.shape)} and B {list(b.shape)}; "
                f"the config says rank {rank} (A is [r, in] and B [out, r], or for a conv [r, in, kh, kw] and "
                "[out, r, 1, 1])"
            )
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterError(f"{weights_path}: module {module!r} has NaN or infinite weights; train or save it again")
        scaling = config.scaling(module)
        if not math.isfinite(scaling) or abs(scaling) > MAX_SCALING:
            raise AdapterError(
                f"{weights_path}: module {module!r} scales its update by {scaling:g} (lora_alpha / r); more than "
                f"{MAX_SCALING:g} overflows a model's activations: check lora_alpha and r"
            )
        modules[module] = LoraModule(module, a, b, scaling)
    if not modules:
        raise AdapterError(f"{weights_path}: holds no LoRA weights")
    stray = [m for m in modules if not config.targets(m)]
    if stray:
        raise AdapterError(
            f"{weights_path}: weights for {stray[:3]} but the config's target_modules/layers_to_transform do not "
            "select them; the config and the weights do not belong together"
        )
    return PeftAdapter(name, config, modules)

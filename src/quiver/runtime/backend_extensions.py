"""qnn-net-run's `--config_file`: the backend extensions JSON and the HTP backend config it names, read
into what Quiver honours (`enable_graphs`, `memory_limit_hint`, `is_persistent_binary`) and the list of
hardware settings that have no effect here (each warned about, never silently dropped)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiver.errors import BackendError
from quiver.formats.files import read_text

# The context settings Quiver honours; the context's other keys tune the NPU or the DSP's memory.
HONOURED = ("enable_graphs", "memory_limit_hint", "is_persistent_binary")
# Keys that hold here whatever they say (Quiver shares weights by content in every context).
ALWAYS_HERE = {"weight_sharing_enabled": "weights are always shared by content here"}
# Keys that only select what other keys apply to: nothing to warn about.
SELECTORS = {"graph_names", "graph_name", "shared_library_path", "config_file_path"}


@dataclass(frozen=True)
class BackendExtensions:
    """What the config says: the graphs that may run, in priority order (`enable_graphs`), the memory
    hint in MB under which the least recently used graphs are released (`memory_limit_hint`, as
    `Context.from_binary(memory_limit_hint_mb=)`), whether the file stays mapped (`is_persistent_binary`),
    and the hardware settings that do nothing here, as `where: why` lines."""

    source: Path
    enable_graphs: tuple[str, ...] | None = None
    memory_limit_mb: float | None = None
    persistent: bool = True
    without_effect: tuple[str, ...] = ()

    def check(self, graphs: list[str]) -> None:
        """Refuses graphs that `enable_graphs` leaves out, naming the setting."""
        if self.enable_graphs is not None:
            refused = [g for g in graphs if g not in self.enable_graphs]
            if refused:
                raise BackendError(
                    f"{self.source}: enable_graphs allows {list(self.enable_graphs)}, not {refused}; add them there"
                )


def read_backend_extensions(path: str | Path) -> BackendExtensions:
    """Both layouts qnn-net-run takes: the extensions file (`backend_extensions` with `config_file_path`,
    and `context_configs` / `graph_configs` beside it), and the backend config itself (`context`,
    `graphs`, `devices`). Context settings may be given in both places only with the same values."""
    source = Path(path)
    document = _json_object(source)
    without_effect: list[str] = []
    context: dict[str, Any] = {}
    where: dict[str, Path] = {}

    def take_context(block: object, owner: Path, name: str) -> None:
        if not isinstance(block, dict):
            raise BackendError(f"{owner}: '{name}' must be a JSON object")
        for key, value in block.items():
            if key in context and context[key] != value:
                raise BackendError(
                    f"{owner}: {name}.{key} is {value!r} but {where[key]} says {context[key]!r}; give one value"
                )
            context[key], where[key] = value, owner

    extensions = document.get("backend_extensions")
    if extensions is not None:
        if not isinstance(extensions, dict):
            raise BackendError(f"{source}: 'backend_extensions' must be a JSON object")
        if "context_configs" in document:
            take_context(document["context_configs"], source, "context_configs")
        without_effect += _hardware_keys(document, source, skip={"backend_extensions", "context_configs"})
        named = extensions.get("config_file_path")
        if named is not None:
            if not isinstance(named, str) or not named:
                raise BackendError(f"{source}: backend_extensions.config_file_path must name the backend config file")
            backend_config = source.parent / named
            document = _json_object(backend_config)
            if "context" in document:
                take_context(document["context"], backend_config, "context")
            without_effect += _hardware_keys(document, backend_config, skip={"context"})
    else:
        if "context" in document:
            take_context(document["context"], source, "context")
        without_effect += _hardware_keys(document, source, skip={"context"})
    for key in context:
        if key in ALWAYS_HERE:
            continue
        if key not in HONOURED:
            without_effect.append(f"{where[key]}: context {key} tunes Snapdragon hardware and has no effect here")
    return BackendExtensions(
        source,
        _graph_list(context.get("enable_graphs"), where.get("enable_graphs", source)),
        _memory_hint(context.get("memory_limit_hint"), where.get("memory_limit_hint", source)),
        _flag(context.get("is_persistent_binary", True), where.get("is_persistent_binary", source)),
        tuple(without_effect),
    )


def _hardware_keys(document: dict[str, Any], source: Path, skip: set[str]) -> list[str]:
    """`where: why` for every setting outside `skip` (the HTP's `graphs`, `devices`, net-run's
    `graph_configs`, ...): each tunes the NPU and changes nothing on this machine."""
    found: list[str] = []

    def walk(value: object, name: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if key not in SELECTORS:
                    walk(inner, f"{name}.{key}" if name else str(key))
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            for index, inner in enumerate(value):
                walk(inner, f"{name}[{index}]")
        else:
            found.append(f"{source}: {name} tunes Snapdragon hardware and has no effect here")

    try:
        walk({k: v for k, v in document.items() if k not in skip}, "")
    except RecursionError:
        raise BackendError(f"{source}: nested too deeply to be a backend config") from None
    return found


def _graph_list(value: object, source: Path) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(g, str) and g for g in value):
        raise BackendError(f"{source}: enable_graphs must be a list of graph names")
    return tuple(value)


def _memory_hint(value: object, source: Path) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise BackendError(f"{source}: memory_limit_hint must be a positive number of MB")
    return float(value)


def _flag(value: object, source: Path) -> bool:
    if not isinstance(value, bool):
        raise BackendError(f"{source}: is_persistent_binary must be true or false")
    return value


def _json_object(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(read_text(path, limit=1 << 20, what="the backend config"))
    except json.JSONDecodeError as exc:
        raise BackendError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise BackendError(f"{path}: nested too deeply to be a backend config") from None
    if not isinstance(document, dict):
        raise BackendError(f"{path}: a backend config is a JSON object")
    return document

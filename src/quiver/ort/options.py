"""SessionOptions, RunOptions and LoraAdapter with ONNX Runtime's Python names and behaviour."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from quiver.errors import AdapterError
from quiver.ort.errors import AdapterFileError, InvalidArgument, NoSuchFile
from quiver.ort_package import onnxruntime

if TYPE_CHECKING:
    from quiver.formats.section import SectionFile

GraphOptimizationLevel = onnxruntime.GraphOptimizationLevel  # ORT's own enums: values compare equal either way
ExecutionMode = onnxruntime.ExecutionMode


def _check_entry(key: object, value: object) -> None:
    if not isinstance(key, str) or not isinstance(value, str):
        raise InvalidArgument(f"config entries are strings; got {key!r}: {value!r}")


class _Remembered:
    """Config entries remembered as they are added: Quiver reads them all, ORT answers only per key."""

    _entries: dict[str, str]

    def _remember(self, key: str, value: str) -> None:
        _check_entry(key, value)
        self._entries[key] = value

    @property
    def entries(self) -> dict[str, str]:
        return dict(self._entries)


class SessionOptions(onnxruntime.SessionOptions, _Remembered):
    """`onnxruntime.SessionOptions` itself (every attribute and method), remembering what Quiver must apply
    to the model itself: config entries, free dimension overrides and initializers given by the caller."""

    def __init__(self) -> None:
        super().__init__()
        self._entries = {}
        self.free_dimensions_by_name: dict[str, int] = {}
        self.free_dimensions_by_denotation: dict[str, int] = {}
        self.initializers: dict[str, np.ndarray] = {}
        self._given: list[Any] = []  # the OrtValues ORT was handed: alive as long as these options
        self.files_in_memory: dict[str, bytes] = {}  # external-data files given as bytes, by name

    def add_session_config_entry(self, key: str, value: str) -> None:
        self._remember(key, value)
        super().add_session_config_entry(key, value)

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        super().add_free_dimension_override_by_name(dim_name, dim_value)
        self.free_dimensions_by_name[dim_name] = int(dim_value)

    def add_free_dimension_override_by_denotation(self, dim_denotation: str, dim_value: int) -> None:
        super().add_free_dimension_override_by_denotation(dim_denotation, dim_value)
        self.free_dimensions_by_denotation[dim_denotation] = int(dim_value)

    def add_initializer(self, name: str, ortvalue: Any) -> None:
        super().add_initializer(name, ortvalue)
        self._given.append(ortvalue)
        self.initializers[name] = _numpy_of(ortvalue)

    def add_external_initializers(self, names: Sequence[str], ortvalues: Sequence[Any]) -> None:
        super().add_external_initializers(names, ortvalues)
        self._given.extend(ortvalues)
        self.initializers.update({n: _numpy_of(v) for n, v in zip(names, ortvalues)})

    if hasattr(onnxruntime.SessionOptions, "add_external_initializers_from_files_in_memory"):  # ORT >= 1.22

        def add_external_initializers_from_files_in_memory(
            self, names: Sequence[str], buffers: Sequence[Any], lengths: Sequence[int]
        ) -> None:
            # copies, kept by these options: ORT reads them when a session is made, and a temporary the
            # caller passed would be gone by then
            copies = [bytes(memoryview(b).cast("B")[: int(n)]) for b, n in zip(buffers, lengths)]
            super().add_external_initializers_from_files_in_memory(names, copies, [len(c) for c in copies])
            self.files_in_memory.update(zip(names, copies))


def _numpy_of(value: Any) -> np.ndarray:
    """An initializer the caller gave as an OrtValue (ORT's Python or C one) or an array; copied, since the
    caller may reuse its buffer."""
    return np.array(value.numpy() if hasattr(value, "numpy") else value)


class LoraAdapter:
    """`onnxruntime.LoraAdapter`: a Quiver binary section (`.qsec`: applied to the context's updateable
    tensors for the run) or ONNX Runtime's adapter file (`.onnx_adapter`: its parameters are fed as the
    model's inputs for the run, as ORT feeds them). Loaded and checked once."""

    def __init__(self) -> None:
        self.section: SectionFile | None = None
        self.parameters: dict[str, np.ndarray] | None = None
        self.path: Path | None = None

    def Load(self, file_path: str | Path) -> None:  # noqa: N802  (ORT's name)
        from quiver.formats.layout import SECTION_MAGIC  # the file formats load with the first adapter
        from quiver.lora.onnx_adapter import read_onnx_adapter
        from quiver.runtime.sections import load_section

        path = Path(file_path)
        if not path.is_file():
            raise NoSuchFile(f"no adapter file at {path}")
        with open(path, "rb") as file:
            magic = file.read(len(SECTION_MAGIC))
        if magic == SECTION_MAGIC:
            self.section = load_section(path)
        else:
            try:
                self.parameters = read_onnx_adapter(path)
            except AdapterError as exc:
                raise AdapterFileError(str(exc)) from None
        self.path = path


class RunOptions(onnxruntime.RunOptions, _Remembered):
    """`onnxruntime.RunOptions` itself, plus run config entries Quiver reads (`qnn.lora_config`) and the
    active LoRA adapters (Quiver's `LoraAdapter`s)."""

    def __init__(self) -> None:
        super().__init__()
        self._entries = {}
        self.active_adapters: list[LoraAdapter] = []

    def add_run_config_entry(self, key: str, value: str) -> None:
        self._remember(key, value)
        super().add_run_config_entry(key, value)

    def add_active_adapter(self, adapter: LoraAdapter) -> None:  # type: ignore[override]
        if not isinstance(adapter, LoraAdapter) or (adapter.section is None and adapter.parameters is None):
            raise InvalidArgument("add_active_adapter takes a quiver.ort.LoraAdapter on which Load() was called")
        self.active_adapters.append(adapter)


SHRINK_ARENA_KEY = "memory.enable_memory_arena_shrinkage"  # run option: "cpu:0" (devices, ';' between)


def shrinks_cpu_arena(entries: Mapping[str, str]) -> bool:
    """Whether a run's config entries ask ORT to shrink the CPU arena after it (`cpu:0` among the devices)."""
    return any(device.strip().startswith("cpu:") for device in entries.get(SHRINK_ARENA_KEY, "").split(";"))


def config_entries(options: object) -> dict[str, str]:
    """Entries of our options, or of ORT's own SessionOptions/RunOptions (which only answer per key)."""
    if isinstance(options, (SessionOptions, RunOptions)):
        return options.entries
    keys = (
        "session.disable_cpu_ep_fallback",
        "ep.context_enable",
        "ep.context_file_path",
        "ep.context_embed_mode",
        "ep.share_ep_contexts",
        "qnn.lora_config",
        "quiver.lora_config",
        SHRINK_ARENA_KEY,
        "session.record_ep_graph_assignment_info",
        "session.model_external_initializers_file_folder_path",
        "session.optimized_model_external_initializers_file_name",
        "session.optimized_model_external_initializers_min_size_in_bytes",
    )
    found = {}
    for key in keys:
        for getter in ("get_session_config_entry", "get_run_config_entry"):
            try:
                found[key] = getattr(options, getter)(key)
                break
            except Exception:  # ORT raises when a key is not set, or the object lacks the getter
                continue
    return found

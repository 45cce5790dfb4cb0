"""SessionOptions, RunOptions and LoraAdapter with ONNX Runtime's Python names and behaviour."""

from __future__ import annotations

from pathlib import Path

import onnxruntime

from quiver.formats.section import SectionFile
from quiver.ort.errors import InvalidArgument, NoSuchFile
from quiver.runtime.sections import load_section

GraphOptimizationLevel = onnxruntime.GraphOptimizationLevel  # ORT's own enums: values compare equal either way
ExecutionMode = onnxruntime.ExecutionMode


class _ConfigEntries:
    """String key/value entries, as ORT keeps them."""

    def __init__(self) -> None:
        self._entries: dict[str, str] = {}

    def _add(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgument(f"config entries are strings; got {key!r}: {value!r}")
        self._entries[key] = value

    def _get(self, key: str) -> str:
        if key not in self._entries:
            raise InvalidArgument(f"config entry {key!r} is not set")
        return self._entries[key]

    @property
    def entries(self) -> dict[str, str]:
        return dict(self._entries)


class SessionOptions(_ConfigEntries):
    """`onnxruntime.SessionOptions`: the attributes typical code sets, and session config entries."""

    def __init__(self) -> None:
        super().__init__()
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.execution_mode = ExecutionMode.ORT_SEQUENTIAL
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.optimized_model_filepath = ""
        self.enable_cpu_mem_arena = True
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.use_deterministic_compute = False

    def add_session_config_entry(self, key: str, value: str) -> None:
        self._add(key, value)

    def get_session_config_entry(self, key: str) -> str:
        return self._get(key)


class LoraAdapter:
    """`onnxruntime.LoraAdapter`: here a Quiver binary section (`.qsec`), loaded and verified once."""

    def __init__(self) -> None:
        self.section: SectionFile | None = None
        self.path: Path | None = None

    def Load(self, file_path: str | Path) -> None:  # noqa: N802  (ORT's name)
        path = Path(file_path)
        if not path.is_file():
            raise NoSuchFile(f"no adapter file at {path}")
        self.section = load_section(path)
        self.path = path


class RunOptions(_ConfigEntries):
    """`onnxruntime.RunOptions`: run config entries (`qnn.lora_config`) and active LoRA adapters."""

    def __init__(self) -> None:
        super().__init__()
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
        self.active_adapters: list[LoraAdapter] = []

    def add_run_config_entry(self, key: str, value: str) -> None:
        self._add(key, value)

    def get_run_config_entry(self, key: str) -> str:
        return self._get(key)

    def add_active_adapter(self, adapter: LoraAdapter) -> None:
        if not isinstance(adapter, LoraAdapter) or adapter.section is None:
            raise InvalidArgument("add_active_adapter takes a quiver.ort.LoraAdapter on which Load() was called")
        self.active_adapters.append(adapter)


def config_entries(options: object) -> dict[str, str]:
    """Entries of our options, or of ORT's own SessionOptions/RunOptions (which only answer per key)."""
    if isinstance(options, _ConfigEntries):
        return options.entries
    keys = (
        "session.disable_cpu_ep_fallback",
        "ep.context_enable",
        "ep.context_file_path",
        "ep.context_embed_mode",
        "ep.share_ep_contexts",
        "qnn.lora_config",
        "quiver.lora_config",
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

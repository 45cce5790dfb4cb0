"""The QNN execution provider's options, mapped onto Quiver backends and CPU policies.

`QuiverExecutionProvider` takes the QNN EP's option names (DESIGN.md), so code written for
`QNNExecutionProvider` runs unchanged; that name and `CPUExecutionProvider` are accepted as aliases.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quiver.ort.errors import Fail, InvalidArgument

PROVIDER = "QuiverExecutionProvider"
ALIASES = {"QNNExecutionProvider": PROVIDER, "CPUExecutionProvider": PROVIDER}

# htp_performance_mode -> (threads: 0 = all cores, spinning): what each QNN power mode means on a CPU.
PERFORMANCE_MODES = {
    "burst": (0, True),
    "sustained_high_performance": (0, True),
    "high_performance": (0, True),
    "balanced": (0, False),
    "default": (0, False),
    "low_balanced": (max(1, (os.cpu_count() or 2) // 2), False),
    "high_power_saver": (max(1, (os.cpu_count() or 2) // 2), False),
    "power_saver": (1, False),
    "low_power_saver": (1, False),
    "extreme_power_saver": (1, False),
}
PRIORITIES = ("low", "normal", "normal_high", "high")
PROFILING_LEVELS = ("off", "basic", "detailed")
# Options that tune Hexagon hardware: accepted so that QNN EP code runs, with a warning that they do nothing.
SNAPDRAGON_ONLY = (
    "vtcm_mb",
    "rpc_control_latency",
    "soc_model",
    "htp_arch",
    "htp_graph_finalization_optimization_mode",
    "enable_htp_shared_memory_allocator",
)
OPTIONS = (
    "backend_type",
    "backend_path",
    "qnn_saver_path",
    "profiling_level",
    "profiling_file_path",
    "htp_performance_mode",
    "qnn_context_priority",
    "enable_htp_fp16_precision",
    "offload_graph_io_quantization",
    "device_id",
    *SNAPDRAGON_ONLY,
)


# QNN's backend types (ORT's QNN EP: ParseBackendTypeName) -> what the hardware ones are; they run on the
# best backend Quiver has, with one warning. `saver` records the session's calls instead (`quiver.ort.saver`).
QNN_HARDWARE = {
    "htp": "the Hexagon NPU (Snapdragon)",
    "gpu": "the Adreno GPU (Snapdragon)",
    "ir": "QNN's IR backend (a DLC writer)",
    "genie": "Qualcomm's Genie runtime",
}
QNN_BACKEND_TYPES = ("cpu", "saver", *QNN_HARDWARE)
SAVER_OUTPUT = "saver_output"  # QNN Saver's default output folder, in the working directory
_WARNED: set[str] = set()  # hardware backends already warned about: once per process (servers open many sessions)


@dataclass
class ProviderConfig:
    backend: str = "cpu"
    saver_path: str | None = None  # where `saver` records the session (the graph, each run's inputs and outputs)
    profiling_level: str = "off"
    profiling_file_path: str | None = None
    performance_mode: str = "default"
    priority: str = "normal"
    fp16_precision: bool = False
    offload_io_quantization: bool = True
    device_id: int = 0
    options: dict[str, str] = field(default_factory=dict)  # as given (strings), for get_provider_options()

    @property
    def threads(self) -> int:
        return PERFORMANCE_MODES[self.performance_mode][0]

    @property
    def spinning(self) -> bool:
        # A low-priority context yields its cores between runs (QNN: lower priority on a shared NPU).
        return PERFORMANCE_MODES[self.performance_mode][1] and self.priority != "low"


def backend_from_path(path: str) -> str:
    """QNN's backend libraries on any OS's spelling (libQnnHtp.so, QnnHtp.dll, a full path, QnnDsp for
    the older DSP) as their backend type, or a Quiver backend name as it is."""
    lowered = _file_name(path)
    if not lowered:
        return ""
    for marker, backend in (("htp", "htp"), ("dsp", "htp"), ("saver", "saver"), ("gpu", "gpu"), ("cpu", "cpu"),
                            ("qnnir", "ir"), ("genie", "genie")):  # fmt: skip
        if marker in lowered:
            return backend
    return path


def _is_library(path: str) -> bool:
    return _file_name(path).endswith((".so", ".dll", ".dylib"))


def _file_name(path: str) -> str:
    """A path's last part, lower-cased, whichever OS spelled it (QNN EP code gives Windows paths too)."""
    return os.path.basename(path.replace("\\", "/")).lower()


def _choice(key: str, value: str, valid: Sequence[str]) -> str:
    if value not in valid:
        raise InvalidArgument(f"provider option {key}={value!r} is not valid; use one of {list(valid)}")
    return value


def _flag(key: str, value: str) -> bool:
    return _choice(key, value, ("0", "1")) == "1"


def parse_provider_options(options: Mapping[str, Any]) -> ProviderConfig:
    """Validated provider options; unknown keys are an error that lists the valid ones."""
    given = {str(k): str(v) for k, v in options.items()}
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise InvalidArgument(f"unknown {PROVIDER} option(s) {unknown}; valid options are {sorted(OPTIONS)}")
    config = ProviderConfig(options=given)
    if given.get("backend_type") and given.get("backend_path"):
        raise Fail("Only one of 'backend_type' and 'backend_path' should be set.")  # ORT's QNN EP's words
    backend = given.get("backend_type") or (backend_from_path(given["backend_path"]) if "backend_path" in given else "")
    saver = given.get("qnn_saver_path")
    if backend == "saver" or saver:
        # QNN EP's qnn_saver_path names the QnnSaver library (its log then goes to ./saver_output, as QNN
        # Saver's does); any other path is the folder to record into
        config.saver_path = saver if saver and not _is_library(saver) else SAVER_OUTPUT
        backend = "cpu" if backend == "saver" else backend
    if backend in QNN_HARDWARE and backend not in _WARNED:
        _WARNED.add(backend)
        warnings.warn(
            f"{PROVIDER}: QNN backend {backend!r} is {QNN_HARDWARE[backend]}, which this machine does not have; "
            "running on Quiver's cpu backend",
            stacklevel=3,
        )
    if backend in QNN_HARDWARE:
        backend = "cpu"
    if backend:
        from quiver.backends import available_backends  # imported when a backend is named, not with quiver.ort

        available = available_backends()
        if backend not in available:
            raise InvalidArgument(
                f"backend {backend!r} is not available; QNN's backend types are {list(QNN_BACKEND_TYPES)}, "
                f"Quiver's backends here {available}"
            )
        config.backend = backend
    config.profiling_level = _choice("profiling_level", given.get("profiling_level", "off"), PROFILING_LEVELS)
    config.profiling_file_path = given.get("profiling_file_path")
    if config.profiling_level != "off" and not config.profiling_file_path:
        raise InvalidArgument("profiling_level needs profiling_file_path: the CSV file to write")
    config.performance_mode = _choice(
        "htp_performance_mode", given.get("htp_performance_mode", "default"), tuple(PERFORMANCE_MODES)
    )
    config.priority = _choice("qnn_context_priority", given.get("qnn_context_priority", "normal"), PRIORITIES)
    config.fp16_precision = _flag("enable_htp_fp16_precision", given.get("enable_htp_fp16_precision", "0"))
    config.offload_io_quantization = _flag(
        "offload_graph_io_quantization", given.get("offload_graph_io_quantization", "1")
    )
    if given.get("device_id", "0") != "0":
        raise InvalidArgument(f"device_id {given['device_id']!r}: this machine has one device, 0")
    for key in SNAPDRAGON_ONLY:
        if key in given:
            warnings.warn(f"{PROVIDER}: option {key} tunes Snapdragon hardware and has no effect here", stacklevel=3)
    return config


def select_provider(
    providers: Sequence[str | tuple[str, Mapping[str, Any]]] | None,
    provider_options: Sequence[Mapping[str, Any]] | None,
) -> tuple[ProviderConfig, list[str]]:
    """The Quiver provider's config and the provider list `get_providers()` reports."""
    entries: list[tuple[str, Mapping[str, Any]]] = []
    for index, item in enumerate(providers or [PROVIDER]):
        if isinstance(item, tuple):
            if provider_options is not None:
                raise InvalidArgument("give provider options either in 'providers' tuples or in 'provider_options'")
            name, options = item
        else:
            name = item
            options = provider_options[index] if provider_options and index < len(provider_options) else {}
        entries.append((str(name), dict(options)))
    if provider_options is not None and len(provider_options) != len(entries):
        raise InvalidArgument("'provider_options' needs one dict per entry of 'providers'")
    ours = [(name, options) for name, options in entries if ALIASES.get(name, name) == PROVIDER]
    for name, _ in entries:
        if ALIASES.get(name, name) != PROVIDER:
            warnings.warn(f"provider {name!r} is not available in quiver.ort; using {PROVIDER}", stacklevel=3)
    # QNN/Quiver options win over a bare CPUExecutionProvider entry (whose options are ORT's, not ours).
    specific = [options for name, options in ours if name != "CPUExecutionProvider"]
    config = parse_provider_options(specific[0] if specific else {})
    if not specific:  # no QNN power mode asked for: ORT's own CPU defaults (all cores, threads spin)
        config.performance_mode = "high_performance"
    # As ORT reports them: the providers asked for, CPU last (ORT always keeps it as the fallback). Asked
    # for CPU alone, Quiver runs the model on its cpu backend, which is ORT's CPU EP: it reports just that.
    cpu_only = all(name == "CPUExecutionProvider" for name, _ in entries)
    reported = ["CPUExecutionProvider"] if cpu_only else [PROVIDER, "CPUExecutionProvider"]
    return config, reported

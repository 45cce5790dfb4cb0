"""The cpu backend's session settings, the knobs tuning may turn, and the device they were measured on."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quiver.backends.base import Knob, KnobValue
from quiver.errors import BackendError
from quiver.ort_package import onnxruntime as ort

# Raised when the knobs below change (names, values or what they mean): cached tuning results made for
# another knob space are measured again.
KNOB_SPACE_VERSION = 1

# ORT's MatMulNBits kernel (Quiver's 4-bit weights; ORT >= 1.32 also fuses DequantizeLinear + MatMul of
# 8-bit weights into it) computes at an accuracy level: 0 multiplies in float32, 4 (ORT's default for its
# fusion) rounds activations to int8 per block: about 2x faster on a CPU, sentence-embedding cosine 0.9980
# instead of 0.9984 on a16w8 MiniLM.
DEFAULT_ACCURACY_LEVEL = 4

OPTIMIZATION_LEVELS = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """How one ORT session is made: the values every tunable knob stands for."""

    intra_op_num_threads: int = 0  # 0: ORT's choice (the physical cores)
    allow_spinning: bool = True  # False: idle threads yield the cores at once (power saving)
    dynamic_block_base: int = 0  # 0: ORT's static partitioning of parallel loops
    graph_optimization_level: str = "all"
    prepack: bool = True
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    # False: a run's worker threads stop spinning as it returns (ORT's `session.force_spinning_stop`), where
    # a process's sessions take turns: an idle session's threads spinning on after its run take the cores
    # the next session's run needs (a dialog's prefill after its decode steps: 165 instead of 137 ms)
    spin_between_runs: bool = True

    def __post_init__(self) -> None:
        if self.graph_optimization_level not in OPTIMIZATION_LEVELS:
            known = sorted(OPTIMIZATION_LEVELS)
            raise BackendError(f"graph_optimization_level {self.graph_optimization_level!r} is not one of {known}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise BackendError(f"accuracy_level {self.accuracy_level} is not one of ORT's MatMulNBits levels 0-4")
        if self.intra_op_num_threads < 0 or self.dynamic_block_base < 0:
            raise BackendError("intra_op_num_threads and dynamic_block_base must be >= 0")

    @property
    def ort_level(self) -> ort.GraphOptimizationLevel:
        return OPTIMIZATION_LEVELS[self.graph_optimization_level]

    def config(self, prepack: bool) -> dict[str, str]:
        """The session config entries for these settings (`prepack` False: a session that packs nothing)."""
        entries = {"session.qdq_matmulnbits_accuracy_level": str(self.accuracy_level)}
        if not self.allow_spinning:
            entries["session.intra_op.allow_spinning"] = "0"
        if not self.spin_between_runs:
            entries["session.force_spinning_stop"] = "1"
        if self.dynamic_block_base:
            entries["session.dynamic_block_base"] = str(self.dynamic_block_base)
        if not prepack:
            entries["session.disable_prepacking"] = "1"
        return entries

    def tuned(self, values: Mapping[str, KnobValue], keep: frozenset[str] = frozenset()) -> SessionSettings:
        """These settings with a tuned configuration's values, except the fields named in `keep` (chosen
        by the user); names this backend does not know (a newer knob space) and values out of range (a
        damaged entry: more threads than this machine has cores) are ignored, their defaults stand."""
        changes: dict[str, Any] = {}
        for name, value in values.items():
            if name not in keep and tuned_value_problem(name, value) is None:
                changes[name] = value
        return dataclasses.replace(self, **changes)


_KNOB_TYPES = {f.name: type(f.default) for f in dataclasses.fields(SessionSettings)}


def tuned_value_problem(name: str, value: object, cores: int | None = None) -> str | None:
    """Why a tuned value cannot be used on a machine of `cores` cores (default: this one's), or None."""
    cores = cores or os.cpu_count() or 1
    if name not in _KNOB_TYPES:
        return f"{name!r} is not a knob of the cpu backend (its knobs: {', '.join(sorted(_KNOB_TYPES))})"
    if type(value) is not _KNOB_TYPES[name]:
        return f"{name}={value!r} is not a{'n' if _KNOB_TYPES[name] is int else ''} {_KNOB_TYPES[name].__name__}"
    if name == "intra_op_num_threads":
        holds, expected = isinstance(value, int) and 0 <= value <= cores, f"0 (all cores) to {cores} (the cores)"
    elif name == "dynamic_block_base":
        holds, expected = isinstance(value, int) and 0 <= value <= 64, "0 to 64"
    elif name == "graph_optimization_level":
        holds, expected = value in OPTIMIZATION_LEVELS, f"one of {sorted(OPTIMIZATION_LEVELS)}"
    elif name == "accuracy_level":
        holds, expected = value in (0, 1, 2, 3, 4), "one of ORT's MatMulNBits levels 0-4"
    else:
        holds, expected = True, ""
    return None if holds else f"{name}={value!r} is out of range: it must be {expected}"


def knobs(integer_matmuls: bool, prepacks: bool) -> tuple[Knob, ...]:
    """What tuning may turn for a graph: each knob's first value is the default.

    Measured on real models (docs/BENCHMARKS.md, "Tuning"): these move latency on some model or input
    size. ORT's parallel executor, its memory arena and pattern planner, and flushing denormals were
    measured too and left out: none beat the noise on any model, and parallel execution was 1.5-2.3x
    slower.
    """
    cores = os.cpu_count() or 1
    threads: tuple[KnobValue, ...] = (0, *sorted({1, max(cores // 2, 1)} - {cores}))
    result = [
        Knob("intra_op_num_threads", threads if cores > 1 else (0,), "threads per run (0: the physical cores)"),
        Knob("allow_spinning", (True, False), "idle threads spin, waiting for the next run"),
        Knob("dynamic_block_base", (0, 2, 4), "parallel loops split into shrinking blocks (0: static split)"),
        Knob("graph_optimization_level", ("all", "extended", "basic"), "ORT's graph optimizations"),
    ]
    if prepacks:
        result.append(Knob("prepack", (True, False), "MatMul weights repacked for the CPU's kernels"))
    if integer_matmuls:
        result.append(
            Knob(
                "accuracy_level",
                (DEFAULT_ACCURACY_LEVEL, 0, 1, 2),
                "MatMulNBits compute type (0: float32, 4: int8 activations)",
                exact=0,
            )
        )
    return tuple(result)


def _cpu_model() -> tuple[str, str]:
    """The CPU's model name and its feature flags, from /proc/cpuinfo where there is one."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break  # the first processor's block describes them all
    model = fields.get("model name") or fields.get("Model") or fields.get("CPU part") or platform.machine()
    return model, fields.get("flags") or fields.get("Features") or ""


# The ISA features that change which kernels MLAS (ORT's math library) picks.
_ISA = (
    "sse4_1 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 avx_vnni "
    "amx_tile amx_int8 amx_bf16 asimd asimddp asimdhp i8mm bf16 sve sve2"
).split()


def _caches() -> str:
    """Cache sizes per level and type of CPU 0 (e.g. "L1d 48K, L2 2048K, L3 32768K")."""
    folder = Path("/sys/devices/system/cpu/cpu0/cache")
    found = []
    try:
        for index in sorted(folder.glob("index*")):
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
            found.append(f"L{level}{suffix} {size}")
    except OSError:
        pass
    return ", ".join(found)


@functools.cache
def _machine_fields() -> tuple[tuple[str, str], ...]:
    """The fields no process can change (runtime build, processor, caches): read once (0.4 ms)."""
    model, flags = _cpu_model()
    present = set(flags.split())
    build = ort.get_build_info() if hasattr(ort, "get_build_info") else ""
    return (
        ("backend", "cpu"),
        ("onnxruntime", ort.__version__),
        ("onnxruntime_build", build.replace("ORT Build Info: ", "")),
        ("cpu", model),
        ("isa", " ".join(f for f in _ISA if f in present)),
        ("caches", _caches()),
        ("machine", platform.machine()),
    )


def machine_fingerprint() -> dict[str, str]:
    """What a packed weight's layout depends on: the runtime build and the processor (not the cores)."""
    return dict(_machine_fields())


def device_fingerprint() -> dict[str, str]:
    """What the cpu backend's speed depends on, each field kept so a mismatch can say what changed. The
    usable cores are read each time: a process may be pinned to fewer after it started."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    fields = dict(_machine_fields())
    return {**fields, "cores": str(usable)}

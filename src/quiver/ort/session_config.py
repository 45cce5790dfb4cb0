"""Session options ORT acts on beyond running: a config embedded in the model, an optimized-model file,
and its JSON profile. Quiver honours each as ORT does rather than accept and ignore it."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from quiver.ir import proto
from quiver.ort.errors import InvalidArgument
from quiver.ort.options import SessionOptions
from quiver.ort_package import onnxruntime

LOAD_CONFIG_VARIABLE = "ORT_LOAD_CONFIG_FROM_MODEL"
# what ORT's parser of a model's "ort_config" reads (the rest it ignores)
_MODEL_CONFIG = (
    "intra_op_num_threads",
    "inter_op_num_threads",
    "graph_optimization_level",
    "execution_mode",
    "enable_profiling",
)
_COPIED = (*_MODEL_CONFIG, "log_severity_level", "log_verbosity_level", "logid", "optimized_model_filepath",
           "profile_file_prefix", "enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse",
           "use_deterministic_compute")  # fmt: skip


def copy_options(options: Any, without: tuple[str, ...] = ()) -> SessionOptions:
    """A new SessionOptions with what `options` sets (attributes, config entries and, for Quiver's own
    options, free dimension overrides and given initializers), less the attributes in `without`."""
    copy = SessionOptions()
    for name in _COPIED:
        if hasattr(options, name) and name not in without:
            setattr(copy, name, getattr(options, name))
    for key, value in getattr(options, "entries", {}).items():
        copy.add_session_config_entry(key, value)
    for name, size in getattr(options, "free_dimensions_by_name", {}).items():
        copy.add_free_dimension_override_by_name(name, size)
    for denotation, size in getattr(options, "free_dimensions_by_denotation", {}).items():
        copy.add_free_dimension_override_by_denotation(denotation, size)
    files = getattr(options, "files_in_memory", {})
    if files:
        sizes = [len(data) for data in files.values()]
        copy.add_external_initializers_from_files_in_memory(list(files), list(files.values()), sizes)
    given = getattr(options, "initializers", {})
    if given:
        values = [onnxruntime.OrtValue.ortvalue_from_numpy(a) for a in given.values()]
        copy.add_external_initializers(list(given), values)  # the copy keeps them (and their arrays) alive
    return copy


def with_model_config(options: Any, model: proto.ModelProto) -> Any:
    """With ORT_LOAD_CONFIG_FROM_MODEL=1, the options with the model's `ort_config` session options applied
    (to a copy: the caller's object is left as it was, as ORT leaves it)."""
    if os.environ.get(LOAD_CONFIG_VARIABLE) != "1":
        return options
    raw = next((p.value for p in model.metadata_props if p.key == "ort_config"), None)
    if raw is None:
        return options
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(
            f"the model's ort_config metadata is not JSON ({exc}); fix it or unset {LOAD_CONFIG_VARIABLE}"
        ) from None
    settings = config.get("session_options", {}) if isinstance(config, dict) else None
    if not isinstance(settings, dict):
        raise InvalidArgument("the model's ort_config must be an object whose session_options is an object")
    copy = copy_options(options)
    for key, value in settings.items():
        if key not in _MODEL_CONFIG:
            continue
        try:
            if key == "graph_optimization_level":
                value = onnxruntime.GraphOptimizationLevel(int(value))
            elif key == "execution_mode":
                value = onnxruntime.ExecutionMode(int(value))
            elif key == "enable_profiling":
                value = bool(value)
            else:
                value = int(value)
            setattr(copy, key, value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"the model's ort_config sets {key} to {value!r}: {exc}") from None
    return copy


def with_session_overrides(model: proto.ModelProto, options: Any, folder: Path | None) -> proto.ModelProto | None:
    """The model with what the options override applied, as ORT applies them when it loads one: external
    data read from files the caller gave as bytes, free dimensions fixed (by name or by denotation, on the
    graph's inputs), and initializers the caller gave (`add_initializer`, `add_external_initializers`) in
    place of the model's. None when nothing applies."""
    by_name = getattr(options, "free_dimensions_by_name", {})
    by_denotation = getattr(options, "free_dimensions_by_denotation", {})
    given = getattr(options, "initializers", {})
    files = getattr(options, "files_in_memory", {})
    if not (by_name or by_denotation or given or files):
        return None
    from onnx import external_data_helper, numpy_helper

    model = proto.ModelProto.FromString(model.SerializeToString())
    for tensor in model.graph.initializer:  # external data whose file the caller gave as bytes
        if tensor.data_location == proto.TensorProto.EXTERNAL:
            where = {entry.key: entry.value for entry in tensor.external_data}
            data = files.get(where.get("location", ""))
            if data is not None:
                offset = int(where.get("offset", 0))
                length = int(where.get("length", len(data) - offset))
                if offset + length > len(data):
                    raise InvalidArgument(f"initializer {tensor.name!r}: its bytes lie past the end of the file given")
                tensor.raw_data = data[offset : offset + length]
                tensor.data_location = proto.TensorProto.DEFAULT
                del tensor.external_data[:]
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            fixed = by_name.get(dim.dim_param) if dim.HasField("dim_param") else None
            fixed = by_denotation.get(dim.denotation, fixed) if dim.denotation else fixed
            if fixed is not None:
                dim.dim_value = fixed
    for index, tensor in enumerate(model.graph.initializer):
        if tensor.name in given:
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(given[tensor.name], tensor.name))
    if folder is not None:  # the copy is built from memory: its other external weights are read from their files
        external_data_helper.load_external_data_for_model(model, str(folder))
    return model


# the optimized model's own settings: which of its weights go to an external file
_OPTIMIZED_MODEL_ENTRIES = (
    "session.optimized_model_external_initializers_file_name",
    "session.optimized_model_external_initializers_min_size_in_bytes",
)


def write_optimized_model(options: Any, entries: dict[str, str], source: str | bytes) -> None:
    """`optimized_model_filepath`: ORT writes the model as its optimizers leave it; so does this, with ORT
    (with the entries that place its weights in an external file)."""
    target = getattr(options, "optimized_model_filepath", "")
    if not target:
        return
    writer = copy_options(options, without=("enable_profiling",))  # overrides and in-memory files too
    writer.optimized_model_filepath = str(target)
    writer.log_severity_level = 3
    for key in _OPTIMIZED_MODEL_ENTRIES:
        if key in entries and key not in writer.entries:  # options of ORT's own class: read per key
            writer.add_session_config_entry(key, entries[key])
    onnxruntime.InferenceSession(source, writer, providers=["CPUExecutionProvider"])


class JsonProfile:
    """`enable_profiling`: ORT's profile format (a Chrome trace: one event per session start and per run),
    written by `end_profiling()` to `<profile_file_prefix>_<date>.json` in the working folder."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.start_ns = 0
        self.events: list[dict[str, Any]] = []

    def session_ready(self, start_ns: int, end_ns: int) -> None:
        self.start_ns = start_ns
        self._event("session_initialization", start_ns, end_ns)

    def run(self, start_ns: int, end_ns: int) -> None:
        self._event("model_run", start_ns, end_ns)

    def _event(self, name: str, start_ns: int, end_ns: int) -> None:
        self.events.append(
            {"cat": "Session", "pid": os.getpid(), "tid": 0, "dur": (end_ns - start_ns) // 1000,
             "ts": (start_ns - self.start_ns) // 1000 if self.start_ns else 0, "ph": "X", "name": name, "args": {}}
        )  # fmt: skip

    def write(self) -> str:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        path = Path(f"{self.prefix}_{stamp}.json")
        lines = ",\n".join(json.dumps(event) for event in self.events)  # one event per line, as ORT writes
        from quiver.formats.writer import write_text_atomically  # with the first profile, not at import

        write_text_atomically(path, f"[\n{lines}\n]\n")
        self.events = []
        return str(path)


def profile_of(options: Any) -> JsonProfile | None:
    if not getattr(options, "enable_profiling", False):
        return None
    return JsonProfile(getattr(options, "profile_file_prefix", "onnxruntime_profile_") or "onnxruntime_profile_")

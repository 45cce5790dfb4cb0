"""`quiver.ort.InferenceSession`: ONNX Runtime's session API over one engine, chosen when it is made.

A plain `.onnx` is built into a context (in a temporary folder, or next to the model as
`<model>_ctx.onnx` + `.qctx` with `ep.context_enable=1`) and runs on Quiver's engine; an EPContext
model opens its context directly (with `ep.share_ep_contexts=1`, sessions of one process over the same
`.qctx` share one loaded context: its weights are mapped, and packed, once). A model Quiver cannot take
on runs on plain ONNX Runtime; `execution_path` says which, and why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from quiver import errors
from quiver.ir import dtypes, proto
from quiver.ort.binding import IOBinding, feeds_of, ortvalue_of
from quiver.ort.errors import EnforceError, Fail, InvalidArgument, InvalidProtobuf, NoSuchFile, ort_error
from quiver.ort.errors import NotImplemented as UnsupportedByBackend
from quiver.ort.metadata import EpAssignedNode, EpAssignedSubgraph, ExecutionPath, ModelMetadata, NodeArg
from quiver.ort.options import RunOptions, SessionOptions, config_entries
from quiver.ort.provider import PROVIDER, select_provider
from quiver.ort.session_config import profile_of, with_model_config, with_session_overrides, write_optimized_model
from quiver.ort_package import onnxruntime
from quiver.ort_process import global_thread_pools_in_use

if TYPE_CHECKING:  # the engines are imported when a session is first made: `import quiver.ort` stays light
    from quiver.ort.engine_ort import OrtEngine
    from quiver.ort.engine_quiver import QuiverEngine

    _Engine: TypeAlias = QuiverEngine | OrtEngine

__all__ = ["EpAssignedNode", "EpAssignedSubgraph", "ExecutionPath", "InferenceSession", "ModelMetadata", "NodeArg"]

_EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def _load_model(path_or_bytes: str | Path | bytes) -> tuple[proto.ModelProto, bytes, Path | None]:
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data, folder = bytes(path_or_bytes), None
    else:
        path = Path(path_or_bytes)
        if not path.is_file():
            raise NoSuchFile(f"Load model from {path} failed: file does not exist")
        data, folder = path.read_bytes(), path.parent
    try:
        model = proto.ModelProto.FromString(data)
    except Exception as exc:  # protobuf raises several types on malformed input
        raise InvalidProtobuf(f"the model is not a valid ONNX protobuf ({type(exc).__name__}: {exc})") from None
    if not model.graph.node and not model.graph.output:
        raise InvalidProtobuf("the model parsed as an empty ONNX model; is it really an .onnx file?")
    return model, data, folder


class InferenceSession(onnxruntime.InferenceSession):
    """`onnxruntime.InferenceSession` on Quiver: same constructor, `run`, I/O metadata and errors.

    A subclass of ORT's class, so that code (and libraries) checking `isinstance(s, onnxruntime.InferenceSession)`
    accept it; it overrides every public method and never calls ORT's constructor. What runs the model is
    one engine object, chosen here: `QuiverEngine` (a context) or, where Quiver cannot take the model on,
    `OrtEngine` (plain ONNX Runtime); both answer the same few calls.
    """

    def __init__(
        self,
        path_or_bytes: str | Path | bytes,
        sess_options: SessionOptions | Any | None = None,
        providers: Sequence[str | tuple[str, Mapping[str, Any]]] | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
        **_: Any,
    ) -> None:
        self._options = sess_options if sess_options is not None else SessionOptions()
        if global_thread_pools_in_use() and getattr(self._options, "use_per_session_threads", False):
            raise EnforceError("use_per_session_threads must be false when using a global thread pool")
        self._config, self._providers = select_provider(providers, provider_options)
        self._entries = config_entries(self._options)
        self._start_ns = time.time_ns()
        opening = time.perf_counter_ns()
        model, data, folder = _load_model(path_or_bytes)
        if folder is None and self._entries.get(_EXTERNAL_DATA_FOLDER):  # bytes: ORT's folder for their data
            folder = Path(self._entries[_EXTERNAL_DATA_FOLDER])
        self._options = with_model_config(self._options, model)
        self._json_profile = profile_of(self._options)
        self._saver: Any = None  # a `quiver.ort.saver.SaverLog`
        if self._config.saver_path is not None:  # QNN's saver backend: the model and every run recorded
            from quiver.ort.saver import SaverLog  # its writer loads when a session records, not with quiver.ort

            source = None if isinstance(path_or_bytes, (bytes, bytearray)) else str(path_or_bytes)
            self._saver = SaverLog(self._config.saver_path, data, source, self._config.options)
        try:
            self._engine: _Engine = self._open(model, data, path_or_bytes, folder)
        except errors.QuiverError as exc:
            raise ort_error(exc) from None
        if not self._engine.path.on_quiver:
            self._providers = ["CPUExecutionProvider"]
        self._model_meta = ModelMetadata(model)  # not the model: its weights live in the context
        self._assigned_nodes: tuple[EpAssignedNode, ...] | None = None
        if self._entries.get("session.record_ep_graph_assignment_info") == "1":
            self._assigned_nodes = tuple(EpAssignedNode(n.name, n.domain, n.op_type) for n in model.graph.node)
        self._fallback_enabled = True
        if self._json_profile is not None:
            self._json_profile.session_ready(opening, time.perf_counter_ns())

    def _open(self, model: proto.ModelProto, data: bytes, source: str | Path | bytes, folder: Path | None) -> _Engine:
        """Quiver's engine where it can take the model on, plain ORT's (ORT's CPU EP fallback) elsewhere."""
        from quiver.ort.engine_ort import OrtEngine
        from quiver.ort.engine_quiver import QuiverEngine, make_backend, twin_of
        from quiver.ort.epcontext import is_ep_context_model, read_ep_context

        twin = twin_of(source, self._options)
        common = {"twin": twin, "json_profile": self._json_profile}
        backend = make_backend(self._config, self._options, self)
        if is_ep_context_model(model):
            return QuiverEngine.open_ep_context(read_ep_context(model, folder), self._config, self._entries, backend,
                                                **common)  # fmt: skip
        from quiver.ir.ops import unsupported_operators  # building needs the onnx package; opening does not

        overridden = with_session_overrides(model, self._options, folder)
        if overridden is not None:  # built from memory, weights and all: the file no longer says what runs
            data = overridden.SerializeToString()
            model, source = overridden, data
        unsupported = unsupported_operators(model)
        reason = f"cannot run operators {', '.join(sorted(unsupported))}" if unsupported else None
        engine: _Engine | None = None
        if reason is None:
            try:
                engine = QuiverEngine.build(
                    model, data, source, folder, self._config, self._entries, backend, self, **common
                )
            except errors.ConversionError as exc:  # a model ORT runs but Quiver cannot convert (types, shapes)
                reason = f"cannot convert the model ({exc})"
        if engine is None:
            if self._entries.get("session.disable_cpu_ep_fallback") == "1":
                raise UnsupportedByBackend(f"{self._providers[0]} {reason} and session.disable_cpu_ep_fallback=1")
            # from its path when it has one: external data resolves against the model's folder, as ORT does
            engine = OrtEngine(str(source) if isinstance(source, (str, Path)) else source, self._options, str(reason))
        write_optimized_model(self._options, self._entries, str(source) if isinstance(source, Path) else source)
        return engine

    @property
    def execution_path(self) -> ExecutionPath:
        """Which engine runs this session's model, and why (`quiver check` says the same of a model)."""
        return self._engine.path

    @property
    def engine(self) -> _Engine:
        """The engine running the model: a `QuiverEngine` (its `context` is Quiver's own API over the same
        graph, its `backend` the settings it runs with) or an `OrtEngine` (plain ONNX Runtime)."""
        return self._engine

    @property
    def _sess(self) -> Any:
        """ORT's private C session (`onnxruntime.InferenceSession._sess`): the plain-ORT session of the engine
        (its twin, on Quiver's), for client code that reaches for it."""
        plain = self._engine.session if self._engine.plain_ort else self._engine.twin
        return plain.get()._sess

    # --- metadata -----------------------------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return self._engine.inputs()

    def get_outputs(self) -> list[NodeArg]:
        return self._engine.outputs()

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Initializers the model also lists as inputs (IR >= 4), which an adapter replaces for a run."""
        return self._engine.overridable_initializers()

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """Per reported provider, as ORT gives them: Quiver's options, and none for the CPU EP."""
        return {name: dict(self._config.options) if name == PROVIDER else {} for name in self._providers}

    def get_session_options(self) -> SessionOptions | Any:
        return self._options

    def get_modelmeta(self) -> ModelMetadata:
        return self._model_meta

    # --- running ------------------------------------------------------------------------------------

    def _input_dtype(self, name: str) -> np.dtype | None:
        """The numpy dtype of an input (Python lists fed to it are converted to it, as ORT does)."""
        for arg in self.get_inputs():
            if arg.name == name:
                inner = str(arg.type).removeprefix("tensor(").removesuffix(")")
                inner = {"float": "float32", "double": "float64"}.get(inner, inner)
                return dtypes.numpy_of(inner) if inner in dtypes.IO_DTYPE_NAMES else None
        return None

    def _execute(
        self,
        feeds: Mapping[str, np.ndarray],
        run_options: RunOptions | Any | None,
        out: Mapping[str, np.ndarray] | None,
    ) -> dict[str, np.ndarray]:
        """Every output by name; those in `out` are written into the caller's arrays (IOBinding's runs)."""
        results = self._engine.execute(feeds, run_options, out)
        if self._saver is not None:
            self._saver.record(feeds, results)
        return results

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: RunOptions | Any | None = None,
    ) -> list[np.ndarray]:
        if self._engine.plain_ort:  # ORT takes every feed it knows (sequences, maps) as it is
            results = self._engine.run(output_names, input_feed, run_options)
        else:
            input_feed = feeds_of(input_feed, self._input_dtype)
            results = self._engine.run(output_names, input_feed, run_options)
        if self._saver is not None:
            names = output_names or [o.name for o in self.get_outputs()]
            self._saver.record(input_feed, dict(zip(names, results)))
        return results

    # --- the rest of ORT's session surface ----------------------------------------------------------------

    def get_profiling_start_time_ns(self) -> int:
        return self._start_ns

    def _cpu_memory_infos(self, count: int) -> list[Any]:
        arena, default = onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, onnxruntime.OrtMemType.DEFAULT
        info = onnxruntime.OrtMemoryInfo("Cpu", arena, 0, default)
        return [info] * count

    def get_input_memory_infos(self) -> list[Any]:
        """Where each input is expected: CPU memory, for every input."""
        return self._cpu_memory_infos(len(self.get_inputs()))

    def get_output_memory_infos(self) -> list[Any]:
        return self._cpu_memory_infos(len(self.get_outputs()))

    def get_input_epdevices(self) -> list[Any]:
        """No plugin EP devices are used: one None per input, as ORT gives for CPU inputs."""
        return [None] * len(self.get_inputs())

    def get_tuning_results(self) -> list[Any]:
        """ORT's TunableOp results (GPU EPs); the CPU has none, as with ORT. Quiver tunes with `quiver tune`."""
        return []

    def set_tuning_results(self, results: Sequence[Any], error_on_invalid: bool = False) -> None:
        if results and error_on_invalid:
            raise InvalidArgument("these tuning results are for ORT's TunableOp (GPU EPs); tune with `quiver tune`")

    def disable_fallback(self) -> None:
        """ORT's run-time fallback to other EPs; Quiver decides at session creation (see the README)."""
        self._fallback_enabled = False

    def enable_fallback(self) -> None:
        self._fallback_enabled = True

    def release_captured_graph(self, *_: Any) -> None:
        """CUDA graph capture does not happen on the CPU: nothing to release."""

    def set_ep_dynamic_options(self, keys: Sequence[str], values: Sequence[str]) -> None:
        raise UnsupportedByBackend(
            f"{self._providers[0]} has no dynamic options (asked for {list(keys)}); set them when creating a session"
        )

    def get_provider_graph_assignment_info(self) -> list[Any]:
        """With `session.record_ep_graph_assignment_info=1`, as ORT reports it for a compiling EP: the whole
        graph is one subgraph of this session's provider (or ORT's own report when ORT runs the model)."""
        if self._engine.plain_ort:
            return self._engine.assignment_info()
        if self._assigned_nodes is None:
            raise Fail(
                "Session configuration entry 'session.record_ep_graph_assignment_info' must be set to \"1\" "
                "to get the graph's assignment to execution providers"
            )
        return [EpAssignedSubgraph(self._providers[0], self._assigned_nodes)]

    def set_providers(
        self,
        providers: Sequence[str | tuple[str, Mapping[str, Any]]] | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Accepts the providers the session already runs with; anything else needs a new session."""
        for item in providers or []:
            name = item[0] if isinstance(item, tuple) else item
            if name not in onnxruntime.get_all_providers() and name != PROVIDER:
                raise EnforceError(f"Unknown Provider Type: {name}")
        config, reported = select_provider(providers, provider_options)
        if config != self._config:
            raise UnsupportedByBackend("quiver.ort cannot change a session's provider options; create a new session")
        self._providers = reported if self._engine.path.on_quiver else self._providers

    # --- OrtValues, IOBinding, asynchronous runs ----------------------------------------------------------

    def create_ortvalue_from_shape_and_type(
        self, shape: Sequence[int], element_type: Any, device_type: str, device_id: int = 0, vendor_id: int = -1
    ) -> onnxruntime.OrtValue:
        """A CPU OrtValue of that shape and type (ONNX element type numbers are accepted too)."""
        if str(device_type).lower() != "cpu":
            raise InvalidArgument(f"quiver.ort allocates on the CPU, not {device_type!r}")
        if isinstance(element_type, int):
            element_type = dtypes.numpy_of(dtypes.io_name_of_onnx(element_type))
        return onnxruntime.OrtValue.ortvalue_from_shape_and_type(list(shape), element_type, "cpu", 0)

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: RunOptions | Any | None = None) -> None:
        if not isinstance(iobinding, IOBinding):
            raise InvalidArgument("run_with_iobinding takes the binding this session's io_binding() returned")
        iobinding.run(run_options)

    def run_with_ort_values(
        self,
        output_names: Sequence[str] | None,
        input_dict_ort_values: Mapping[str, Any],
        run_options: RunOptions | Any | None = None,
    ) -> list[onnxruntime.OrtValue]:
        """As `run`, with OrtValues in (viewed, not copied) and out."""
        if self._engine.plain_ort:
            return self._engine.run_with_ort_values(output_names, input_dict_ort_values, run_options)
        return [ortvalue_of(a) for a in self.run(output_names, input_dict_ort_values, run_options)]

    def run_with_ortvaluevector(
        self,
        run_options: RunOptions | Any | None,
        feed_names: Sequence[str],
        feeds: Sequence[Any],
        fetch_names: Sequence[str],
        fetches: list[Any],
        fetch_devices: Sequence[Any] | None = None,
    ) -> None:
        """ORT's low-level form: the outputs are appended to `fetches`."""
        fetches.extend(self.run_with_ort_values(fetch_names, dict(zip(feed_names, feeds)), run_options))

    def run_async(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        callback: Any,
        user_data: Any,
        run_options: RunOptions | Any | None = None,
    ) -> None:
        """Runs on a thread of its own and calls `callback(outputs, user_data, error_message)`."""

        def work() -> None:
            try:
                outputs = self.run(output_names, input_feed, run_options)  # numpy arrays, as ORT hands them
            except Exception as exc:  # handed to the callback, as ORT does
                callback([], user_data, str(exc))
                return
            callback(outputs, user_data, "")

        threading.Thread(target=work, name="quiver-ort-run-async", daemon=True).start()

    def end_profiling(self) -> str:
        """Writes the profiles and returns the path of ORT's JSON one (`enable_profiling`), else of the QNN
        EP's CSV (`profiling_level`, `profiling_file_path`); '' when profiling is off."""
        csv_path = self._engine.end_profiling() if not self._engine.plain_ort else ""
        if self._engine.plain_ort and self._json_profile is not None:
            return self._engine.end_profiling()  # ORT ran the model: its own profile, nodes and all
        return self._json_profile.write() if self._json_profile is not None else csv_path

    def close(self) -> None:
        profile = getattr(self, "_json_profile", None)
        if profile is not None and profile.events:
            profile.write()  # ORT writes its profile when a profiling session ends, too
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules may be gone
            pass

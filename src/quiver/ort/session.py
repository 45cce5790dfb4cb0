"""`quiver.ort.InferenceSession`: ONNX Runtime's session API over a Quiver context.

A plain `.onnx` is built into a context (in a temporary folder, or next to the model as
`<model>_ctx.onnx` + `.qctx` with `ep.context_enable=1`); an EPContext model opens its context
directly. With `ep.share_ep_contexts=1`, sessions of one process over the same `.qctx` share one loaded
context: its weights are mapped, and packed, once.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime

from quiver import errors, fork
from quiver.backends import CpuBackend, get_backend
from quiver.backends.base import Backend
from quiver.backends.cpu import fork_waits, global_thread_pools_in_use
from quiver.formats.section import SectionFile
from quiver.formats.writer import write_text_atomically
from quiver.ir import dtypes
from quiver.ir.edit import quantized_io
from quiver.ir.proto import ModelProto, TensorProto
from quiver.ir.tensors import TensorInfo
from quiver.ort.binding import IOBinding, feeds_of, ortvalue_of
from quiver.ort.compiler import build_ep_context
from quiver.ort.epcontext import (
    EpContext,
    is_ep_context_model,
    read_ep_context,
    save_ep_context_model,
)
from quiver.ort.errors import (
    EnforceError,
    EngineError,
    Fail,
    InvalidArgument,
    InvalidProtobuf,
    MissingInputsError,
    NoSuchFile,
    ort_error,
)
from quiver.ort.errors import NotImplemented as UnsupportedByBackend
from quiver.ort.options import RunOptions, SessionOptions, config_entries
from quiver.ort.provider import PROVIDER, ProviderConfig, select_provider
from quiver.ort.session_config import (
    copy_options,
    profile_of,
    with_model_config,
    with_session_overrides,
    write_optimized_model,
)
from quiver.runtime.context import Context
from quiver.runtime.sections import fits_weight, load_section, write_section
from quiver.runtime.state import GraphState

LORA_CONFIG_KEYS = ("qnn.lora_config", "quiver.lora_config")
_EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


class _AdapterNeedsOrt(Exception):
    """An `.onnx_adapter` whose parameters cannot replace the context's tensors (other shapes): the run
    goes to plain ORT, which feeds them, as ORT runs such adapters."""


@dataclass(frozen=True)
class ExecutionPath:
    """Which engine runs a session's model: Quiver's own (`"quiver"`: a context, weights shared and mapped,
    adapters applied) or plain ONNX Runtime (`"onnxruntime"`: the model could not be split from its
    weights), and why."""

    engine: str
    reason: str | None = None

    @property
    def on_quiver(self) -> bool:
        return self.engine == "quiver"


@dataclass(frozen=True)
class EpAssignedNode:
    """`onnxruntime.OrtEpAssignedNode`: a node of the model as given."""

    name: str
    domain: str
    op_type: str


@dataclass(frozen=True)
class EpAssignedSubgraph:
    """`onnxruntime.OrtEpAssignedSubgraph`: nodes one execution provider runs."""

    ep_name: str
    nodes: tuple[EpAssignedNode, ...]

    def get_nodes(self) -> list[EpAssignedNode]:
        return list(self.nodes)


@dataclass(frozen=True)
class NodeArg:
    """`onnxruntime.NodeArg`: name, shape (ints, symbolic names or None) and type (`tensor(float)`)."""

    name: str
    shape: list[int | str | None]
    type: str


def _node_arg(info: TensorInfo) -> NodeArg:
    elem = dtypes.onnx_of(info.dtype)
    type_name = TensorProto.DataType.Name(elem).lower()
    return NodeArg(info.name, list(info.shape) if info.shape is not None else [], f"tensor({type_name})")


def _backend(config: ProviderConfig, options: SessionOptions | Any, profile_folder: Path | None) -> Backend:
    if config.backend != "cpu":
        return get_backend(config.backend)
    threads = getattr(options, "intra_op_num_threads", 0) or config.threads
    level = getattr(options, "graph_optimization_level", onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL)
    spinning = config_entries(options).get("session.intra_op.allow_spinning")  # the caller's ORT setting wins
    return CpuBackend(
        intra_op_num_threads=threads,
        graph_optimization_level=level,
        allow_spinning=config.spinning if spinning is None else spinning != "0",
        profile_prefix=str(profile_folder / "ort_profile") if profile_folder else None,
    )


_Key = tuple[str, str, tuple[int, ...]]


class _SharedContexts:
    """One loaded context per (.qctx file, backend) for sessions that ask to share (`ep.share_ep_contexts=1`).

    Each session gets its own handle (`Context.view()`): weights and packed weights are shared, applied
    adapters are not. A file replaced since it was loaded is another file: it is loaded anew.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contexts: dict[_Key, tuple[Context, int]] = {}

    def acquire(self, path: Path, config: ProviderConfig, backend: Backend) -> tuple[Context, _Key]:
        try:
            info = path.stat()
        except OSError as exc:
            raise NoSuchFile(f"cannot open the EP context {path}: {exc.strerror or exc}") from None
        key = (str(path.resolve()), config.backend, (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
        with self._lock:
            context, users = self._contexts.get(key, (None, 0))
            if context is None:
                context = Context.from_binary(path, backend=backend)
            self._contexts[key] = (context, users + 1)
            return context.view(), key

    def release(self, key: _Key) -> None:
        """One session is done with the context; the last one lets it go."""
        with self._lock:
            context, users = self._contexts[key]
            if users > 1:
                self._contexts[key] = (context, users - 1)
                return
            del self._contexts[key]
        context.close()  # views still open keep the weights until they close

    def holds(self, key: _Key) -> bool:
        with self._lock:
            return key in self._contexts


SHARED_CONTEXTS = _SharedContexts()


def _load_model(path_or_bytes: str | Path | bytes) -> tuple[ModelProto, Path | None]:
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data, folder = bytes(path_or_bytes), None
    else:
        path = Path(path_or_bytes)
        if not path.is_file():
            raise NoSuchFile(f"Load model from {path} failed: file does not exist")
        data, folder = path.read_bytes(), path.parent
    try:
        model = ModelProto.FromString(data)
    except Exception as exc:  # protobuf raises several types on malformed input
        raise InvalidProtobuf(f"the model is not a valid ONNX protobuf ({type(exc).__name__}: {exc})") from None
    if not model.graph.node and not model.graph.output:
        raise InvalidProtobuf("the model parsed as an empty ONNX model; is it really an .onnx file?")
    return model, folder


class InferenceSession(onnxruntime.InferenceSession):
    """`onnxruntime.InferenceSession` on Quiver: same constructor, `run`, I/O metadata and errors.

    A subclass of ORT's class, so that code (and libraries) checking `isinstance(s, onnxruntime.InferenceSession)`
    accept it; it overrides every public method and never calls ORT's constructor (no ORT session is made
    unless the model needs plain ORT: see `_fall_back` and `_ort_twin`).
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
        self._shared: _Key | None = None
        self._broken: str | None = None
        # per-run adapters: the state each set of sections gives (by section identity), built once
        self._states: dict[tuple[int, ...], tuple[list[SectionFile], GraphState]] = {}
        self._states_lock = threading.Lock()
        self._sections: dict[Path, SectionFile] = {}
        self._adapter_sections: dict[int, tuple[Any, SectionFile]] = {}
        self._profile: list[tuple[str, int, float]] = []
        self._fallback_session: onnxruntime.InferenceSession | None = None  # see _fallback
        self._fallback_source: str | bytes = b""
        self._fallback_stale = False  # in a forked child: the parent's session, to be made again
        self._fallback_reason: str | None = None  # why plain ORT runs the model, when it does
        self._twin: onnxruntime.InferenceSession | None = None  # see _ort_twin
        self._twin_lock = threading.Lock()
        self._source = path_or_bytes
        fork.reset_after_fork(self)
        self._required: tuple[str, ...] | None = None  # see _required_inputs
        self._context: Context | None = None
        self._start_ns = time.time_ns()
        opening = time.perf_counter_ns()
        model, folder = _load_model(path_or_bytes)
        if folder is None and self._entries.get(_EXTERNAL_DATA_FOLDER):  # bytes: ORT's folder for their data
            folder = Path(self._entries[_EXTERNAL_DATA_FOLDER])
        self._options = with_model_config(self._options, model)
        self._json_profile = profile_of(self._options)
        try:
            if is_ep_context_model(model):
                self._open_ep_context(read_ep_context(model, folder))
            else:
                overridden = with_session_overrides(model, self._options, folder)
                if overridden is None:
                    self._build(model, path_or_bytes, folder)
                else:  # built from memory, weights and all: the file no longer says what runs
                    self._build(overridden, overridden.SerializeToString(), folder)
                source = str(path_or_bytes) if isinstance(path_or_bytes, Path) else path_or_bytes
                write_optimized_model(self._options, self._entries, source)
        except errors.QuiverError as exc:
            raise ort_error(exc) from None
        self._model_meta = ModelMetadata(model)  # not the model: its weights live in the context
        self._assigned_nodes: tuple[EpAssignedNode, ...] | None = None
        if self._entries.get("session.record_ep_graph_assignment_info") == "1":
            self._assigned_nodes = tuple(EpAssignedNode(n.name, n.domain, n.op_type) for n in model.graph.node)
        self._fallback_enabled = True
        if self._json_profile is not None:
            self._json_profile.session_ready(opening, time.perf_counter_ns())

    # --- opening ------------------------------------------------------------------------------------

    def _make_backend(self) -> Backend:
        folder = None
        if self._config.profiling_level == "detailed":
            folder = _scratch_folder(self, "quiver-profile-")
        self._backend = _backend(self._config, self._options, folder)
        return self._backend

    def _open_ep_context(self, ep: EpContext) -> None:
        backend = self._make_backend()
        if isinstance(ep.cache, Path) and self._entries.get("ep.share_ep_contexts") == "1":
            self._context, self._shared = SHARED_CONTEXTS.acquire(ep.cache, self._config, backend)
        else:
            self._context = Context.from_binary(ep.cache, backend=backend)
        if ep.graph not in self._context.graph_names:
            raise InvalidArgument(f"the context has no graph {ep.graph!r}; its graphs are {self._context.graph_names}")
        self._graph_name = ep.graph

    def _build(self, model: ModelProto, source: str | Path | bytes, folder: Path | None) -> None:
        """A context of the model; `folder` holds its external data (the model file's own folder, or for
        bytes the one `session.model_external_initializers_file_folder_path` names)."""
        from quiver.ir.ops import unsupported_operators  # building needs the onnx package; opening does not

        unsupported = unsupported_operators(model)
        if unsupported:
            self._fall_back(model, source, f"cannot run operators {', '.join(sorted(unsupported))}")
            return
        source_path = Path(source) if isinstance(source, (str, Path)) else None
        self._graph_name = model.graph.name or (source_path.stem if source_path else "main")
        if not self._config.offload_io_quantization:
            model, source_path = quantized_io(model), None  # the caller passes and gets quantized I/O
        backend = self._make_backend()
        try:
            if self._entries.get("ep.context_enable") == "1":
                self._context = self._build_ep_context(model, source_path, folder, backend)
                return
            builder = Context.create(backend, workdir=_scratch_folder(self, "quiver-ort-"))
            builder.add_graph(
                self._graph_name, source_path or model, updateable=_overridable(model), external_data_folder=folder
            )
            self._context = builder.finalize()
        except errors.ConversionError as exc:  # a model ORT runs but Quiver cannot convert (types, shapes)
            self._fall_back(model, source, f"cannot convert the model ({exc})")

    @property
    def execution_path(self) -> ExecutionPath:
        """Which engine runs this session's model, and why (`quiver check` says the same of a model)."""
        if self._fallback_reason is not None:
            return ExecutionPath("onnxruntime", self._fallback_reason)
        return ExecutionPath("quiver")

    def _fall_back(self, model: ModelProto, source: str | Path | bytes, reason: str) -> None:
        """ORT's CPU EP fallback: the whole model on plain ONNX Runtime, from its path when it has one
        (external data then resolves against the model's folder, as ORT does, not the working one)."""
        if self._entries.get("session.disable_cpu_ep_fallback") == "1":
            raise UnsupportedByBackend(f"{self._providers[0]} {reason} and session.disable_cpu_ep_fallback=1")
        self._fallback_source = str(source) if isinstance(source, (str, Path)) else source  # bytes: the model's
        self._fallback_session = self._plain_ort_session(self._fallback_source, self._options)
        self._fallback_reason = reason
        self._providers = ["CPUExecutionProvider"]

    @property
    def _fallback(self) -> onnxruntime.InferenceSession | None:
        """The plain ORT session that runs the whole model, when Quiver cannot (None when Quiver runs it).
        A forked child makes its own on first use: the parent's relies on threads the child lacks."""
        if self._fallback_stale:
            with self._twin_lock:
                if self._fallback_stale:
                    self._fallback_session = self._plain_ort_session(self._fallback_source, self._options)
                    self._fallback_stale = False
        return self._fallback_session

    def _after_fork_in_child(self) -> None:
        """New locks; the parent's plain-ORT sessions are kept, never destroyed here (their threads are not),
        and made again on first use."""
        self._states_lock = threading.Lock()
        self._twin_lock = threading.Lock()
        for parents in (self._twin, self._fallback_session):
            if parents is not None:
                fork.keep_forever(parents)
        self._twin = None
        self._fallback_stale = self._fallback_session is not None

    @staticmethod
    def _plain_ort_session(source: str | Path | bytes, options: Any) -> onnxruntime.InferenceSession:
        """ORT's own session over the model, with the caller's options (ORT applies their overrides)."""
        options = options if isinstance(options, onnxruntime.SessionOptions) else None
        with fork_waits():
            return onnxruntime.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])

    def _ort_twin(self) -> onnxruntime.InferenceSession:
        """Plain ORT over the same model, for what runs through ORT although the model runs on Quiver: the
        private `_sess` some client code reaches for, and runs with adapters Quiver cannot apply. Made on
        first use (it holds a second copy of the weights), once per session."""
        if self._fallback is not None:
            return self._fallback
        with self._twin_lock:
            if self._twin is None:
                source = str(self._source) if isinstance(self._source, Path) else self._source
                options = self._options
                if isinstance(options, SessionOptions):  # the twin neither profiles nor writes the model again
                    options = copy_options(options, without=("enable_profiling", "optimized_model_filepath"))
                self._twin = self._plain_ort_session(source, options)
            return self._twin

    @property
    def _sess(self) -> Any:
        """ORT's private C session (`onnxruntime.InferenceSession._sess`), of the plain-ORT twin."""
        return self._ort_twin()._sess

    def _build_ep_context(
        self, model: ModelProto, source: Path | None, folder: Path | None, backend: Backend
    ) -> Context:
        """ep.context_enable=1: `<model>_ctx.onnx` (or ep.context_file_path) and the `.qctx` beside it."""
        default = source.with_name(source.stem + "_ctx.onnx") if source else None
        target = Path(self._entries.get("ep.context_file_path", "") or default or "")
        if not target.name:
            raise InvalidArgument("a model given as bytes needs ep.context_file_path to write its EPContext model")
        embed = self._entries.get("ep.context_embed_mode", "0")
        if embed not in ("0", "1"):
            raise InvalidArgument(f"ep.context_embed_mode must be 0 or 1, not {embed!r}")
        wrapper, cache = build_ep_context(model, source, self._graph_name, target, embed == "1", backend, folder)
        save_ep_context_model(wrapper, target)
        return Context.from_binary(cache, backend=backend)

    # --- metadata -----------------------------------------------------------------------------------

    def _graph(self) -> Any:
        assert self._context is not None
        return self._context.graph(self._graph_name)

    def get_inputs(self) -> list[NodeArg]:
        if self._fallback is not None:
            return [NodeArg(a.name, a.shape, a.type) for a in self._fallback.get_inputs()]
        return [_node_arg(i) for i in self._graph().inputs]

    def get_outputs(self) -> list[NodeArg]:
        if self._fallback is not None:
            return [NodeArg(a.name, a.shape, a.type) for a in self._fallback.get_outputs()]
        return [_node_arg(o) for o in self._graph().outputs]

    def _required_inputs(self) -> tuple[str, ...]:
        """The inputs a run must feed: all but those the graph supplies (LoRA strengths). Found once."""
        if self._required is None:
            graph = self._graph()
            self._required = tuple(i.name for i in graph.inputs if i.name not in graph.inputs_with_defaults)
        return self._required

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Initializers the model also lists as inputs (IR >= 4): here the graph's updateable tensors,
        which an adapter (`RunOptions.add_active_adapter`) replaces for a run."""
        if self._fallback is not None:
            return [NodeArg(a.name, a.shape, a.type) for a in self._fallback.get_overridable_initializers()]
        return [_node_arg(t) for t in self._graph().static_tensors if t.name in self._updateable()]

    def _updateable(self) -> frozenset[str]:
        assert self._context is not None
        return frozenset(self._context.file.graphs[self._graph_name].updateable)

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
        """Every output by name; those in `out` are written into the caller's arrays."""
        if self._fallback is None:
            try:
                return self._execute_on_quiver(self._with_adapter_parameters(feeds, run_options), run_options, out)
            except _AdapterNeedsOrt:
                pass
        ort = self._ort_twin()
        names = [o.name for o in ort.get_outputs()]
        on_ort = self._with_adapter_parameters(feeds, run_options, on_ort=True)
        values = dict(zip(names, ort.run(None, dict(on_ort), run_options)))
        for name, target in (out or {}).items():
            if name in values:
                np.copyto(target, values[name].reshape(target.shape))
                values[name] = target
        return values

    def _execute_on_quiver(
        self,
        feeds: Mapping[str, np.ndarray],
        run_options: RunOptions | Any | None,
        out: Mapping[str, np.ndarray] | None,
    ) -> dict[str, np.ndarray]:
        if self._broken is not None:
            raise EngineError(f"this session's backend failed earlier ({self._broken}); create a new session")
        assert self._context is not None
        try:
            state = self._run_state(run_options)
            start = time.perf_counter_ns()
            graph = self._graph()
            if state is None:
                results = graph.execute(dict(feeds), out=out or None)
            else:
                results = graph.execute_with(dict(feeds), state, out=out or None)
            self._record(start, time.perf_counter_ns())
        except errors.BackendError as exc:
            self._broken = str(exc)
            raise EngineError(f"{exc}; the session cannot run any more: create a new session") from None
        except errors.QuiverError as exc:
            raise ort_error(exc) from None
        return results

    def _with_adapter_parameters(
        self, feeds: Mapping[str, Any], run_options: RunOptions | Any | None, on_ort: bool = False
    ) -> Mapping[str, Any]:
        """The active `.onnx_adapter` adapters' parameters fed as the model's inputs, as ORT feeds them; on
        Quiver, those replacing overridable initializers are applied as sections instead (`_section_of`)."""
        adapters = [a for a in getattr(run_options, "active_adapters", []) if a.parameters is not None]
        if not adapters:
            return feeds
        inputs = {arg.name for arg in self.get_inputs()}
        overridable = {arg.name for arg in self.get_overridable_initializers()}
        merged = dict(feeds)
        for adapter in adapters:
            unknown = sorted(set(adapter.parameters) - inputs - overridable)
            if unknown:
                raise InvalidArgument(
                    f"adapter {adapter.path}: parameters {unknown} are neither inputs nor overridable initializers"
                )
            merged.update({n: v for n, v in adapter.parameters.items() if on_ort or n in inputs})
        return merged

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: RunOptions | Any | None = None,
    ) -> list[np.ndarray]:
        if self._fallback is not None:  # ORT takes every feed it knows (sequences, maps, strings) as it is
            feeds = self._with_adapter_parameters(input_feed, run_options, on_ort=True)
            return self._fallback.run(output_names, dict(feeds), run_options)
        missing = [name for name in self._required_inputs() if name not in input_feed]
        if missing:  # ORT checks this in Python, before running; an adapter may feed some
            adapters = [a.parameters for a in getattr(run_options, "active_adapters", []) if a.parameters]
            missing = [name for name in missing if not any(name in p for p in adapters)]
            if missing:
                raise MissingInputsError(
                    f"Required inputs ({missing}) are missing from input feed ({list(input_feed)})."
                )
        results = self._execute(feeds_of(input_feed, self._input_dtype), run_options, None)
        names = list(output_names) if output_names else list(results)
        unknown = [n for n in names if n not in results]
        if unknown:
            raise InvalidArgument(f"invalid output name(s) {unknown}; the outputs are {list(results)}")
        return [results[n] for n in names]

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
        if self._fallback is not None:
            return list(self._fallback.get_provider_graph_assignment_info())
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
        self._providers = reported if self._fallback is None else self._providers

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
        if self._fallback is not None:  # ORT's own: its outputs may be sparse tensors, sequences or maps
            feeds = self._with_adapter_parameters(input_dict_ort_values, run_options, on_ort=True)
            values = {n: v if isinstance(v, onnxruntime.OrtValue) else ortvalue_of(v) for n, v in feeds.items()}
            return self._fallback.run_with_ort_values(output_names, values, run_options)
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

    def _lora_sections(self, run_options: RunOptions | Any) -> list[SectionFile]:
        entries = config_entries(run_options)
        adapters = getattr(run_options, "active_adapters", [])
        sections: list[SectionFile] = []
        for adapter in adapters:
            section = adapter.section if adapter.section is not None else self._section_of(adapter)
            if section is not None:
                sections.append(section)
        for key in LORA_CONFIG_KEYS:
            if key in entries:
                sections += self._sections_from_config(Path(entries[key]))
        return sections

    def _section_of(self, adapter: Any) -> SectionFile | None:
        """An ORT adapter's parameters that replace updateable tensors, as a section of this context (made
        once per adapter); None when all its parameters are inputs (fed instead)."""
        assert self._context is not None
        values = {n: v for n, v in adapter.parameters.items() if n in self._updateable()}
        if not values:
            return None
        key = id(adapter)
        with self._states_lock:
            cached = self._adapter_sections.get(key)
        if cached is not None and cached[0] is adapter:
            return cached[1]
        file = self._context.file
        entry = file.graphs[self._graph_name]
        for name, value in values.items():
            if not fits_weight(str(value.dtype), value.shape, file.weights[entry.weights[name]]):
                # e.g. ORT's LoRA layout: empty default parameters ([4, 0]) that adapters replace with rank r
                raise _AdapterNeedsOrt(f"{adapter.path}: {name} is {value.dtype}{list(value.shape)}")
        metadata = {"adapter": str(adapter.path)}
        data = write_section(file, {self._graph_name: values}, [self._graph_name], metadata)
        section = load_section(data)
        with self._states_lock:
            if len(self._adapter_sections) >= 64:  # adapters made per run must not pile up
                self._adapter_sections.pop(next(iter(self._adapter_sections)))
            self._adapter_sections[key] = (adapter, section)  # keeps the adapter: its id is not reused
        return section

    def _sections_from_config(self, path: Path) -> list[SectionFile]:
        """`<graph name>;<section path>` lines (paths relative to the file's folder); this graph's only."""
        if not path.is_file():
            raise InvalidArgument(f"qnn.lora_config {path} does not exist")
        found = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            graph, sep, section = line.partition(";")
            if not sep or not section.strip():
                raise InvalidArgument(f"{path}:{number}: write '<graph name>;<section path>'")
            if graph.strip() != self._graph_name:
                continue
            section_path = (path.parent / section.strip()).resolve()
            if section_path not in self._sections:
                if not section_path.is_file():
                    raise InvalidArgument(f"{path}:{number}: no section at {section_path}")
                self._sections[section_path] = load_section(section_path)
            found.append(self._sections[section_path])
        return found

    def _run_state(self, run_options: RunOptions | Any | None) -> GraphState | None:
        """The state this run's adapters give, over the model's own values; None when it names none.

        Nothing is applied to the session: concurrent runs with different adapters each see their own.
        """
        assert self._context is not None
        wanted = self._lora_sections(run_options) if run_options is not None else []
        if not wanted:
            return None
        key = tuple(id(s) for s in wanted)
        with self._states_lock:
            cached = self._states.get(key)
        if cached is None:
            cached = (wanted, self._context.state_with_sections(self._graph_name, wanted))  # keeps the ids theirs
            with self._states_lock:
                if len(self._states) >= 64:
                    self._states.pop(next(iter(self._states)))
                self._states[key] = cached
        return cached[1]

    def _record(self, start_ns: int, end_ns: int) -> None:
        if self._config.profiling_level != "off":
            self._profile.append((self._graph_name, len(self._profile), (end_ns - start_ns) / 1e3))
        if self._json_profile is not None:
            self._json_profile.run(start_ns, end_ns)

    def _node_rows(self) -> list[tuple[str, str, str, str, str]]:
        """Per-node kernel times from ORT's profiles of this session's graphs (detailed level)."""
        rows = []
        for profile in getattr(self._backend, "profiles", []):
            events = json.loads(Path(profile).read_text())
            # ORT lists a run's node events before the run's own event: match them by start time.
            starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
            for event in events:
                if event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time"):
                    run = bisect.bisect_right(starts, event["ts"])
                    node = event["name"].removesuffix("_kernel_time")
                    op = event.get("args", {}).get("op_name", "")
                    rows.append((self._graph_name, str(run), node, op, f"{float(event.get('dur', 0)):.1f}"))
        return rows

    def end_profiling(self) -> str:
        """Writes the profiles and returns the path of ORT's JSON one (`enable_profiling`), else of the QNN
        EP's CSV (`profiling_level`, `profiling_file_path`); '' when profiling is off.

        CSV basic: one row per run (graph, run, duration). detailed: also one row per node of each run,
        with ORT's kernel time; written once the session's graph is released (close() or end_profiling()).
        """
        csv_path = self._end_csv_profiling()
        if self._fallback is not None and self._json_profile is not None:
            return str(self._fallback.end_profiling())  # ORT ran the model: its own profile, nodes and all
        return self._json_profile.write() if self._json_profile is not None else csv_path

    def _end_csv_profiling(self) -> str:
        if self._config.profiling_level == "off" or not self._config.profiling_file_path:
            return ""
        if self._config.profiling_level == "detailed" and self._context is not None and not self._shared:
            self._context.close()  # releases the graph: ORT writes its profile
            self._context = None
        path = Path(self._config.profiling_file_path)
        table = io.StringIO(newline="")
        writer = csv.writer(table)
        writer.writerow(["graph", "run", "node", "op_type", "duration_us"])
        writer.writerows((g, str(r + 1), "", "", f"{d:.1f}") for g, r, d in self._profile)
        if self._config.profiling_level == "detailed":
            writer.writerows(self._node_rows())
        write_text_atomically(path, table.getvalue())
        return str(path)

    def close(self) -> None:
        profile = getattr(self, "_json_profile", None)
        if profile is not None and profile.events:
            profile.write()  # ORT writes its profile when a profiling session ends, too
        if self._config.profiling_level != "off" and not getattr(self, "_profiled", False):
            self._profiled = True
            self.end_profiling()
        if self._context is not None:
            self._context.close()
            self._context = None
        if self._shared is not None:
            SHARED_CONTEXTS.release(self._shared)
            self._shared = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules may be gone
            pass


def _scratch_folder(owner: object, prefix: str) -> Path:
    """A temporary folder that lives as long as `owner` (the context built in it maps its file, and ORT
    reads weights from that file) and is removed with it or at exit, without a warning."""
    folder = tempfile.mkdtemp(prefix=prefix)
    weakref.finalize(owner, _remove_if_ours, folder, os.getpid())
    return Path(folder)


def _remove_if_ours(folder: str, creator: int) -> None:
    """Removes the folder in the process that made it only: a forked child's exit leaves its parent's."""
    if os.getpid() == creator:
        shutil.rmtree(folder, ignore_errors=True)


def _overridable(model: ModelProto) -> list[str]:
    """Initializers that are also graph inputs: ORT lets a run (or an adapter) override them."""
    inputs = {i.name for i in model.graph.input}
    return sorted(t.name for t in model.graph.initializer if t.name in inputs)


class ModelMetadata:
    """`onnxruntime.ModelMetadata`'s fields."""

    def __init__(self, model: ModelProto) -> None:
        self.producer_name = model.producer_name
        self.graph_name = model.graph.name
        self.domain = model.domain
        self.description = model.doc_string
        self.graph_description = model.graph.doc_string
        # ORT reports an unset model_version as the largest int64 (its "unknown"), not as 0
        self.version = model.model_version if model.HasField("model_version") else 2**63 - 1
        self.custom_metadata_map = {p.key: p.value for p in model.metadata_props}

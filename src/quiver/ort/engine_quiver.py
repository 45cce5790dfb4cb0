"""Quiver's own engine behind a `quiver.ort` session: the model as a context (built from the `.onnx`, or
opened from an EPContext model), its weights mapped and shared, adapters applied per run."""

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
from pathlib import Path
from typing import Any, Literal

import numpy as np

from quiver import errors, fork
from quiver.backends import CpuBackend, get_backend
from quiver.backends.base import Backend
from quiver.formats.section import SectionFile
from quiver.formats.writer import write_text_atomically
from quiver.ir import proto
from quiver.ir.edit import quantized_io
from quiver.ort import context_cache
from quiver.ort.compiler import build_ep_context
from quiver.ort.engine_ort import PlainOrtSession, adapter_feeds, run_into
from quiver.ort.epcontext import EpContext, save_ep_context_model
from quiver.ort.errors import EngineError, InvalidArgument, MissingInputsError, NoSuchFile, ort_error
from quiver.ort.metadata import ExecutionPath, NodeArg, node_arg
from quiver.ort.options import SessionOptions, config_entries, shrinks_cpu_arena
from quiver.ort.provider import ProviderConfig
from quiver.ort.session_config import copy_options
from quiver.ort_package import onnxruntime
from quiver.runtime.context import Context
from quiver.runtime.graph import Graph
from quiver.runtime.sections import fits_weight, load_section, write_section
from quiver.runtime.state import GraphState

LORA_CONFIG_KEYS = ("qnn.lora_config", "quiver.lora_config")
_CACHED_STATES = 64  # adapter states and sections made per run must not pile up

_Key = tuple[str, str, tuple[int, ...]]


def make_backend(config: ProviderConfig, options: SessionOptions | Any, owner: object) -> Backend:
    """The backend a session's provider options ask for; the cpu backend with the caller's ORT settings."""
    if config.backend != "cpu":
        return get_backend(config.backend)
    threads = getattr(options, "intra_op_num_threads", 0) or config.threads
    level = getattr(options, "graph_optimization_level", onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL)
    spinning = config_entries(options).get("session.intra_op.allow_spinning")  # the caller's ORT setting wins
    profiles = scratch_folder(owner, "quiver-profile-") if config.profiling_level == "detailed" else None
    return CpuBackend(
        intra_op_num_threads=threads,
        graph_optimization_level=level,
        allow_spinning=config.spinning if spinning is None else spinning != "0",
        profile_prefix=str(profiles / "ort_profile") if profiles else None,
    )


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


def scratch_folder(owner: object, prefix: str) -> Path:
    """A temporary folder that lives as long as `owner` (the context built in it maps its file, and ORT
    reads weights from that file) and is removed with it or at exit, without a warning."""
    folder = tempfile.mkdtemp(prefix=prefix)
    weakref.finalize(owner, _remove_if_ours, folder, os.getpid())
    return Path(folder)


def _remove_if_ours(folder: str, creator: int) -> None:
    """Removes the folder in the process that made it only: a forked child's exit leaves its parent's."""
    if os.getpid() == creator:
        shutil.rmtree(folder, ignore_errors=True)


def overridable(model: proto.ModelProto) -> list[str]:
    """Initializers that are also graph inputs: ORT lets a run (or an adapter) override them."""
    inputs = {i.name for i in model.graph.input}
    return sorted(t.name for t in model.graph.initializer if t.name in inputs)


class QuiverEngine:
    """One graph of a context, run the way ORT's session API asks: feeds checked as ORT checks them,
    per-run adapters (ORT's `.onnx_adapter`s, QNN's `lora_config`) applied as sections for that run only.

    `twin`: plain ORT over the same model, made on first use (it holds a second copy of the weights), for
    what runs through ORT although the model runs on Quiver: the private `_sess` some client code reaches
    for, and adapters whose tensors have other shapes than the context's (ORT's own LoRA layout).
    """

    path = ExecutionPath("quiver")
    plain_ort: Literal[False] = False

    def __init__(
        self,
        context: Context,
        graph_name: str,
        backend: Backend,
        config: ProviderConfig,
        twin: PlainOrtSession,
        json_profile: Any,
        shared: _Key | None = None,
    ) -> None:
        if graph_name not in context.graph_names:
            context.close()
            raise InvalidArgument(f"the context has no graph {graph_name!r}; its graphs are {context.graph_names}")
        self._context: Context | None = context
        self.graph_name = graph_name
        self.backend = backend
        self._config = config
        self.twin = twin
        self._json_profile = json_profile
        self._shared = shared
        self._broken: str | None = None
        self._graph = context.graph(graph_name)
        self._required = tuple(i.name for i in self._graph.inputs if i.name not in self._graph.inputs_with_defaults)
        self._updateable = frozenset(context.file.graphs[graph_name].updateable)
        self._input_names = frozenset(i.name for i in self._graph.inputs)
        # per-run adapters: the state each set of sections gives (by section identity), built once
        self._states: dict[tuple[int, ...], tuple[list[SectionFile], GraphState]] = {}
        self._lock = threading.Lock()
        self._sections: dict[Path, SectionFile] = {}
        self._adapter_sections: dict[int, tuple[Any, SectionFile]] = {}
        self._profile: list[tuple[str, int, float]] = []
        self._profiled = False
        fork.reset_after_fork(self)

    # --- making one ---------------------------------------------------------------------------------

    @classmethod
    def open_ep_context(
        cls, ep: EpContext, config: ProviderConfig, entries: Mapping[str, str], backend: Backend, **common: Any
    ) -> QuiverEngine:
        shared = None
        if isinstance(ep.cache, Path) and entries.get("ep.share_ep_contexts") == "1":
            context, shared = SHARED_CONTEXTS.acquire(ep.cache, config, backend)
        else:
            context = Context.from_binary(ep.cache, backend=backend)
        return cls(context, ep.graph, backend, config, shared=shared, **common)

    @classmethod
    def build(
        cls,
        model: proto.ModelProto,
        content: bytes,
        source: str | Path | bytes,
        folder: Path | None,
        config: ProviderConfig,
        entries: Mapping[str, str],
        backend: Backend,
        owner: object,
        **common: Any,
    ) -> QuiverEngine:
        """A context of the model (`content`: its bytes as read); `folder` holds its external data (the model
        file's own folder, or for bytes the one `session.model_external_initializers_file_folder_path`
        names). Raises `ConversionError` for a model Quiver cannot take on."""
        source_path = Path(source) if isinstance(source, (str, Path)) else None
        graph_name = model.graph.name or (source_path.stem if source_path else "main")
        if not config.offload_io_quantization:
            model, source_path = quantized_io(model), None  # the caller passes and gets quantized I/O
        if entries.get("ep.context_enable") == "1":
            context = _build_ep_context(model, source_path, folder, graph_name, entries, backend)
        else:
            build = f"{graph_name}\0offload_io_quantization={config.offload_io_quantization}"
            context = _kept_or_built(model, content, source, folder, graph_name, build, backend, owner)
        return cls(context, graph_name, backend, config, **common)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    # --- what it runs -------------------------------------------------------------------------------

    def inputs(self) -> list[NodeArg]:
        return [node_arg(i) for i in self._graph.inputs]

    def outputs(self) -> list[NodeArg]:
        return [node_arg(o) for o in self._graph.outputs]

    def overridable_initializers(self) -> list[NodeArg]:
        """Here the graph's updateable tensors, which an adapter (`RunOptions.add_active_adapter`) replaces."""
        return [node_arg(t) for t in self._graph.static_tensors if t.name in self._updateable]

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any], run_options: Any) -> list[Any]:
        missing = [name for name in self._required if name not in feeds]
        if missing:  # ORT checks this in Python, before running; an adapter may feed some
            adapters = [a.parameters for a in getattr(run_options, "active_adapters", []) if a.parameters]
            missing = [name for name in missing if not any(name in p for p in adapters)]
            if missing:
                raise MissingInputsError(f"Required inputs ({missing}) are missing from input feed ({list(feeds)}).")
        results = self.execute(feeds, run_options, None)
        names = list(output_names) if output_names else list(results)
        unknown = [n for n in names if n not in results]
        if unknown:
            raise InvalidArgument(f"invalid output name(s) {unknown}; the outputs are {list(results)}")
        return [results[n] for n in names]

    def execute(
        self, feeds: Mapping[str, np.ndarray], run_options: Any, out: Mapping[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]:
        """Every output by name; those in `out` are written into the caller's arrays."""
        inputs, overridable_names = self._input_names, self._updateable
        sections = self._lora_sections(run_options) if run_options is not None else []
        if sections is None:  # an adapter of other shapes: ORT runs it, as ORT runs such adapters
            on_ort = adapter_feeds(feeds, run_options, inputs, overridable_names, on_ort=True)
            return run_into(self.twin.get(), on_ort, run_options, out)
        feeds = adapter_feeds(feeds, run_options, inputs, overridable_names, on_ort=False)
        if self._broken is not None:
            raise EngineError(f"this session's backend failed earlier ({self._broken}); create a new session")
        try:
            state = self._state_with(sections) if sections else None
            release = run_options is not None and shrinks_cpu_arena(config_entries(run_options))
            start = time.perf_counter_ns()
            if state is None:
                results = self._graph.execute(dict(feeds), out=out or None, release_scratch=release)
            else:
                results = self._graph.execute_with(dict(feeds), state, out=out or None, release_scratch=release)
            self._record(start, time.perf_counter_ns())
        except errors.BackendError as exc:
            self._broken = str(exc)
            raise EngineError(f"{exc}; the session cannot run any more: create a new session") from None
        except errors.QuiverError as exc:
            raise ort_error(exc) from None
        return results

    @property
    def graph(self) -> Graph:
        return self._graph

    # --- per-run adapters ---------------------------------------------------------------------------

    def _lora_sections(self, run_options: Any) -> list[SectionFile] | None:
        """The sections this run's adapters give; None when one of them has tensors of other shapes."""
        sections: list[SectionFile] = []
        for adapter in getattr(run_options, "active_adapters", []):
            if adapter.section is not None:
                sections.append(adapter.section)
                continue
            values = {n: v for n, v in adapter.parameters.items() if n in self._updateable}
            if not values:
                continue  # all its parameters are inputs: fed instead
            section = self._section_of(adapter, values)
            if section is None:
                return None
            sections.append(section)
        entries = config_entries(run_options)
        for key in LORA_CONFIG_KEYS:
            if key in entries:
                sections += self._sections_from_config(Path(entries[key]))
        return sections

    def _section_of(self, adapter: Any, values: Mapping[str, np.ndarray]) -> SectionFile | None:
        """An ORT adapter's parameters that replace updateable tensors, as a section of this context (made
        once per adapter); None when they do not fit the context's tensors."""
        assert self._context is not None
        with self._lock:
            cached = self._adapter_sections.get(id(adapter))
        if cached is not None and cached[0] is adapter:
            return cached[1]
        file = self._context.file
        entry = file.graphs[self.graph_name]
        for name, value in values.items():
            if not fits_weight(str(value.dtype), value.shape, file.weights[entry.weights[name]]):
                return None  # e.g. ORT's LoRA layout: empty default parameters ([4, 0]) adapters give rank r
        metadata = {"adapter": str(adapter.path)}
        section = load_section(write_section(file, {self.graph_name: values}, [self.graph_name], metadata))
        with self._lock:
            if len(self._adapter_sections) >= _CACHED_STATES:
                self._adapter_sections.pop(next(iter(self._adapter_sections)))
            self._adapter_sections[id(adapter)] = (adapter, section)  # keeps the adapter: its id is not reused
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
            if graph.strip() != self.graph_name:
                continue
            section_path = (path.parent / section.strip()).resolve()
            if section_path not in self._sections:
                if not section_path.is_file():
                    raise InvalidArgument(f"{path}:{number}: no section at {section_path}")
                self._sections[section_path] = load_section(section_path)
            found.append(self._sections[section_path])
        return found

    def _state_with(self, sections: list[SectionFile]) -> GraphState:
        """The state these sections give, over the model's own values. Nothing is applied to the session:
        concurrent runs with different adapters each see their own."""
        assert self._context is not None
        key = tuple(id(s) for s in sections)
        with self._lock:
            cached = self._states.get(key)
        if cached is None:
            cached = (sections, self._context.state_with_sections(self.graph_name, sections))  # keeps the ids
            with self._lock:
                if len(self._states) >= _CACHED_STATES:
                    self._states.pop(next(iter(self._states)))
                self._states[key] = cached
        return cached[1]

    # --- profiling ----------------------------------------------------------------------------------

    def _record(self, start_ns: int, end_ns: int) -> None:
        if self._config.profiling_level != "off":
            self._profile.append((self.graph_name, len(self._profile), (end_ns - start_ns) / 1e3))
        if self._json_profile is not None:
            self._json_profile.run(start_ns, end_ns)

    def _node_rows(self) -> list[tuple[str, str, str, str, str]]:
        """Per-node kernel times from ORT's profiles of this session's graphs (detailed level)."""
        rows = []
        for profile in getattr(self.backend, "profiles", []):
            events = json.loads(Path(profile).read_text())
            # ORT lists a run's node events before the run's own event: match them by start time.
            starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
            for event in events:
                if event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time"):
                    run = bisect.bisect_right(starts, event["ts"])
                    node = event["name"].removesuffix("_kernel_time")
                    op = event.get("args", {}).get("op_name", "")
                    rows.append((self.graph_name, str(run), node, op, f"{float(event.get('dur', 0)):.1f}"))
        return rows

    def end_profiling(self) -> str:
        """The QNN EP's CSV profile (`profiling_level`, `profiling_file_path`), or '' when it is off.

        basic: one row per run (graph, run, duration). detailed: also one row per node of each run, with
        ORT's kernel time; written once the session's graph is released (close() or end_profiling()).
        """
        self._profiled = True
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

    def assignment_info(self) -> list[Any] | None:
        return None  # the facade reports the whole graph as this provider's

    def close(self) -> None:
        if self._config.profiling_level != "off" and not self._profiled:
            self.end_profiling()
        if self._context is not None:
            self._context.close()
            self._context = None
        if self._shared is not None:
            SHARED_CONTEXTS.release(self._shared)
            self._shared = None

    @property
    def context(self) -> Context | None:
        """The context this session's graph runs in (None once closed): Quiver's API over the same graph."""
        return self._context

    @property
    def shared_key(self) -> _Key | None:
        """Which context of `SHARED_CONTEXTS` this session shares (`ep.share_ep_contexts=1`), if any."""
        return self._shared


def _kept_or_built(
    model: proto.ModelProto,
    content: bytes,
    source: str | Path | bytes,
    folder: Path | None,
    graph_name: str,
    build: str,
    backend: Backend,
    owner: object,
) -> Context:
    """The model's context: kept by an earlier session (`context_cache`), or built now and kept."""
    cache = context_cache.cache_folder()
    key = context_cache.key_of(model, content, source, folder, build) if cache is not None else None
    kept_in = context_cache.prepare_folder(cache) if cache is not None and key is not None else None
    if kept_in is not None and key is not None:
        kept = context_cache.lookup(kept_in, key)
        if kept is not None:
            try:
                return Context.from_binary(kept, backend=backend)
            except errors.QuiverError:  # damaged, or of another format: built again below
                kept.unlink(missing_ok=True)
    builder = Context.create(backend, workdir=kept_in or scratch_folder(owner, "quiver-ort-"))
    # The model parsed once: its external data resolves against `folder` (the model file's own). ORT folds
    # its constants itself, at the session's level (at DISABLE_ALL it runs them, as plain ORT does).
    builder.add_graph(
        graph_name, model, updateable=overridable(model), external_data_folder=folder, fold_constants=False
    )
    if kept_in is None or key is None:
        return builder.finalize()
    path = builder.save(kept_in / f"{key}.qctx", prepare_ahead=False)  # forced to disk, renamed into place
    context_cache.evict(kept_in, keep=path)
    return builder


def twin_of(source: str | Path | bytes, options: Any) -> PlainOrtSession:
    """The plain-ORT twin of a session: made on first use; it neither profiles nor writes the model again."""
    if isinstance(options, SessionOptions):
        options = copy_options(options, without=("enable_profiling", "optimized_model_filepath"))
    return PlainOrtSession(source, options)


def _build_ep_context(
    model: proto.ModelProto,
    source: Path | None,
    folder: Path | None,
    graph_name: str,
    entries: Mapping[str, str],
    backend: Backend,
) -> Context:
    """ep.context_enable=1: `<model>_ctx.onnx` (or ep.context_file_path) and the `.qctx` beside it."""
    default = source.with_name(source.stem + "_ctx.onnx") if source else None
    target = Path(entries.get("ep.context_file_path", "") or default or "")
    if not target.name:
        raise InvalidArgument("a model given as bytes needs ep.context_file_path to write its EPContext model")
    embed = entries.get("ep.context_embed_mode", "0")
    if embed not in ("0", "1"):
        raise InvalidArgument(f"ep.context_embed_mode must be 0 or 1, not {embed!r}")
    wrapper, cache = build_ep_context(model, source, graph_name, target, embed == "1", backend, folder)
    save_ep_context_model(wrapper, target)
    return Context.from_binary(cache, backend=backend)

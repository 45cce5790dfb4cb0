"""The cpu backend: ONNX Runtime's CPU execution provider over the context's mapped weights, without copies.

Weights reach ORT through `AddInitializer` as views of the mapped context, so they are in memory once.
ORT repacks MatMul/Gemm weights for speed; all sessions of a context share one prepacked-weights
container (ORT keys it by content), so a weight shared by several graphs is packed once. Packing costs
time at session creation, so a graph first runs on a session without packing and is upgraded to a
packed session in the background after its first output ("lazy prepacking").
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np

from quiver import portable
from quiver.backends import _ort_capi, cpu_packed_file, cpu_prepared
from quiver.backends.base import AheadOfTimeForm, FinalizedGraph, Knob, WeightFile
from quiver.backends.cpu_settings import (
    DEFAULT_ACCURACY_LEVEL,
    KNOB_SPACE_VERSION,
    OPTIMIZATION_LEVELS,
    SessionSettings,
    device_fingerprint,
    knobs,
)
from quiver.backends.cpu_weights import PLACEHOLDER_FOLDER, SessionWeights
from quiver.backends.lora_strengths import StrengthFolding, fold_lora_strengths
from quiver.errors import BackendError
from quiver.ir import proto
from quiver.ir.edit import iter_nodes
from quiver.ort_package import onnxruntime as ort
from quiver.ort_process import (
    GLOBAL_POOLS_MESSAGE,
    global_thread_pools_in_use,
    ort_log_severity,
    use_global_thread_pools,
)

# Level 4 of ORT's MatMulNBits (see DEFAULT_ACCURACY_LEVEL) runs only on prepacked weights, so a graph
# with such MatMuls gets no unpacked stand-in session (it would compute in float32: another answer).
_INTEGER_MATMUL_OPS = {"MatMulNBits", "DequantizeLinear"}
# Before 1.32, ORT's MatMulNBits cannot keep its packed weights in a shared container (session creation
# fails): such graphs then pack their own copies, through the Python API.
_ORT_VERSION = tuple(int(p) for p in ort.__version__.split(".")[:2])
_SHARED_INTEGER_PACKING = _ORT_VERSION >= (1, 32)
# Decoders with ORT's contrib MoE gave other tokens than transformers under 1.24 where the top-k weights
# stay unnormalized (Qwen's MoE; the operator alone matched numpy there: the cause is not found), equal
# ones under 1.32 (tests/integration/test_families.py): older versions are refused rather than trusted
_TRUSTED_MOE = _ORT_VERSION >= (1, 32)

# (domain, op) of the nodes whose constant B ORT packs: its contrib FusedMatMul (a transposed-weight
# MatMul, as Quiver writes tied LM heads) packs like MatMul (measured: dropping its mapped pages after
# packing saves their RSS and costs no speed)
_PREPACKED_OPS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "FusedMatMul")}
_C_API_ONLY_IO = {"bfloat16", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz", "int4", "uint4"}
_NOTHING: Mapping[str, np.ndarray] = MappingProxyType({})
_PAGE = mmap.PAGESIZE
_MADV_RANDOM, _MADV_DONTNEED = 1, 4
_REDROP_EVERY = 256  # runs between two drops of packed weights' mapped pages (0.7 ms for SmolLM2-135M)
_DROP_WHILE_PACKING_S = 0.02  # how often mapped pages are let go while a session packs its weights
# Making and dropping ORT sessions, which a fork waits for (see fork_gate); for other modules that make them.
fork_waits = _ort_capi.fork_waits


def _ort_failure(exc: Exception) -> BackendError:
    """What a failed run raises: Quiver's own errors as they are, ORT's (plain exceptions) as a BackendError."""
    return exc if isinstance(exc, BackendError) else BackendError(f"cpu backend (ONNX Runtime) failed: {exc}")


def _packable_weights(graph: FinalizedGraph) -> list[np.ndarray]:
    """The weights ORT may pack for this graph: constant B inputs of MatMul/Gemm/FusedMatMul."""
    names = {
        node.input[1]
        for node in graph.model.graph.node
        if (node.domain.replace("ai.onnx", ""), node.op_type) in _PREPACKED_OPS and len(node.input) > 1
    }
    return [graph.weights[n] for n in sorted(names) if n in graph.weights]


def _has_integer_matmuls(model: proto.ModelProto) -> bool:
    return any(n.op_type in _INTEGER_MATMUL_OPS for n in model.graph.node)


# Operators whose packed kernels compute otherwise than their unpacked ones (ORT's recurrent kernels pack
# their weights for another GEMM path: outputs differ in the last bits; integer and contrib kernels pack
# into their own layouts). A graph with one runs packed from its first output, which must equal every
# later one. MatMul, Gemm and FusedMatMul give the same bits either way (checked by the corpus tests).
_PACKING_CHANGES_RESULTS = {"LSTM", "GRU", "RNN", "MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul"}


def _packing_changes_results(model: proto.ModelProto) -> bool:
    return any(
        node.op_type in _PACKING_CHANGES_RESULTS or (node.domain == "com.microsoft" and node.op_type != "FusedMatMul")
        for node in iter_nodes(model.graph)
    )


def _with_accuracy_level(model: proto.ModelProto, level: int) -> proto.ModelProto:
    """MatMulNBits nodes at the backend's accuracy level, but for those that set their own (as ORT runs
    them: a float-minimum block that needs float activations, a model exported for a given level)."""
    result = proto.ModelProto()
    result.CopyFrom(model)
    for node in result.graph.node:
        if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
            node.attribute.append(proto.AttributeProto(name="accuracy_level", type=proto.AttributeProto.INT, i=level))
    return result


def _without_trailing_empty_inputs(model: proto.ModelProto) -> proto.ModelProto:
    """The model with omitted trailing optional inputs left out rather than named "" (ONNX allows both).

    ORT 1.24-1.32 crash (SIGSEGV, while creating the session) on a quantized graph whose
    LayerNormalization lists its bias as "" (found by the fuzz harness); without the "" it is fine.
    """
    if not any(node.input and not node.input[-1] for node in model.graph.node):
        return model
    result = proto.ModelProto()
    result.CopyFrom(model)
    for node in result.graph.node:
        while node.input and not node.input[-1]:
            del node.input[-1]
    return result


_shared_arena_process: int | None = None  # the process whose Python-API sessions share ORT's env arena
_shared_arena_lock = threading.Lock()


def _shared_arena() -> bool:
    """Whether Python-API sessions made now share one CPU arena in ORT's env (`session.use_env_allocators`),
    registered on first use, as `_ort_capi` does for its own: each stand-in growing an arena of its own
    left ~2 MB per MiniLM graph behind it. Not in a forked child (a parent's thread may hold its lock)."""
    global _shared_arena_process
    with _shared_arena_lock:
        if _shared_arena_process is None:
            memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            try:
                ort.create_and_register_allocator(memory, None)
            except Exception as exc:  # registered already (by the user, or by this ORT's C API): shared all the same
                if "already" not in str(exc):
                    _shared_arena_process = -1
                    return False
            _shared_arena_process = os.getpid()
        return _shared_arena_process == os.getpid()


def _return_freed_memory() -> None:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim) once a stand-in session is gone:
    without it, what that session freed stays in this process's RSS (~1.3 MB per MiniLM graph)."""
    portable.return_freed_memory()


def _drop_resident_pages(arrays: list[np.ndarray]) -> None:
    """Tells the kernel the mapped pages of packed weights are not needed now (MADV_DONTNEED).

    ORT computes with the packed copies, so the mapped originals only inflate RSS. The mapping is a
    read-only shared file mapping: a later read faults the pages back in from the page cache. Such
    reads are sparse (an embedding table that is also a tied LM head: Gather reads a row per token),
    so they fault in just their pages (MADV_RANDOM), not the 64 KB around each that the kernel would
    map ahead: over a conversation that made the whole table resident again.
    """
    _advise(arrays, _MADV_DONTNEED, _MADV_RANDOM)


def _advise(arrays: list[np.ndarray], *advice: int) -> None:
    """madvise() on the whole pages of each array (neighbours may share the edge pages)."""
    for array in arrays:
        portable.advise_pages(array.__array_interface__["data"][0], array.nbytes, *advice)


def _packing_while_dropping(arrays: list[np.ndarray], create: Callable[[], _Session]) -> _Session:
    """Runs `create` (making a packed session) while another thread lets go, every few milliseconds,
    of the mapped pages ORT has read so far: the process never holds the mapped originals and their
    packed copies of every weight at once (SmolLM2-135M's peak was 1.2 GB for 0.54 GB of weights).

    Pages ORT still reads fault back in from the page cache. Read-ahead stays on while it packs
    (no MADV_RANDOM here): it reads each weight from start to end.
    """
    if portable.c_call("madvise") is None or not arrays:
        return create()
    done = threading.Event()

    def drop_until_done() -> None:
        while not done.wait(_DROP_WHILE_PACKING_S):
            _advise(arrays, _MADV_DONTNEED)

    dropper = threading.Thread(target=drop_until_done, name="quiver-drop-while-packing", daemon=True)
    dropper.start()
    try:
        return create()
    finally:
        done.set()
        dropper.join()


def _session_model(graph: FinalizedGraph, settings: SessionSettings) -> tuple[proto.ModelProto, StrengthFolding | None]:
    """The model ORT is given for this graph: LoRA strengths folded, and Quiver's MatMulNBits at the
    settings' accuracy level (the same at build, for a prepared form, as at open)."""
    model, strengths = fold_lora_strengths(_without_trailing_empty_inputs(graph.model))
    if not _TRUSTED_MOE and any(n.op_type == "MoE" for n in model.graph.node):
        raise BackendError(f"graph {graph.name!r} has mixture-of-experts layers, which need onnxruntime >= 1.32 "
                           f"(this is {ort.__version__}, whose MoE kernel gave other tokens in Quiver's tests): "
                           "pip install -U onnxruntime")  # fmt: skip
    if settings.accuracy_level > 0 and any(n.op_type == "MatMulNBits" for n in model.graph.node):
        model = _with_accuracy_level(model, settings.accuracy_level)
    return model, strengths


class _PythonApiSession:
    """A session through ORT's Python API: weights by `add_initializer`, no packing shared across graphs.

    Used for the first output (ORT's Python module is loaded already; its C library is not) and for
    `prepack=False`.
    """

    def __init__(
        self,
        weights: SessionWeights,
        backend: CpuBackend,
        settings: SessionSettings,
        prepack: bool,
        save_to: Path | None = None,
    ) -> None:
        """`save_to`: a folder where ORT writes the graph's packed form (`cpu_packed_file`) as it makes it."""
        options = ort.SessionOptions()
        options.intra_op_num_threads = settings.intra_op_num_threads
        options.graph_optimization_level = settings.ort_level
        options.log_severity_level = ort_log_severity()
        entries = _config(settings, prepack, weights.folder)
        if settings.prepack and not prepack:
            # A stand-in until the packed session is ready: its threads should not spin after a run and
            # keep the packing thread off the cores, and it grows no arena of its own: a new arena's first
            # chunks cost its first run ~4 ms on MiniLM (measured), and the stand-in runs only a few times
            # (where the env's shared arena is used, it takes its memory from there).
            entries["session.intra_op.allow_spinning"] = "0"
            options.enable_cpu_mem_arena = False
        if save_to is not None:
            # made only to write the form, then dropped: its packed copy must go back to the system with it,
            # so no arena (the env's never shrinks) holds it
            options.optimized_model_filepath = str(save_to / cpu_packed_file.MODEL)
            options.enable_cpu_mem_arena = False
            entries |= cpu_packed_file.save_entries()
        elif _shared_arena():  # ORT's env arena, shared with the other sessions (the stand-in's first chunks too)
            entries["session.use_env_allocators"] = "1"
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        if backend.profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = backend.profile_prefix
        self._values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in weights.shared.items()}
        for name, value in self._values.items():
            options.add_initializer(name, value)
        self._readable = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in weights.readable.items()}
        if self._readable:
            options.add_external_initializers(list(self._readable), list(self._readable.values()))
        if global_thread_pools_in_use():
            options.use_per_session_threads = False
        try:
            self._session = ort.InferenceSession(weights.model, options, providers=["CPUExecutionProvider"])
        except RuntimeError as exc:  # global pools made by a direct call to onnxruntime: use them from now on
            if GLOBAL_POOLS_MESSAGE not in str(exc) or global_thread_pools_in_use():
                raise
            use_global_thread_pools()
            options.use_per_session_threads = False
            self._session = ort.InferenceSession(weights.model, options, providers=["CPUExecutionProvider"])

    def run(
        self,
        output_names: list[str],
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
    ) -> list[np.ndarray]:
        if not out:
            return list(self._session.run(output_names, {**bound, **feeds}))
        binding = self._session.io_binding()
        buffers = {id(array) for array in out.values()}
        for name, array in {**bound, **feeds}.items():
            if id(array) in buffers:  # also an output buffer (a KV cache): the same memory, not a copy
                binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
            else:
                binding.bind_cpu_input(name, array)
        for name in output_names:
            if name in out:
                array = out[name]
                binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
            else:
                binding.bind_output(name, "cpu")
        self._session.run_with_iobinding(binding)
        # in the order bound: output_names; the caller's buffers already hold theirs (copy_outputs_to_cpu
        # would copy every output, a whole KV cache included)
        values = binding.get_outputs()
        return [out[name] if name in out else value.numpy() for name, value in zip(output_names, values)]

    def end_profiling(self) -> str:
        return str(self._session.end_profiling())


_Session = _ort_capi.Session | _PythonApiSession


def _config(settings: SessionSettings, prepack: bool, folder: str = PLACEHOLDER_FOLDER) -> dict[str, str]:
    return {"session.model_external_initializers_file_folder_path": folder, **settings.config(prepack)}


def _create_session(
    graph: FinalizedGraph,
    weights: SessionWeights,
    backend: CpuBackend,
    settings: SessionSettings,
    packed: bool,
    shareable: bool = True,
    c_api_only: bool = False,
) -> _Session:
    """A packed session shares the context's container (C API); an unpacked one comes from the Python API.

    Both are made at the same optimization level: ORT's fusions change results (QDQ fusions compute in
    integers), and the first output must equal every later one. `c_api_only`: graphs exchanging float8
    or 4-bit tensors, which ORT's Python API cannot pass.
    """
    with _ort_capi.fork_waits():  # a fork never finds ORT halfway through making a session
        try:
            if (packed or c_api_only) and shareable and backend.profile_prefix is None:
                try:
                    return _ort_capi.Session(
                        weights.model,
                        weights.shared,
                        weights.readable,
                        backend.container(),
                        _config(settings, prepack=packed, folder=weights.folder),
                        settings.intra_op_num_threads,
                        int(settings.ort_level),
                        per_session_threads=not global_thread_pools_in_use(),
                        log_severity=ort_log_severity(),
                    )
                except _ort_capi.CApiUnavailableError:
                    if c_api_only:
                        raise BackendError(
                            f"graph {graph.name!r} exchanges float8 or 4-bit tensors, which only ORT's C API can pass, "
                            "and this ONNX Runtime does not offer the functions Quiver needs"
                        ) from None
                    # no shared packing on this install: each graph packs its own copy
            return _PythonApiSession(weights, backend, settings, packed)
        except Exception as exc:
            raise BackendError(f"cpu backend (ONNX Runtime) cannot prepare graph {graph.name!r}: {exc}") from None


_Form = tuple[FinalizedGraph, SessionSettings]  # a graph (its model: the session model) and how its sessions are made


def _in_prepared_form(graph: FinalizedGraph, data: bytes, settings: SessionSettings) -> _Form | None:
    """The graph as its prepared form for this ORT, made at build from this same session model (`data`)."""
    if not graph.prepared:
        return None
    form = cpu_prepared.usable_form(
        graph, cpu_prepared.source_digest(data, settings.accuracy_level), settings.ort_level
    )
    if form is None:
        return None
    model = form.model()
    level = cpu_prepared.open_level(model, settings.graph_optimization_level)
    prepared = dataclasses.replace(graph, model=model, weights=form.weights)
    return prepared, dataclasses.replace(settings, graph_optimization_level=level)


class CpuExecutable:
    def __init__(self, graph: FinalizedGraph, backend: CpuBackend) -> None:
        self.settings = settings = backend.settings_for(graph)
        model, self._strengths = _session_model(graph, settings)
        has_integer_matmuls = _has_integer_matmuls(model)
        integer_matmuls = settings.accuracy_level > 0 and has_integer_matmuls
        data = model.SerializeToString()
        portable = dataclasses.replace(graph, model=model), settings
        prepared = _in_prepared_form(graph, data, settings)
        self._backend = backend
        self._output_names = [o.name for o in graph.outputs]
        self._upgrade: threading.Thread | None = None
        self._upgrade_lock = threading.Lock()  # one packing thread, started once, joined only once started
        self._released = False
        io_types = {t.dtype for t in (*graph.inputs, *graph.outputs)}
        # float8 and 4-bit tensors pass only through the C API (one session, packed from the start);
        # strings only through the Python API (its sessions)
        self._c_api_only = bool(io_types & _C_API_ONLY_IO) and "string" not in io_types
        stand_in_differs = integer_matmuls or _packing_changes_results(model)
        packed_first = settings.prepack and (not backend.lazy_prepack or stand_in_differs or self._c_api_only)
        self.is_packed = packed_first
        # whatever the accuracy level: before 1.32 no MatMulNBits kernel can keep packed weights in a container
        self._shareable = (_SHARED_INTEGER_PACKING or not has_integer_matmuls) and "string" not in io_types
        self.prepared = prepared is not None  # sessions come from the context's prepared form (cpu_prepared)
        self._use(*(prepared or portable))
        self.packed_file: Path | None = None  # the packed form sessions come from (cpu_packed_file), if any
        if backend.packed_weights is not None and self._packs_into_file():
            self._from_packed_file(backend.packed_weights)
        try:
            self._session: _Session | None = self._create_first()
        except BackendError:
            if prepared is None and self.packed_file is None:
                raise
            # a form this ORT refuses after all: the portable skeleton, packed by this process, as before
            self.prepared, self.packed_file, self.is_packed = False, None, packed_first
            self._use(*portable)
            self._session = self._create_first()
        self._upgrade_pending = settings.prepack and not self.is_packed
        self._runs_since_drop = 0
        if self.is_packed:
            _drop_resident_pages(self._droppable)
            self._forget_sources()

    def _use(self, graph: FinalizedGraph, settings: SessionSettings) -> None:
        """Sessions are made from this form of the graph, with `settings`."""
        self._graph = graph
        self._session_settings = settings
        # Only pages of a file mapping can be dropped: private memory would lose its contents.
        self._packable = _packable_weights(graph) if self.settings.prepack else []
        self._droppable = self._packable if graph.file_backed else []
        self._prepacked = sum(a.nbytes for a in self._packable)
        self._weights = SessionWeights.of(graph, graph.model, optimized=settings.graph_optimization_level != "disabled")

    def _packs_into_file(self) -> bool:
        """Whether this graph's packed weights may come from a file: ORT packs some, its weights are mapped
        from a context file (whose identity names them), and its sessions need nothing a file-made session
        lacks (the C API's special tensors, strings, profiling)."""
        mapping = self._graph.mapping
        return (
            bool(self._packable)
            and self._shareable
            and not self._c_api_only
            and self._backend.profile_prefix is None
            and mapping is not None
            and bool(mapping.identity)
        )

    def _from_packed_file(self, folder: Path) -> None:
        """Sessions come from the graph's packed form under `folder`, made now if there is none: its packed
        weights are mapped from that file, shared with every other process that opens this graph."""
        settings, mapping = self._session_settings, self._graph.mapping
        assert mapping is not None
        # ORT writes every weight out from where the model says it lies: the context file, even where its
        # sessions would get them all as shared initializers (a prepared form opened with optimizers off)
        weights = SessionWeights.of(self._graph, self._graph.model)
        key = cpu_packed_file.form_key(
            weights.model, mapping.identity, settings.config(prepack=True), int(settings.ort_level)
        )

        def make(staging: Path) -> None:
            try:
                with _ort_capi.fork_waits():
                    _PythonApiSession(weights, self._backend, settings, prepack=True, save_to=staging)
            except Exception as exc:
                raise cpu_packed_file.FormNotMadeError(f"ORT did not write the packed form: {exc}") from None
            finally:
                _return_freed_memory()  # the writing session's packed copy, gone with it

        try:
            form = cpu_packed_file.open_or_make(folder, key, make)
        except cpu_packed_file.FormNotMadeError:
            return  # this graph packs in this process, as without a folder
        _drop_resident_pages(self._droppable)  # what making the form read: nothing reads it from here on
        self._weights = SessionWeights(form.model, {}, {}, str(form.folder), None)
        self._droppable, self._prepacked = [], 0  # nothing packed is private
        self.is_packed, self.packed_file = True, form.folder

    def _forget_sources(self) -> None:
        """Once the packed session runs, no session is made again from this executable (a forked child makes
        new executables): the skeleton's bytes and parsed copy would only hold memory (~0.3 MB for MiniLM)."""
        self._graph = self._weights = None  # type: ignore[assignment]

    def _create(self, packed: bool) -> _Session:
        def create(weights: SessionWeights) -> _Session:
            return _create_session(
                self._graph,
                weights,
                self._backend,
                self._session_settings,
                packed=packed,
                shareable=self._shareable,
                c_api_only=self._c_api_only,
            )

        weights = self._weights
        session = create(weights)
        if weights.mapping is not None and not weights.mapping.is_current():
            # The file was replaced while ORT read it, so it may have read the new one: read nothing from
            # files (the mapping still holds the weights this context opened).
            self._weights = weights = SessionWeights.of(self._graph, self._graph.model, files=False)
            session = create(weights)
        return session

    def _create_first(self) -> _Session:
        if not self.is_packed:
            return self._create(packed=False)
        # Packed from the start, nothing else of this graph reads the mapped weights meanwhile: let them
        # go as they are packed. (A stand-in's runs would fault them back in on every run.)
        return _packing_while_dropping(self._droppable, lambda: self._create(packed=True))

    def _build_packed_session(self) -> None:
        # Hand the interpreter back first: the run that started this thread returns its output now,
        # instead of waiting for this thread to give way (~0.7 ms measured, loading ORT's C library).
        time.sleep(0)
        try:
            packed = self._create(packed=True)
        except BackendError:
            return  # keep the unpacked session: slower, but correct
        with self._upgrade_lock:
            if self._released:
                return  # released while packing: the packed session goes with this thread
            stand_in, self._session = self._session, packed  # runs in flight keep the old session
            self.is_packed = True
        _drop_resident_pages(self._droppable)
        self._forget_sources()
        with _ort_capi.fork_waits():  # nor halfway through dropping one
            del stand_in
        _return_freed_memory()

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        session = self._session
        if session is None:
            raise BackendError("this executable was released; prepare the graph again")
        bound = _NOTHING if bound is None else bound  # the same object run after run: sessions key on it
        if self._strengths is not None:
            feeds, bound = self._strengths.apply(feeds, bound)
        try:
            outputs = session.run(self._output_names, feeds, bound, _NOTHING if out is None else out)
        except Exception as exc:
            raise _ort_failure(exc) from None
        if self._upgrade_pending:
            self._start_upgrade()
        elif self.is_packed and self._droppable:
            self._count_run()
        return outputs

    def _count_run(self) -> None:
        """Packed weights whose originals are still read (a tied embedding's rows, by Gather) fault pages
        back in as a conversation goes on: let them go again every `_REDROP_EVERY` runs."""
        self._runs_since_drop += 1
        if self._runs_since_drop >= _REDROP_EVERY:
            self._runs_since_drop = 0
            _drop_resident_pages(self._droppable)

    def repeater(
        self,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray] | None,
        out: Mapping[str, np.ndarray],
    ) -> Callable[[], None]:
        """`run(feeds, bound, out)` again and again, the feeds' values rewritten in place between runs and
        nothing else changed (a generation's decode steps): through the C API session, its arrays built
        once (`_ort_capi.Session.repeater`); otherwise runs as `run` does."""
        session = self._session
        if isinstance(session, _ort_capi.Session) and not self._upgrade_pending:
            given_bound = _NOTHING if bound is None else bound
            if self._strengths is not None:  # folded strengths depend on what is bound, fixed meanwhile
                feeds, given_bound = self._strengths.apply(feeds, given_bound)
            try:
                repeat = session.repeater(self._output_names, feeds, given_bound, out)
            except Exception as exc:
                raise _ort_failure(exc) from None
            if repeat is not None:
                return self._counted(repeat)

        def run_again() -> None:
            self.run(feeds, bound, out)

        return run_again

    def _counted(self, repeat: Callable[[], None]) -> Callable[[], None]:
        """`repeat`, its runs counted as `run` counts them (`_count_run`), its errors ORT's."""
        counted = self.is_packed and bool(self._droppable)

        def run() -> None:
            try:
                repeat()
            except Exception as exc:
                raise _ort_failure(exc) from None
            if counted:
                self._count_run()

        return run

    def _start_upgrade(self) -> None:
        with self._upgrade_lock:
            if not self._upgrade_pending or self._released:
                return
            self._upgrade_pending = False
            # Not a daemon: at exit the interpreter waits for it rather than tearing ORT down mid-session.
            upgrade = threading.Thread(target=self._build_packed_session, name="quiver-prepack")
            upgrade.start()
            self._upgrade = upgrade

    def wait_until_ready(self) -> None:
        """Blocks until the background packed session (if any) is in place."""
        with self._upgrade_lock:
            upgrade = self._upgrade
        if upgrade is not None:
            upgrade.join()

    @property
    def private_bytes(self) -> int:
        return self._prepacked

    def release(self) -> None:
        """Drops the session at once: a packing thread still at work finishes on its own and discards
        what it made (closing a context never waits for background packing)."""
        with self._upgrade_lock:
            self._upgrade_pending = False  # no packing starts after this
            self._released = True
            session, self._session = self._session, None
        if self._backend.profile_prefix is not None and isinstance(session, _PythonApiSession):
            self._backend.profiles.append(session.end_profiling())  # profiling sessions are packed eagerly
        with _ort_capi.fork_waits():  # dropped here unless a run in flight still holds it
            del session


class CpuBackend:
    """ONNX Runtime CPU EP over mapped weights.

    `prepack=True` (default): ORT repacks MatMul/Gemm weights for speed, once per distinct weight per
    context (a shared container). `lazy_prepack=True` (default): the first output comes from an
    unpacked session; the packed one is made in the background after it. `prepack=False`: weights stay
    only in the mapping (smallest memory), at a latency cost. `packed_weights`: a folder where each graph's
    packed weights are kept in a file (`cpu_packed_file`), made once and mapped by every process that
    opens the graph on this machine (a server's replicas), instead of packed privately by each; for graphs
    that share weights within one process (a dialog's prefill and decode), the container is the better way.
    `spin_between_runs=False`: worker threads stop spinning when a run returns, for graphs that take turns.
    """

    name = "cpu"

    def __init__(
        self,
        intra_op_num_threads: int = 0,
        prepack: bool = True,
        lazy_prepack: bool = True,
        graph_optimization_level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        allow_spinning: bool = True,
        profile_prefix: str | None = None,
        accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
        dynamic_block_base: int = 0,
        packed_weights: str | Path | None = None,
        spin_between_runs: bool = True,
    ) -> None:
        level = next((n for n in OPTIMIZATION_LEVELS if OPTIMIZATION_LEVELS[n] == graph_optimization_level), "all")
        self.settings = SessionSettings(
            intra_op_num_threads, allow_spinning, dynamic_block_base, level, prepack, accuracy_level, spin_between_runs
        )
        # A tuned context's configuration applies to the settings left at their defaults: the user's win.
        defaults = SessionSettings()
        self.chosen = frozenset(
            f.name for f in dataclasses.fields(defaults) if getattr(self.settings, f.name) != getattr(defaults, f.name)
        )
        # Per-node profiles (ORT's JSON) of every session, written when a graph is released; profiling
        # sessions come from the Python API, packed eagerly (one session per graph).
        self.profile_prefix = profile_prefix
        self.profiles: list[str] = []
        if profile_prefix is not None:
            lazy_prepack = False
        self.lazy_prepack = lazy_prepack
        self.packed_weights = Path(packed_weights) if packed_weights is not None else None
        self._container: _ort_capi.PrepackedWeights | None = None
        self._lock = threading.Lock()

    # the settings of sessions made without a tuned configuration
    intra_op_num_threads = property(lambda self: self.settings.intra_op_num_threads)
    allow_spinning = property(lambda self: self.settings.allow_spinning)
    prepack = property(lambda self: self.settings.prepack)
    accuracy_level = property(lambda self: self.settings.accuracy_level)

    def settings_for(self, graph: FinalizedGraph) -> SessionSettings:
        return self.settings.tuned(graph.tuning, keep=self.chosen) if graph.tuning else self.settings

    # --- tuning (see quiver.tuning) ---------------------------------------------------------------------
    knob_space_version = KNOB_SPACE_VERSION

    def tunable_parameters(self, graph: FinalizedGraph) -> tuple[Knob, ...]:
        """The knobs tuning may turn for this graph (accuracy level only where MatMulNBits may run)."""
        return knobs(_has_integer_matmuls(graph.model), prepacks=bool(_packable_weights(graph)))

    def device_fingerprint(self) -> dict[str, str]:
        return device_fingerprint()

    def container(self) -> _ort_capi.PrepackedWeights:
        """The prepacked-weights container shared by every graph prepared by this backend (one context)."""
        with self._lock:
            if self._container is None:
                self._container = _ort_capi.PrepackedWeights()
            return self._container

    def after_fork_in_child(self) -> None:
        """A forked child packs into a container of its own: the parent's may be locked by a thread the
        child does not have. The old one is kept (destroying it could wait on that lock)."""
        from quiver.fork import keep_forever

        self._lock = threading.Lock()
        if self._container is not None:
            keep_forever(self._container)
            self._container = None

    def prepare_ahead(self, graph: FinalizedGraph, stored: WeightFile) -> AheadOfTimeForm | None:
        """ORT's optimized form of the graph, to store in the context (see `cpu_prepared`)."""
        settings = self.settings_for(graph)
        model, _ = _session_model(graph, settings)
        source = cpu_prepared.source_digest(model.SerializeToString(), settings.accuracy_level)
        return cpu_prepared.prepare(model, stored, source, settings.config(prepack=False), ort_log_severity())

    def prepare(self, graph: FinalizedGraph) -> CpuExecutable:
        for tensor in graph.model.graph.initializer:
            if tensor.data_location == proto.TensorProto.EXTERNAL and tensor.name not in graph.weights:
                raise BackendError(f"graph {graph.name!r}: no weight supplied for initializer {tensor.name!r}")
        return CpuExecutable(graph, self)

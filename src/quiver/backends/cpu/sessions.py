"""ORT sessions for a graph: through the C API (sharing the context's packed weights) or ORT's Python API."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from quiver import portable
from quiver.backends.base import FinalizedGraph
from quiver.backends.cpu import capi, capi_session, packed_file
from quiver.backends.cpu.memory import MADV_DONTNEED, advise
from quiver.backends.cpu.native_ops import register_python
from quiver.backends.cpu.settings import SessionSettings
from quiver.backends.cpu.weights import PLACEHOLDER_FOLDER, SessionWeights
from quiver.errors import BackendError
from quiver.ort_package import onnxruntime as ort
from quiver.ort_process import (
    GLOBAL_POOLS_MESSAGE,
    global_thread_pools_in_use,
    ort_log_severity,
    use_global_thread_pools,
)

_DROP_WHILE_PACKING_S = 0.02  # how often mapped pages are let go while a session packs its weights

_shared_arena_process: int | None = None  # the process whose Python-API sessions share ORT's env arena
_shared_arena_lock = threading.Lock()


def _shared_arena() -> bool:
    """Whether Python-API sessions made now share one CPU arena in ORT's env (`session.use_env_allocators`),
    registered on first use, as `capi` does for its own: each stand-in growing an arena of its own
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


def packing_while_dropping(
    arrays: list[np.ndarray], create: Callable[[], AnySession], may_drop: Callable[[], bool] | None = None
) -> AnySession:
    """Runs `create` (making a packed session) while another thread lets go, every few milliseconds,
    of the mapped pages ORT has read so far: the process never holds the mapped originals and their
    packed copies of every weight at once (SmolLM2-135M's peak was 1.2 GB for 0.54 GB of weights).
    `may_drop`: asked before each drop (an unpacked session running meanwhile would read them all back).

    Pages ORT still reads fault back in from the page cache. Read-ahead stays on while it packs
    (no MADV_RANDOM here): it reads each weight from start to end.
    """
    if portable.c_call("madvise") is None or not arrays:
        return create()
    done = threading.Event()

    def drop_until_done() -> None:
        while not done.wait(_DROP_WHILE_PACKING_S):
            if may_drop is None or may_drop():
                advise(arrays, MADV_DONTNEED)

    dropper = threading.Thread(target=drop_until_done, name="quiver-drop-while-packing", daemon=True)
    dropper.start()
    try:
        return create()
    finally:
        done.set()
        dropper.join()


class PythonApiSession:
    """A session through ORT's Python API, its weights as `SessionWeights` gives them, no packing shared
    across graphs.

    Used for the first output (ORT's Python module is loaded already; its C library is not) and for
    `prepack=False`.
    """

    def __init__(
        self,
        weights: SessionWeights,
        settings: SessionSettings,
        prepack: bool,
        save_to: Path | None = None,
        profile_prefix: str | None = None,
    ) -> None:
        """`save_to`: a folder where ORT writes the graph's packed form (`packed_file`) as it makes it;
        `profile_prefix`: where ORT writes the session's per-node profile (none if None)."""
        options = ort.SessionOptions()
        options.intra_op_num_threads = settings.intra_op_num_threads
        options.graph_optimization_level = settings.ort_level
        options.log_severity_level = ort_log_severity()
        entries = _config(settings, prepack, weights.folder)
        if settings.prepack and not prepack:
            # A stand-in until the packed session is ready: its threads spin during a run (not spinning, each
            # of MiniLM's parallel operators waits for a sleeping thread: its first run 26-27 ms against 23)
            # but stop when it returns, so as to keep the packing thread's core free; and it grows no arena
            # of its own: a new arena's first chunks cost its first run ~4 ms on MiniLM (measured), and the
            # stand-in runs only a few times (where the env's shared arena is used, it takes its memory from
            # there).
            entries["session.force_spinning_stop"] = "1"
            options.enable_cpu_mem_arena = False
        if save_to is not None:
            # made only to write the form, then dropped: its packed copy must go back to the system with it,
            # so no arena (the env's never shrinks) holds it
            options.optimized_model_filepath = str(save_to / packed_file.MODEL)
            options.enable_cpu_mem_arena = False
            entries |= packed_file.save_entries()
        elif _shared_arena():  # ORT's env arena, shared with the other sessions (the stand-in's first chunks too)
            entries["session.use_env_allocators"] = "1"
        # a run may ask ORT's arena to shrink only where there is one (ORT fails the run otherwise)
        self._shrinking: ort.RunOptions | None = None
        if options.enable_cpu_mem_arena or entries.get("session.use_env_allocators") == "1":
            self._shrinking = ort.RunOptions()
            self._shrinking.add_run_config_entry(*capi.SHRINK_ARENA)
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        if profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        self._values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in weights.shared.items()}
        for name, value in self._values.items():
            options.add_initializer(name, value)
        self._readable = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in weights.readable.items()}
        if self._readable:
            options.add_external_initializers(list(self._readable), list(self._readable.values()))
        if global_thread_pools_in_use():
            options.use_per_session_threads = False
        register_python(options, weights.model)
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
        shrink_arena: bool = False,
    ) -> list[np.ndarray]:
        """`shrink_arena`: ORT's arena (if the session has one) gives back what this run's intermediate
        values took."""
        options = self._shrinking if shrink_arena else None
        if not out:
            return list(self._session.run(output_names, {**bound, **feeds}, options))
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
        self._session.run_with_iobinding(binding, options)
        # in the order bound: output_names; the caller's buffers already hold theirs (copy_outputs_to_cpu
        # would copy every output, a whole KV cache included)
        values = binding.get_outputs()
        return [out[name] if name in out else value.numpy() for name, value in zip(output_names, values)]

    def end_profiling(self) -> str:
        return str(self._session.end_profiling())


AnySession = capi_session.Session | PythonApiSession


def _config(settings: SessionSettings, prepack: bool, folder: str = PLACEHOLDER_FOLDER) -> dict[str, str]:
    return {"session.model_external_initializers_file_folder_path": folder, **settings.config(prepack)}


def create_session(
    graph: FinalizedGraph,
    weights: SessionWeights,
    settings: SessionSettings,
    container: Callable[[], capi_session.PrepackedWeights],
    packed: bool,
    profile_prefix: str | None = None,
    shareable: bool = True,
    c_api_only: bool = False,
) -> AnySession:
    """A packed session shares the context's container (C API); an unpacked one comes from the Python API.

    Both are made at the same optimization level: ORT's fusions change results (QDQ fusions compute in
    integers), and the first output must equal every later one. `c_api_only`: graphs exchanging float8
    or 4-bit tensors, which ORT's Python API cannot pass. `container` gives the context's container (made
    on first use: it loads ORT's C library, which an unpacked session does without); `profile_prefix`:
    profiled sessions, made through the Python API.
    """
    with capi.fork_waits():  # a fork never finds ORT halfway through making a session
        try:
            if (packed or c_api_only) and shareable and profile_prefix is None:
                try:
                    return capi_session.Session(
                        weights.model,
                        weights.shared,
                        weights.readable,
                        container(),
                        _config(settings, prepack=packed, folder=weights.folder),
                        settings.intra_op_num_threads,
                        int(settings.ort_level),
                        per_session_threads=not global_thread_pools_in_use(),
                        log_severity=ort_log_severity(),
                    )
                except capi.CApiUnavailableError:
                    if c_api_only:
                        raise BackendError(
                            f"graph {graph.name!r} exchanges float8 or 4-bit tensors, which only ORT's C API can pass, "
                            "and this ONNX Runtime does not offer the functions Quiver needs"
                        ) from None
                    # no shared packing on this install: each graph packs its own copy
            return PythonApiSession(weights, settings, packed, profile_prefix=profile_prefix)
        except Exception as exc:
            raise BackendError(f"cpu backend (ONNX Runtime) cannot prepare graph {graph.name!r}: {exc}") from None

"""A graph's executable on the cpu backend: its sessions, the packed one swapped in, its runs."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

import numpy as np

from quiver import portable
from quiver.backends.base import FinalizedGraph
from quiver.backends.cpu import capi, capi_session, packed_file, sessions
from quiver.backends.cpu.memory import drop_resident_pages
from quiver.backends.cpu.native_ops import uses_native_ops
from quiver.backends.cpu.prepared import open_level, source_digest, usable_form
from quiver.backends.cpu.session_model import (
    SHARED_INTEGER_PACKING,
    has_integer_matmuls,
    packable_weights,
    packed_block_weights,
    packing_changes_results,
    session_model,
)
from quiver.backends.cpu.sessions import AnySession, PythonApiSession, packing_while_dropping
from quiver.backends.cpu.settings import SessionSettings
from quiver.backends.cpu.weights import SessionWeights
from quiver.errors import BackendError
from quiver.ort_process import global_thread_pools_in_use

_C_API_ONLY_IO = {"bfloat16", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz", "int4", "uint4"}
_NOTHING: Mapping[str, np.ndarray] = MappingProxyType({})
_REDROP_EVERY = 256  # runs between two drops of packed weights' mapped pages (0.7 ms for SmolLM2-135M)
PACKING_THREAD = "quiver-prepack"  # the thread that makes a packed session in the background
# A background packing waits for a quiet moment (no run for QUIET_BEFORE_PACKING_S), or at most
# LONGEST_WAIT_FOR_QUIET_S after the first output: packing beside runs takes a core and the memory bus from
# them (a 1B float dialog's first answer took 1.2 s instead of 0.7 with its packing started at once).
QUIET_BEFORE_PACKING_S = 0.2
LONGEST_WAIT_FOR_QUIET_S = 2.0
_POLL_FOR_QUIET_S = 0.05  # how often the waiting thread looks again (the program may end meanwhile)


def packing_in_background() -> bool:
    """Whether a packed session is still being made in the background (which exit would wait for)."""
    return any(thread.name == PACKING_THREAD and thread.is_alive() for thread in threading.enumerate())


class Maker(Protocol):
    """What an executable asks of the backend that made it (`backend.CpuBackend`)."""

    lazy_prepack: bool
    packed_weights: Path | None
    profile_prefix: str | None
    profiles: list[str]

    def settings_for(self, graph: FinalizedGraph) -> SessionSettings: ...

    def container(self) -> capi_session.PrepackedWeights: ...


def _ort_failure(exc: Exception) -> BackendError:
    """What a failed run raises: Quiver's own errors as they are, ORT's (plain exceptions) as a BackendError."""
    return exc if isinstance(exc, BackendError) else BackendError(f"cpu backend (ONNX Runtime) failed: {exc}")


_Form = tuple[FinalizedGraph, SessionSettings]  # a graph (its model: the session model) and how its sessions are made


def _in_prepared_form(graph: FinalizedGraph, data: bytes, settings: SessionSettings) -> _Form | None:
    """The graph as its prepared form for this ORT, made at build from this same session model (`data`)."""
    if not graph.prepared:
        return None
    form = usable_form(graph, source_digest(data, settings.accuracy_level), settings.ort_level)
    if form is None:
        return None
    model = form.model()
    level = open_level(model, settings.graph_optimization_level)
    prepared = dataclasses.replace(graph, model=model, weights=form.weights)
    return prepared, dataclasses.replace(settings, graph_optimization_level=level)


class CpuExecutable:
    """A graph prepared by the cpu backend: its session, and the packed one that replaces an unpacked
    stand-in in the background after the first output (lazy prepacking)."""

    def __init__(self, graph: FinalizedGraph, backend: Maker) -> None:
        self.settings = settings = backend.settings_for(graph)
        model, self._strengths = session_model(graph, settings)
        integer_ops = has_integer_matmuls(model)
        integer_matmuls = settings.accuracy_level > 0 and integer_ops
        data = model.SerializeToString()
        portable_form = dataclasses.replace(graph, model=model), settings
        prepared = _in_prepared_form(graph, data, settings)
        self._backend = backend
        self._output_names = [o.name for o in graph.outputs]
        self._upgrade: threading.Thread | None = None
        self._upgrade_lock = threading.Lock()  # one packing thread, started once, joined only once started
        self._released = False
        self._holders = 1  # graphs this executable serves (`share`): released when the last lets go
        self._last_run = 0.0  # when a run last returned (time.monotonic()): packing waits for quiet
        # runs under way: packing waits for them too (a 1B float prompt's run takes longer than the quiet
        # it waits for, and packing beside it let its pages go while it read them)
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        io_types = {t.dtype for t in (*graph.inputs, *graph.outputs)}
        # float8 and 4-bit tensors pass only through the C API (one session, packed from the start);
        # strings only through the Python API (its sessions)
        self._c_api_only = bool(io_types & _C_API_ONLY_IO) and "string" not in io_types
        stand_in_differs = integer_matmuls or packing_changes_results(model)
        # Quiver's kernels and nothing ORT would pack (4-bit blocks read in place): an unpacked stand-in would
        # only be made again, its runs meanwhile on idle threads and the Python API (SmolLM2 int4 decoding at
        # 88 tok/s instead of 150); not under global thread pools, which only the Python API's env has
        nothing_packed = (
            uses_native_ops(model)
            and not packable_weights(graph)
            and not packed_block_weights(graph)
            and not global_thread_pools_in_use()
        )
        lazy = backend.lazy_prepack and not (stand_in_differs or self._c_api_only or nothing_packed)
        packed_first = settings.prepack and not lazy
        self.is_packed = packed_first
        # whatever the accuracy level: before 1.32 no MatMulNBits kernel can keep packed weights in a container
        self._shareable = (SHARED_INTEGER_PACKING or not integer_ops) and "string" not in io_types
        self.prepared = prepared is not None  # sessions come from the context's prepared form (`prepared`)
        self._use(*(prepared or portable_form))
        self.packed_file: Path | None = None  # the packed form sessions come from (`packed_file`), if any
        if backend.packed_weights is not None and self._packs_into_file():
            self._from_packed_file(backend.packed_weights)
        try:
            self._session: AnySession | None = self._create_first()
        except BackendError:
            if prepared is None and self.packed_file is None:
                raise
            # a form this ORT refuses after all: the portable skeleton, packed by this process, as before
            self.prepared, self.packed_file, self.is_packed = False, None, packed_first
            self._use(*portable_form)
            self._session = self._create_first()
        self._upgrade_pending = settings.prepack and not self.is_packed
        self._runs_since_drop = 0
        if self.is_packed:
            drop_resident_pages(self._droppable)
            self._forget_sources()
            # what ORT read in and let go while making the session (weights it packed, or read before it
            # found their packed form in a file) stays in the heap without it: 34 MB of a SmolLM2 server's
            # private memory, measured
            portable.return_freed_memory()

    def _use(self, graph: FinalizedGraph, settings: SessionSettings) -> None:
        """Sessions are made from this form of the graph, with `settings`."""
        self._graph = graph
        self._session_settings = settings
        # Only pages of a file mapping can be dropped: private memory would lose its contents.
        self._packable = packable_weights(graph) if self.settings.prepack else []
        packed_blocks = packed_block_weights(graph) if self.settings.prepack else []
        self._droppable = self._packable + packed_blocks if graph.file_backed else []
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
        key = packed_file.form_key(
            weights.model, mapping.identity, settings.config(prepack=True), int(settings.ort_level)
        )

        def make(staging: Path) -> None:
            try:
                with capi.fork_waits():
                    PythonApiSession(
                        weights, settings, prepack=True, save_to=staging, profile_prefix=self._backend.profile_prefix
                    )
            except Exception as exc:
                raise packed_file.FormNotMadeError(f"ORT did not write the packed form: {exc}") from None
            finally:
                portable.return_freed_memory()  # the writing session's packed copy, gone with it

        try:
            form = packed_file.open_or_make(folder, key, make)
        except packed_file.FormNotMadeError:
            return  # this graph packs in this process, as without a folder
        drop_resident_pages(self._droppable)  # what making the form read: nothing reads it from here on
        self._weights = SessionWeights(form.model, {}, {}, str(form.folder), None)
        self._droppable, self._prepacked = [], 0  # nothing packed is private
        self.is_packed, self.packed_file = True, form.folder

    def _forget_sources(self) -> None:
        """Once the packed session runs, no session is made again from this executable (a forked child makes
        new executables): the skeleton's bytes and parsed copy would only hold memory (~0.3 MB for MiniLM)."""
        self._graph = self._weights = None  # type: ignore[assignment]

    def _create(self, packed: bool) -> AnySession:
        def create(weights: SessionWeights) -> AnySession:
            return sessions.create_session(
                self._graph,
                weights,
                self._session_settings,
                self._backend.container,
                packed=packed,
                profile_prefix=self._backend.profile_prefix,
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

    def _create_first(self) -> AnySession:
        if not self.is_packed:
            return self._create(packed=False)
        # Packed from the start, nothing else of this graph reads the mapped weights meanwhile: let them
        # go as they are packed. (A stand-in's runs would fault them back in on every run.)
        return packing_while_dropping(self._droppable, lambda: self._create(packed=True))

    def _build_packed_session(self) -> None:
        # Hand the interpreter back first: the run that started this thread returns its output now,
        # instead of waiting for this thread to give way (~0.7 ms measured, loading ORT's C library).
        time.sleep(0)
        deadline = time.monotonic() + LONGEST_WAIT_FOR_QUIET_S
        while self._wanted() and (wait := min(self._until_quiet(), deadline - time.monotonic())) > 0:
            time.sleep(min(wait, _POLL_FOR_QUIET_S))
        if not self._wanted():
            return
        try:
            # the mapped originals let go as they are packed, or the process would hold both copies of every
            # weight at its peak (SmolLM2 fp32: 1.10 GB against 0.70), but only while no run reads them (each
            # would fault every page back in from the page cache: +0.25 s a step for a 1B float model)
            quiet = lambda: self._until_quiet() <= 0  # noqa: E731
            packed = packing_while_dropping(self._droppable, lambda: self._create(packed=True), quiet)
        except BackendError:
            return  # keep the unpacked session: slower, but correct
        with self._upgrade_lock:
            if self._released:
                return  # released while packing: the packed session goes with this thread
            stand_in, self._session = self._session, packed  # runs in flight keep the old session
            self.is_packed = True
        drop_resident_pages(self._droppable)
        self._forget_sources()
        with capi.fork_waits():  # nor halfway through dropping one
            del stand_in
        portable.return_freed_memory()  # what the stand-in session freed would stay in RSS without it

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        release_scratch: bool = False,
    ) -> list[np.ndarray]:
        session = self._session
        if session is None:
            raise BackendError("this executable was released; prepare the graph again")
        bound = _NOTHING if bound is None else bound  # the same object run after run: sessions key on it
        if self._strengths is not None:
            feeds, bound = self._strengths.apply(feeds, bound)
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            outputs = session.run(self._output_names, feeds, bound, _NOTHING if out is None else out, release_scratch)
        except Exception as exc:
            raise _ort_failure(exc) from None
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1
            self._last_run = time.monotonic()
        if release_scratch:
            # ORT's arena gives its regions to malloc, and glibc keeps them in the heap (its mmap threshold
            # rises with each large free): without a trim, runs that shrink the arena grew a server by ~20 MB
            portable.return_freed_memory()
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
            drop_resident_pages(self._droppable)

    def repeater(
        self,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray] | None,
        out: Mapping[str, np.ndarray],
    ) -> Callable[[], None]:
        """`run(feeds, bound, out)` again and again, the feeds' values rewritten in place between runs and
        nothing else changed (a generation's decode steps): through the C API session, its arrays built
        once (`capi_session.Session.repeater`); otherwise runs as `run` does."""
        session = self._session
        if isinstance(session, capi_session.Session) and not self._upgrade_pending:
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

    def _wanted(self) -> bool:
        """Whether a packed session is still wanted: not once released, nor once the program's main thread
        has ended (the interpreter is exiting: it would wait for the packing to finish before it could)."""
        return not self._released and threading.main_thread().is_alive()

    def _until_quiet(self) -> float:
        """Seconds until the graph has not run for QUIET_BEFORE_PACKING_S (0 or less: quiet now); a run under
        way counts as running now."""
        if self._in_flight:
            return QUIET_BEFORE_PACKING_S
        return QUIET_BEFORE_PACKING_S - (time.monotonic() - self._last_run)

    def _start_upgrade(self) -> None:
        with self._upgrade_lock:
            if not self._upgrade_pending or self._released:
                return
            self._upgrade_pending = False
            # Not a daemon: at exit the interpreter waits for it rather than tearing ORT down mid-session.
            upgrade = threading.Thread(target=self._build_packed_session, name=PACKING_THREAD)
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

    def share(self) -> CpuExecutable | None:
        """This executable for one more graph (the same body at other fixed input sizes), held until every
        graph it serves has released it; None once released."""
        with self._upgrade_lock:
            if self._released:
                return None
            self._holders += 1
            return self

    def release(self) -> None:
        """Drops the session at once (when the last graph it serves lets go): a packing thread still at
        work finishes on its own and discards what it made (closing a context never waits for background
        packing)."""
        with self._upgrade_lock:
            self._holders -= 1
            if self._holders > 0 or self._released:
                return
            self._upgrade_pending = False  # no packing starts after this
            self._released = True
            session, self._session = self._session, None
        if self._backend.profile_prefix is not None and isinstance(session, PythonApiSession):
            self._backend.profiles.append(session.end_profiling())  # profiling sessions are packed eagerly
        with capi.fork_waits():  # dropped here unless a run in flight still holds it
            del session

"""A small ctypes binding of ONNX Runtime's C API: sessions that share one prepacked-weights container.

ORT's Python API cannot pass an `OrtPrepackedWeightsContainer`, which is what lets sessions share the
repacked (MatMul/Gemm) copies of initializers they share through `AddInitializer`: ORT keys the
container by the packed bytes' hash, so a weight shared by N graphs is packed once, not N times.
The wheel ships `libonnxruntime.so` with the C API; function-table indices are ORT's ABI (append-only).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quiver import portable
from quiver.backends.fork_gate import ForkGate
from quiver.errors import BackendError, ConversionError
from quiver.ir import dtypes
from quiver.ir.nibbles import pack_nibbles, unpack_nibbles
from quiver.ort_package import onnxruntime

_API_VERSION = 20  # ORT >= 1.20; every function used here predates it

# Indices into `struct OrtApi` (onnxruntime_c_api.h); stable across releases.
_CREATE_STATUS, _GET_ERROR_MESSAGE = 0, 2
_CREATE_ENV, _RUN, _CREATE_SESSION_OPTIONS = 3, 9, 10
_SET_SESSION_LOG_SEVERITY_LEVEL, _SET_GRAPH_OPTIMIZATION_LEVEL, _SET_INTRA_OP_NUM_THREADS = 22, 23, 24
_CREATE_TENSOR_WITH_DATA, _GET_TENSOR_MUTABLE_DATA = 49, 51
_GET_TENSOR_ELEMENT_TYPE, _GET_DIMENSIONS_COUNT, _GET_DIMENSIONS = 60, 61, 62
_GET_TENSOR_TYPE_AND_SHAPE, _CREATE_CPU_MEMORY_INFO = 65, 69
_RELEASE_STATUS, _RELEASE_SESSION, _RELEASE_VALUE = 93, 95, 96
_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, _RELEASE_SESSION_OPTIONS = 99, 100
_DISABLE_PER_SESSION_THREADS, _ADD_SESSION_CONFIG_ENTRY, _CREATE_AND_REGISTER_ALLOCATOR = 120, 130, 144
_ADD_INITIALIZER = 150
_CREATE_PREPACKED_CONTAINER, _RELEASE_PREPACKED_CONTAINER = 166, 167
_CREATE_SESSION_FROM_ARRAY_WITH_CONTAINER = 169
_ADD_EXTERNAL_INITIALIZERS = 210

_LOG_FATAL = 4
_BOUND_WRAPPERS = 8192
_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_STATUS = ctypes.c_void_p

# ONNX element type numbers <-> numpy, from the one table (ir.dtypes); strings do not pass through here.
# Filled as types are met: the ml_dtypes ones (bfloat16, float8, 4-bit) import ml_dtypes (~10 ms), which a
# process that never meets them never pays for.
# 4-bit types: numpy (ml_dtypes) holds one value per byte, ORT two per byte, low nibble first.
_NIBBLE_TYPES = frozenset({dtypes.ElementType.UINT4, dtypes.ElementType.INT4})
_ELEMENT_TYPES: dict[int, type] = {}
_BY_DTYPE: dict[np.dtype, int | None] = {}


def _numpy_type(number: int) -> type:
    found = _ELEMENT_TYPES.get(number)
    if found is None:
        try:
            name = dtypes.io_name_of_onnx(number)
        except ConversionError:
            name = "string"
        if name == "string":
            raise BackendError(f"the cpu backend cannot return ONNX element type {dtypes.type_name(number)}")
        found = _ELEMENT_TYPES[number] = dtypes.numpy_of(name).type
    return found


def _element_type(dtype: np.dtype) -> int | None:
    if dtype not in _BY_DTYPE:
        _BY_DTYPE[dtype] = dtypes.onnx_of_numpy(dtype)
    return _BY_DTYPE[dtype]


def _packed_nibbles(array: np.ndarray) -> np.ndarray:
    """4-bit values (one per byte, ml_dtypes) packed two per byte, as ORT stores INT4/UINT4."""
    values = array.reshape(-1).view(np.uint8)
    return pack_nibbles(np.append(values, np.uint8(0)) if values.size % 2 else values)


class CApiUnavailableError(BackendError):
    """ONNX Runtime's C library cannot be used here; callers fall back to the Python API."""


def _library_path() -> Path:
    folder = Path(onnxruntime.__file__).parent / "capi"
    candidates = sorted(folder.glob("libonnxruntime.so*")) + sorted(folder.glob("libonnxruntime*.dylib"))
    if not candidates:
        raise CApiUnavailableError(f"ONNX Runtime's C library is not in {folder}")
    return candidates[0]


class _Api:
    """The OrtApi function table, with the signatures Quiver uses."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL(str(_library_path()))
        except OSError as exc:
            raise CApiUnavailableError(f"cannot load ONNX Runtime's C library: {exc}") from None
        lib.OrtGetApiBase.restype = ctypes.POINTER(_P * 2)
        base = lib.OrtGetApiBase().contents
        get_api = ctypes.CFUNCTYPE(_P, ctypes.c_uint32)(base[0])
        table = get_api(_API_VERSION)
        if not table:
            raise CApiUnavailableError(f"ONNX Runtime's C library does not offer API version {_API_VERSION}")
        self._table = ctypes.cast(table, ctypes.POINTER(_P * 211)).contents
        self._lib = lib

        def fn(index: int, restype: Any, *argtypes: Any) -> Any:
            return ctypes.CFUNCTYPE(restype, *argtypes)(self._table[index] or 0)

        self.CreateStatus = fn(_CREATE_STATUS, _STATUS, ctypes.c_int, ctypes.c_char_p)
        self.GetErrorMessage = fn(_GET_ERROR_MESSAGE, ctypes.c_char_p, _STATUS)
        self.ReleaseStatus = fn(_RELEASE_STATUS, None, _STATUS)
        self.CreateEnv = fn(_CREATE_ENV, _STATUS, ctypes.c_int, ctypes.c_char_p, _PP)
        self.CreateSessionOptions = fn(_CREATE_SESSION_OPTIONS, _STATUS, _PP)
        self.ReleaseSessionOptions = fn(_RELEASE_SESSION_OPTIONS, None, _P)
        self.SetGraphOptimizationLevel = fn(_SET_GRAPH_OPTIMIZATION_LEVEL, _STATUS, _P, ctypes.c_int)
        self.SetSessionLogSeverityLevel = fn(_SET_SESSION_LOG_SEVERITY_LEVEL, _STATUS, _P, ctypes.c_int)
        self.SetIntraOpNumThreads = fn(_SET_INTRA_OP_NUM_THREADS, _STATUS, _P, ctypes.c_int)
        self.DisablePerSessionThreads = fn(_DISABLE_PER_SESSION_THREADS, _STATUS, _P)
        self.AddSessionConfigEntry = fn(_ADD_SESSION_CONFIG_ENTRY, _STATUS, _P, ctypes.c_char_p, ctypes.c_char_p)
        self.AddInitializer = fn(_ADD_INITIALIZER, _STATUS, _P, ctypes.c_char_p, _P)
        self.AddExternalInitializers = fn(
            _ADD_EXTERNAL_INITIALIZERS, _STATUS, _P, ctypes.POINTER(ctypes.c_char_p), _PP, ctypes.c_size_t
        )
        self.CreatePrepackedWeightsContainer = fn(_CREATE_PREPACKED_CONTAINER, _STATUS, _PP)
        self.ReleasePrepackedWeightsContainer = fn(_RELEASE_PREPACKED_CONTAINER, None, _P)
        self.CreateSessionFromArrayWithContainer = fn(
            _CREATE_SESSION_FROM_ARRAY_WITH_CONTAINER, _STATUS, _P, ctypes.c_char_p, ctypes.c_size_t, _P, _P, _PP
        )
        self.ReleaseSession = fn(_RELEASE_SESSION, None, _P)
        self.CreateCpuMemoryInfo = fn(_CREATE_CPU_MEMORY_INFO, _STATUS, ctypes.c_int, ctypes.c_int, _PP)
        self.CreateAndRegisterAllocator = fn(_CREATE_AND_REGISTER_ALLOCATOR, _STATUS, _P, _P, _P)
        self.CreateTensorWithDataAsOrtValue = fn(
            _CREATE_TENSOR_WITH_DATA,
            _STATUS,
            _P,
            _P,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_int64),
            ctypes.c_size_t,
            ctypes.c_int,
            _PP,
        )
        self.ReleaseValue = fn(_RELEASE_VALUE, None, _P)
        self.Run = fn(
            _RUN,
            _STATUS,
            _P,
            _P,
            ctypes.POINTER(ctypes.c_char_p),
            _PP,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.c_size_t,
            _PP,
        )
        self.GetTensorTypeAndShape = fn(_GET_TENSOR_TYPE_AND_SHAPE, _STATUS, _P, _PP)
        self.ReleaseTensorTypeAndShapeInfo = fn(_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, None, _P)
        self.GetTensorElementType = fn(_GET_TENSOR_ELEMENT_TYPE, _STATUS, _P, ctypes.POINTER(ctypes.c_int))
        self.GetDimensionsCount = fn(_GET_DIMENSIONS_COUNT, _STATUS, _P, ctypes.POINTER(ctypes.c_size_t))
        self.GetDimensions = fn(_GET_DIMENSIONS, _STATUS, _P, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t)
        self.GetTensorMutableData = fn(_GET_TENSOR_MUTABLE_DATA, _STATUS, _P, _PP)
        self._self_check()
        self.env = self._out(self.CreateEnv, 3, b"quiver")  # ORT_LOGGING_LEVEL_ERROR
        self.cpu_memory = self._out(self.CreateCpuMemoryInfo, 1, 0)  # OrtArenaAllocator, OrtMemTypeDefault
        # One CPU arena in the env for every session this process makes (`session.use_env_allocators`):
        # each session growing an arena of its own held ~6 MB more per MiniLM graph after 20 runs.
        status = self.CreateAndRegisterAllocator(self.env, self.cpu_memory, None)
        registered = not status or b"already" in (self.GetErrorMessage(status) or b"")  # one env: one arena
        self._arena_process = os.getpid() if registered else None
        if status:
            self.ReleaseStatus(status)
        self._warm_up()

    def shared_arena(self) -> bool:
        """Whether sessions made now use the env's shared arena: only in the process that registered it (a
        forked child's sessions grow arenas of their own: a parent's thread may have held its lock)."""
        return self._arena_process == os.getpid()

    def _warm_up(self) -> None:
        """Makes one tiny packed session, so the library's one-time initialisation (C++ function-local
        statics: kernel registries, MLAS) happens here, under the lock fork waits for. Otherwise a
        packing thread could be inside it when the process forks, and the child would wait forever on
        the half-done initialisation (seen with ORT 1.24, whose C API is a library of its own)."""
        from quiver.ir.proto import ModelProto, TensorProto

        model = ModelProto(ir_version=8)
        model.opset_import.add(domain="", version=17)
        graph = model.graph
        graph.name = "warm_up"
        graph.node.add(op_type="MatMul", input=["x", "w"], output=["y"])
        weight = graph.initializer.add(name="w", data_type=TensorProto.FLOAT, dims=[4, 4])
        weight.raw_data = bytes(64)
        for value, name in ((graph.input.add(), "x"), (graph.output.add(), "y")):
            value.name = name
            value.type.tensor_type.elem_type = TensorProto.FLOAT
            for dim in (1, 4):
                value.type.tensor_type.shape.dim.add().dim_value = dim
        data = model.SerializeToString()
        container = self._out(self.CreatePrepackedWeightsContainer)
        options = self._out(self.CreateSessionOptions)
        try:
            self.check(self.SetSessionLogSeverityLevel(options, _LOG_FATAL))
            session = self._out(self.CreateSessionFromArrayWithContainer, self.env, data, len(data), options, container)
            self.ReleaseSession(session)
        finally:
            self.ReleaseSessionOptions(options)
            self.ReleasePrepackedWeightsContainer(container)

    def _self_check(self) -> None:
        """A wrong table index would call the wrong function; prove two of them before trusting any."""
        status = self.CreateStatus(2, b"quiver-self-check")
        try:
            if self.GetErrorMessage(status) != b"quiver-self-check":
                raise CApiUnavailableError("ONNX Runtime's C API table is not laid out as expected")
        finally:
            self.ReleaseStatus(status)

    def check(self, status: int | None) -> None:
        if status:
            message = (self.GetErrorMessage(status) or b"").decode(errors="replace")
            self.ReleaseStatus(status)
            raise BackendError(f"ONNX Runtime: {message}")

    def _out(self, function: Any, *args: object) -> int:
        out = _P()
        self.check(function(*args, ctypes.byref(out)))
        return int(out.value or 0)


_API: _Api | None = None
_API_LOCK = threading.Lock()
# Sessions are made and dropped inside it (`fork_waits()`): a fork waits for them (see fork_gate).
_SESSION_WORK = ForkGate()
fork_waits = _SESSION_WORK.passing


def _before_fork() -> None:
    # The gate first: work inside it may still need the API lock.
    _SESSION_WORK.close()
    # Held across fork: a child never inherits it taken by a thread it does not have (a packing thread
    # loading the library), and it sees the API either whole or not loaded.
    _API_LOCK.acquire()


def _after_fork_in_parent() -> None:
    _API_LOCK.release()
    _SESSION_WORK.reopen()


def _after_fork_in_child() -> None:
    _API_LOCK.release()
    _SESSION_WORK.reopen_in_child()


portable.at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def api() -> _Api:
    global _API
    with _API_LOCK:
        if _API is None:
            _API = _Api()
        return _API


class PrepackedWeights:
    """One container per context: the packed copies of shared weights, made once for all its graphs."""

    def __init__(self) -> None:
        self._api = api()
        self.handle = self._api._out(self._api.CreatePrepackedWeightsContainer)

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._api.ReleasePrepackedWeightsContainer(self.handle)
            self.handle = 0


class _Tensor:
    """An OrtValue over a numpy array's memory (no copy); keeps the array alive."""

    def __init__(self, array: np.ndarray) -> None:
        self._api = api()
        self.array = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        self.shape = array.shape
        element = _element_type(self.array.dtype)
        if element is None:
            raise BackendError(f"the cpu backend does not exchange {self.array.dtype} tensors")
        shape = (ctypes.c_int64 * self.array.ndim)(*self.array.shape)
        data = _packed_nibbles(self.array) if element in _NIBBLE_TYPES else self.array
        self._data = data  # what the OrtValue points at: must outlive it
        self.handle = self._api._out(
            self._api.CreateTensorWithDataAsOrtValue,
            self._api.cpu_memory,
            data.__array_interface__["data"][0] if data.nbytes else 1,  # (ndarray.ctypes is slow to make)
            data.nbytes,
            shape,
            self.array.ndim,
            element,
        )

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._api.ReleaseValue(self.handle)
            self.handle = 0


def _to_numpy(value: int) -> np.ndarray:
    capi = api()
    info = capi._out(capi.GetTensorTypeAndShape, value)
    try:
        element, count = ctypes.c_int(), ctypes.c_size_t()
        capi.check(capi.GetTensorElementType(info, ctypes.byref(element)))
        capi.check(capi.GetDimensionsCount(info, ctypes.byref(count)))
        dims = (ctypes.c_int64 * count.value)()
        capi.check(capi.GetDimensions(info, dims, count.value))
    finally:
        capi.ReleaseTensorTypeAndShapeInfo(info)
    if element.value in _NIBBLE_TYPES:
        values = int(np.prod(tuple(dims), dtype=np.int64))
        packed = np.empty((values + 1) // 2, np.uint8)
        if packed.nbytes:
            ctypes.memmove(packed.ctypes.data, capi._out(capi.GetTensorMutableData, value), packed.nbytes)
        signed = element.value == dtypes.ElementType.INT4
        return unpack_nibbles(packed, values, signed).astype(_numpy_type(element.value)).reshape(tuple(dims))
    result: np.ndarray = np.empty(tuple(dims), dtype=_numpy_type(element.value))
    if result.nbytes:
        data = capi._out(capi.GetTensorMutableData, value)
        ctypes.memmove(result.ctypes.data, data, result.nbytes)
    return result


@dataclasses.dataclass(frozen=True)
class _RunPlan:
    """The C arrays of one kind of run: names, the handles of everything but the fresh feeds, outputs."""

    out: Mapping[str, np.ndarray]  # the output buffers it was made for (kept alive: ids stay theirs)
    out_names: tuple[str, ...]
    out_ids: tuple[int, ...]
    output_key: tuple[str, ...]
    feed_names: tuple[str, ...]
    in_place: list[tuple[int, int]]  # (position among the feeds, id of the output buffer fed there)
    listed: tuple[Mapping[str, np.ndarray], list[bytes], list[_Tensor]]  # the bound values listed
    keep: list[_Tensor]  # the output buffers' OrtValues, alive while the plan is
    count: int
    names: Any
    inputs: Any
    fresh: list[str]  # feeds that are not output buffers, at these positions of `inputs`
    fresh_positions: list[int]
    wrapped: list[_Tensor | None]  # the last OrtValue made for each of them
    output_names: Any
    outputs: Any
    results: list[np.ndarray] | None  # a run's results when every output has a buffer: those buffers


class Session:
    """An ORT session made through the C API, its shared weights bound by AddInitializer and packed once."""

    def __init__(
        self,
        model: bytes,
        weights: Mapping[str, np.ndarray],
        readable: Mapping[str, np.ndarray],
        container: PrepackedWeights,
        config: Mapping[str, str],
        intra_op_num_threads: int,
        optimization_level: int,
        per_session_threads: bool = True,
        log_severity: int = _LOG_FATAL,
    ) -> None:
        self._api = capi = api()
        self._container = container  # must outlive the session
        self._weights = {name: _Tensor(array) for name, array in weights.items()}  # must outlive the session
        # OrtValues of bound arrays by identity (each wrapper keeps its array alive, so an id is never
        # reused while listed): switching back to a section applied before wraps nothing again
        self._bound: OrderedDict[int, _Tensor] = OrderedDict()
        self._bound_lock = threading.Lock()  # runs on several threads share the cache
        self._outputs: dict[str, _Tensor] = {}
        self._plan: _RunPlan | None = None
        # (feeds, bound, out, output names, plan) of the last run: a bound run (`runtime.bound_run`)
        # passes the very same dicts every time, never changed, and finds its plan without comparing
        # a KV cache's sixty-odd names and ids per step
        self._last_run: tuple[object, object, object, object, _RunPlan] | None = None
        # (the bound dict last run, its encoded names, its wrappers): a caller that passes the same dict
        # again (strength folding does, until something changes) skips re-listing dozens of inputs. The
        # wrappers, not bare handles: a run in flight keeps them alive while another run replaces them.
        self._bound_list: tuple[Mapping[str, np.ndarray], list[bytes], list[_Tensor]] | None = None
        options = capi._out(capi.CreateSessionOptions)
        try:
            capi.check(capi.SetIntraOpNumThreads(options, intra_op_num_threads))
            if not per_session_threads:  # the process's global pools (which the env must have)
                capi.check(capi.DisablePerSessionThreads(options))
            capi.check(capi.SetGraphOptimizationLevel(options, optimization_level))
            # fatal by default: a failing run raises with ORT's message; ORT need not also print it
            capi.check(capi.SetSessionLogSeverityLevel(options, log_severity))
            entries = {**config, "session.use_env_allocators": "1"} if capi.shared_arena() else config
            for key, value in entries.items():
                capi.check(capi.AddSessionConfigEntry(options, key.encode(), value.encode()))
            for name, tensor in self._weights.items():
                capi.check(capi.AddInitializer(options, name.encode(), tensor.handle))
            # weights with no file to be read from: placed in the graph before it optimizes (ORT copies them)
            self._readable = {name: _Tensor(array) for name, array in readable.items()}  # must outlive the session
            if self._readable:
                capi.check(
                    capi.AddExternalInitializers(
                        options,
                        (ctypes.c_char_p * len(self._readable))(*(n.encode() for n in self._readable)),
                        (_P * len(self._readable))(*(t.handle for t in self._readable.values())),
                        len(self._readable),
                    )
                )
            self.handle = capi._out(
                capi.CreateSessionFromArrayWithContainer, capi.env, model, len(model), options, container.handle
            )
        finally:
            capi.ReleaseSessionOptions(options)

    def _bound_tensor(self, array: np.ndarray) -> _Tensor:
        """The OrtValue made for this very array object before, or a new one (which is kept).

        Wrapping costs a few ctypes calls per tensor: with hundreds of LoRA tensors, a noticeable part
        of the first run after a switch. The oldest wrappers go once there are many more than one
        run's worth (a few sections' tensors stay wrapped).
        """
        with self._bound_lock:
            tensor = self._bound.get(id(array))
            if tensor is not None and tensor.array is array:
                self._bound.move_to_end(id(array))
                return tensor
        tensor = _Tensor(array)
        with self._bound_lock:
            self._bound[id(array)] = tensor
            while len(self._bound) > _BOUND_WRAPPERS:
                self._bound.popitem(last=False)
        return tensor

    def run(
        self,
        output_names: Sequence[str],
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
    ) -> list[np.ndarray]:
        capi = self._api
        last = self._last_run
        if last is not None and last[0] is feeds and last[1] is bound and last[2] is out and last[3] is output_names:
            plan = last[4]
        else:
            plan = self._plan_for(tuple(output_names), feeds, bound, out)
            self._last_run = (feeds, bound, out, output_names, plan)
        # per run: copies of the planned arrays (runs on several threads share the plan), with the
        # handles of feeds that are not output buffers filled in; such a feed given as the same array
        # object as last run (a caller's persistent token buffer) keeps its OrtValue: it wraps the
        # array's memory, not a copy of its values
        inputs = (_P * plan.count)()
        ctypes.memmove(inputs, plan.inputs, ctypes.sizeof(inputs))
        fed = []
        for slot, (name, position) in enumerate(zip(plan.fresh, plan.fresh_positions)):
            array = feeds[name]
            tensor = plan.wrapped[slot]
            if tensor is None or tensor.array is not array or tensor.shape != array.shape:
                tensor = plan.wrapped[slot] = _Tensor(np.asarray(array))
            fed.append(tensor)
            inputs[position] = tensor.handle
        outputs = (_P * len(output_names))()
        ctypes.memmove(outputs, plan.outputs, ctypes.sizeof(outputs))
        capi.check(
            capi.Run(self.handle, None, plan.names, inputs, plan.count, plan.output_names, len(outputs), outputs)
        )
        if plan.results is not None:
            return list(plan.results)
        results = []
        for name, value in zip(output_names, outputs):
            if name in out:
                results.append(out[name])
            else:
                try:
                    results.append(_to_numpy(int(value or 0)))
                finally:
                    if value:
                        capi.ReleaseValue(value)
        return results

    def repeater(
        self,
        output_names: Sequence[str],
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
    ) -> Callable[[], None] | None:
        """`run` of these very arrays again and again, their values rewritten in place between runs (a
        generation's decode steps): the C arrays are built once, private to the caller, who runs it from
        one thread at a time while the session lives. None where an output has no buffer.

        A decode step's Python between two runs costs more than it seems: the run evicts it from the
        caches, so each line comes back slowly (by hand: `run`'s cost ~4 % of a 4-bit SmolLM2 step).
        """
        plan = self._plan_for(tuple(output_names), feeds, bound, out)
        if plan.results is None:
            return None
        inputs = (_P * plan.count)()
        ctypes.memmove(inputs, plan.inputs, ctypes.sizeof(inputs))
        fed = [_Tensor(np.asarray(feeds[name])) for name in plan.fresh]  # alive as long as the closure
        for tensor, position in zip(fed, plan.fresh_positions):
            inputs[position] = tensor.handle
        outputs = (_P * len(output_names))()
        ctypes.memmove(outputs, plan.outputs, ctypes.sizeof(outputs))
        capi, handle, names, count, output_keys = self._api, self.handle, plan.names, plan.count, plan.output_names
        n = len(outputs)

        # the session, its plan's wrappers and the fed arrays' live as long as the function
        def run(_keep: object = (self, plan, fed)) -> None:
            capi.check(capi.Run(handle, None, names, inputs, count, output_keys, n, outputs))

        return run

    def _plan_for(
        self,
        output_names: tuple[str, ...],
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
    ) -> _RunPlan:
        """The C arrays of a run, built once for the same feed names, bound values and output buffers
        (every step of a generation): per step only the small fresh feeds are wrapped."""
        listed = self._bound_list
        if listed is None or listed[0] is not bound:
            tensors = [self._bound_tensor(v) for v in bound.values()]
            listed = self._bound_list = (bound, [n.encode() for n in bound], tensors)
        plan = self._plan
        if (
            plan is not None
            and plan.listed is listed
            and plan.out_ids == tuple(map(id, out.values()))
            and plan.out_names == tuple(out)
            and plan.output_key == output_names
            and plan.feed_names == tuple(feeds)
        ):
            ids = tuple(map(id, feeds.values()))
            if all(ids[i] == expected for i, expected in plan.in_place):
                return plan
        buffers = {id(array) for array in out.values()}
        given = {name: self._out_tensor(name, array) for name, array in out.items()}
        by_id = {id(t.array): t for t in given.values()}
        in_place = [(i, id(array)) for i, array in enumerate(feeds.values()) if id(array) in buffers]
        names = [*listed[1], *(n.encode() for n in feeds)]
        handles: list[int | None] = [t.handle for t in listed[2]]
        fresh, positions = [], []
        for position, array in enumerate(feeds.values(), start=len(handles)):
            tensor = by_id.get(id(array))
            handles.append(tensor.handle if tensor is not None else None)
            if tensor is None:
                fresh.append(names[position].decode())
                positions.append(position)
        plan = self._plan = _RunPlan(
            out=dict(out),
            out_names=tuple(out),
            out_ids=tuple(map(id, out.values())),
            output_key=output_names,
            feed_names=tuple(feeds),
            in_place=in_place,
            listed=listed,
            keep=list(given.values()),
            count=len(names),
            names=(ctypes.c_char_p * len(names))(*names),
            inputs=(_P * len(handles))(*handles),
            fresh=fresh,
            fresh_positions=positions,
            wrapped=[None] * len(fresh),
            output_names=(ctypes.c_char_p * len(output_names))(*(n.encode() for n in output_names)),
            outputs=(_P * len(output_names))(*(given[n].handle if n in given else None for n in output_names)),
            results=[out[n] for n in output_names] if all(n in out for n in output_names) else None,
        )
        return plan

    def _out_tensor(self, name: str, array: np.ndarray) -> _Tensor:
        """The OrtValue over a caller's output buffer, kept while the same array object comes back."""
        tensor = self._outputs.get(name)
        if tensor is None or tensor.array is not array:
            tensor = self._outputs[name] = _Tensor(array)
        return tensor

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._api.ReleaseSession(self.handle)
            self.handle = 0

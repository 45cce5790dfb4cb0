"""ONNX Runtime's C library through ctypes: its function table, the fork gate, and OrtValues over numpy arrays.

ORT's Python API cannot pass an `OrtPrepackedWeightsContainer`, which is what lets sessions share the
repacked (MatMul/Gemm) copies of initializers they share through `AddInitializer`: ORT keys the
container by the packed bytes' hash, so a weight shared by N graphs is packed once, not N times
(the sessions: `capi_session`). The wheel ships `libonnxruntime.so` with the C API; function-table
indices are ORT's ABI (append-only).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from quiver import portable
from quiver.backends.cpu.fork_gate import ForkGate
from quiver.errors import BackendError, ConversionError
from quiver.ir import dtypes
from quiver.ir.nibbles import pack_nibbles, unpack_nibbles
from quiver.ort_package import onnxruntime

_API_VERSION = 20  # ORT >= 1.20; every function used here predates it

# Indices into `struct OrtApi` (onnxruntime_c_api.h); stable across releases.
_CREATE_STATUS, _GET_ERROR_MESSAGE = 0, 2
_CREATE_ENV, _RUN, _CREATE_SESSION_OPTIONS = 3, 9, 10
_CREATE_RUN_OPTIONS = 39
_SET_SESSION_LOG_SEVERITY_LEVEL, _SET_GRAPH_OPTIMIZATION_LEVEL, _SET_INTRA_OP_NUM_THREADS = 22, 23, 24
_CREATE_TENSOR_WITH_DATA, _GET_TENSOR_MUTABLE_DATA = 49, 51
_GET_TENSOR_ELEMENT_TYPE, _GET_DIMENSIONS_COUNT, _GET_DIMENSIONS = 60, 61, 62
_GET_TENSOR_TYPE_AND_SHAPE, _CREATE_CPU_MEMORY_INFO = 65, 69
_RELEASE_STATUS, _RELEASE_SESSION, _RELEASE_VALUE = 93, 95, 96
_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, _RELEASE_SESSION_OPTIONS = 99, 100
_DISABLE_PER_SESSION_THREADS, _ADD_SESSION_CONFIG_ENTRY, _CREATE_AND_REGISTER_ALLOCATOR = 120, 130, 144
_ADD_INITIALIZER = 150
_ADD_RUN_CONFIG_ENTRY, _CREATE_PREPACKED_CONTAINER, _RELEASE_PREPACKED_CONTAINER = 165, 166, 167
_CREATE_SESSION_FROM_ARRAY_WITH_CONTAINER = 169
_ADD_EXTERNAL_INITIALIZERS = 210

LOG_FATAL = 4
# ORT's run option (onnxruntime_run_options_config_keys.h): after the run, the CPU arena gives back the
# regions nothing holds any more
SHRINK_ARENA = ("memory.enable_memory_arena_shrinkage", "cpu:0")
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


class Api:
    """The OrtApi function table, with the signatures Quiver uses."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL(str(_library_path()))
        except OSError as exc:
            raise CApiUnavailableError(f"cannot load ONNX Runtime's C library: {exc}") from None
        lib.OrtGetApiBase.restype = ctypes.POINTER(_P * 2)
        base_pointer = lib.OrtGetApiBase()
        self.api_base = ctypes.cast(base_pointer, _P).value or 0  # for custom-op libraries' entry points
        base = base_pointer.contents
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
        self.CreateRunOptions = fn(_CREATE_RUN_OPTIONS, _STATUS, _PP)
        self.AddRunConfigEntry = fn(_ADD_RUN_CONFIG_ENTRY, _STATUS, _P, ctypes.c_char_p, ctypes.c_char_p)
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
        self.env = self.handle_from(self.CreateEnv, 3, b"quiver")  # ORT_LOGGING_LEVEL_ERROR
        self.cpu_memory = self.handle_from(self.CreateCpuMemoryInfo, 1, 0)  # OrtArenaAllocator, OrtMemTypeDefault
        # One CPU arena in the env for every session this process makes (`session.use_env_allocators`):
        # each session growing an arena of its own held ~6 MB more per MiniLM graph after 20 runs.
        status = self.CreateAndRegisterAllocator(self.env, self.cpu_memory, None)
        registered = not status or b"already" in (self.GetErrorMessage(status) or b"")  # one env: one arena
        self._arena_process = os.getpid() if registered else None
        if status:
            self.ReleaseStatus(status)
        # Run options read by every run that asks for them, never changed (shared by threads, and valid in
        # a forked child: plain memory), kept for the process's life
        self.shrinking_run = self.handle_from(self.CreateRunOptions)
        self.check(self.AddRunConfigEntry(self.shrinking_run, *(text.encode() for text in SHRINK_ARENA)))
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
        container = self.handle_from(self.CreatePrepackedWeightsContainer)
        options = self.handle_from(self.CreateSessionOptions)
        try:
            self.check(self.SetSessionLogSeverityLevel(options, LOG_FATAL))
            session = self.handle_from(
                self.CreateSessionFromArrayWithContainer, self.env, data, len(data), options, container
            )
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

    def handle_from(self, function: Any, *args: object) -> int:
        """Calls `function(*args, &out)` and returns the handle it wrote there (a failure status raises)."""
        out = _P()
        self.check(function(*args, ctypes.byref(out)))
        return int(out.value or 0)


_API: Api | None = None
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


def api() -> Api:
    global _API
    with _API_LOCK:
        if _API is None:
            _API = Api()
        return _API


class Tensor:
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
        self.handle = self._api.handle_from(
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


def to_numpy(value: int) -> np.ndarray:
    capi = api()
    info = capi.handle_from(capi.GetTensorTypeAndShape, value)
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
            ctypes.memmove(packed.ctypes.data, capi.handle_from(capi.GetTensorMutableData, value), packed.nbytes)
        signed = element.value == dtypes.ElementType.INT4
        return unpack_nibbles(packed, values, signed).astype(_numpy_type(element.value)).reshape(tuple(dims))
    result: np.ndarray = np.empty(tuple(dims), dtype=_numpy_type(element.value))
    if result.nbytes:
        data = capi.handle_from(capi.GetTensorMutableData, value)
        ctypes.memmove(result.ctypes.data, data, result.nbytes)
    return result

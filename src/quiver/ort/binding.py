"""`IOBinding` and OrtValue I/O over Quiver's runtime: bound buffers are used in place, never copied.

Inputs bound from numpy arrays, OrtValues or raw CPU pointers are viewed, not copied; outputs bound to
memory (an OrtValue, or a pointer) receive the results directly (`Graph.execute(out=...)`: the cpu
backend hands ORT the caller's buffer); outputs bound without memory are allocated by the run.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from quiver.ir import dtypes
from quiver.ort.errors import InvalidArgument
from quiver.ort_package import onnxruntime


class BindingTarget(Protocol):
    """What an IOBinding needs of its session (`quiver.ort.InferenceSession`, which makes bindings)."""

    def get_outputs(self) -> list[Any]: ...

    def _input_dtype(self, name: str) -> np.dtype | None: ...

    def _execute(
        self, feeds: Mapping[str, np.ndarray], run_options: Any, out: Mapping[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]: ...


_ORT_NAMES = {"float": "float32", "double": "float64"}


def _dtype_of_ort_type(type_name: str) -> np.dtype:
    """numpy dtype of ORT's 'tensor(float)'-style type names."""
    inner = type_name.removeprefix("tensor(").removesuffix(")")
    name = _ORT_NAMES.get(inner, inner)
    if name not in dtypes.IO_DTYPE_NAMES:
        raise InvalidArgument(f"OrtValues of type {type_name} are not supported")
    return dtypes.numpy_of(name)


def _view(address: int, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """An array over `address` (CPU memory someone else owns and keeps alive)."""
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count == 0:
        return np.empty(tuple(shape), dtype)
    if not address:
        raise InvalidArgument("a bound buffer's address is null")
    raw = (ctypes.c_byte * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype).reshape(tuple(shape))


def _require_cpu(device_type: object, what: str) -> None:
    if str(device_type).lower() != "cpu":
        raise InvalidArgument(f"{what} is on device {device_type!r}; quiver.ort runs on the CPU: bind CPU memory")


def array_of(value: Any, dtype: np.dtype | None = None) -> np.ndarray:
    """An input as a numpy array, as ORT takes it: an OrtValue's memory (viewed), a numpy array, or a
    Python list or scalar converted to the input's dtype."""
    if isinstance(value, onnxruntime.OrtValue):
        if value.device_name().lower() != "cpu":
            raise InvalidArgument(f"an OrtValue on {value.device_name()} cannot be read by quiver.ort; copy it to CPU")
        element = _dtype_of_ort_type(value.data_type())
        if element == np.dtype(object):
            return np.asarray(value.numpy())
        return _view(value.data_ptr(), element, value.shape())
    if isinstance(value, np.ndarray):
        return value
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"cannot convert an input of type {type(value).__name__} to {dtype}: {exc}") from None


def ortvalue_of(array: np.ndarray) -> onnxruntime.OrtValue:
    """An OrtValue over the array (ORT keeps a reference: no copy on the CPU)."""
    return onnxruntime.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


class IOBinding:
    """`onnxruntime.IOBinding` for a `quiver.ort.InferenceSession` (`session.io_binding()`)."""

    def __init__(self, session: BindingTarget) -> None:
        self._session = session
        self._inputs: dict[str, np.ndarray] = {}
        self._keep: list[object] = []  # OrtValues whose memory a binding views
        self._outputs: dict[str, np.ndarray | None] = {}  # None: allocated by the run
        self._bound_values: dict[str, onnxruntime.OrtValue] = {}
        self._results: dict[str, np.ndarray] = {}
        # outputs whose shape is known before a run: their bound buffers are written by the run itself
        self._fixed = {a.name for a in session.get_outputs() if all(isinstance(d, int) for d in a.shape or [None])}

    # --- inputs ---------------------------------------------------------------------------------------
    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        self._inputs[name] = array_of(arr_on_cpu, self._session._input_dtype(name))

    def bind_input(
        self, name: str, device_type: Any, device_id: int, element_type: Any, shape: Sequence[int], buffer_ptr: int
    ) -> None:
        _require_cpu(device_type, f"input {name!r}")
        self._inputs[name] = _view(buffer_ptr, np.dtype(element_type), shape)

    def bind_ortvalue_input(self, name: str, ortvalue: onnxruntime.OrtValue) -> None:
        self._inputs[name] = array_of(ortvalue)
        self._keep.append(ortvalue)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def synchronize_inputs(self) -> None:
        """CPU memory needs no synchronization."""

    # --- outputs --------------------------------------------------------------------------------------
    def bind_output(
        self,
        name: str,
        device_type: Any = "cpu",
        device_id: int = 0,
        element_type: Any = None,
        shape: Sequence[int] | None = None,
        buffer_ptr: int | None = None,
    ) -> None:
        _require_cpu(device_type, f"output {name!r}")
        if buffer_ptr is None:
            self._outputs[name] = None
            return
        if element_type is None or shape is None:
            raise InvalidArgument(f"output {name!r}: a bound buffer needs its element_type and shape")
        self._outputs[name] = _view(buffer_ptr, np.dtype(element_type), shape)

    def bind_ortvalue_output(self, name: str, ortvalue: onnxruntime.OrtValue) -> None:
        self._outputs[name] = array_of(ortvalue)
        self._bound_values[name] = ortvalue
        self._keep.append(ortvalue)

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._bound_values.clear()
        self._results.clear()

    def synchronize_outputs(self) -> None:
        """CPU memory needs no synchronization."""

    def get_outputs(self) -> list[onnxruntime.OrtValue]:
        """The outputs of the last run, in the order bound: the bound OrtValues themselves, or new ones."""
        return [self._bound_values.get(n) or ortvalue_of(self._result(n)) for n in self._outputs]

    def get_outputs_as_ortvaluevector(self) -> list[onnxruntime.OrtValue]:
        return self.get_outputs()

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [np.array(self._result(n)) for n in self._outputs]

    def _result(self, name: str) -> np.ndarray:
        if name not in self._results:
            raise InvalidArgument(f"output {name!r} has no value: run_with_iobinding first")
        return self._results[name]

    # --- running (InferenceSession.run_with_iobinding) -------------------------------------------------
    def run(self, run_options: Any = None) -> None:
        fixed = self._fixed  # other outputs' shapes are known only after the run: copied in, after a check
        out = {n: a for n, a in self._outputs.items() if a is not None and n in fixed}
        results = self._session._execute(self._inputs, run_options, out)
        for name, target in self._outputs.items():
            if target is not None and name not in fixed and name in results:
                if results[name].shape != target.shape or results[name].dtype != target.dtype:
                    raise InvalidArgument(
                        f"output {name!r} is {results[name].dtype} {list(results[name].shape)}; the buffer bound "
                        f"to it is {target.dtype} {list(target.shape)}"
                    )
                np.copyto(target, results[name])
                results[name] = target
        wanted = list(self._outputs) or list(results)
        missing = [n for n in wanted if n not in results]
        if missing:
            raise InvalidArgument(f"invalid output name(s) {missing}; the outputs are {list(results)}")
        if not self._outputs:  # nothing bound: ORT returns every output
            self._outputs = dict.fromkeys(results)
        self._results = {n: results[n] for n in self._outputs}


SessionIOBinding = IOBinding


def feeds_of(values: Mapping[str, Any], dtype_of: Any) -> dict[str, np.ndarray]:
    """A feed dict as ORT accepts it (arrays, OrtValues, lists, scalars) as numpy arrays. The input's
    dtype is looked up only for values that need converting: arrays, the usual feeds, pass straight on."""
    return {
        name: value
        if isinstance(value, np.ndarray)
        else array_of(value, None if isinstance(value, onnxruntime.OrtValue) else dtype_of(name))
        for name, value in values.items()
    }

"""`quiver.ort.backend`: ONNX's backend API (as `onnxruntime.backend` offers it) over `quiver.ort` sessions."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
from onnx.backend.base import Backend, BackendRep

from quiver.ort.options import RunOptions, SessionOptions
from quiver.ort.session import InferenceSession

# as onnxruntime.backend: the session and run attributes a caller may set through kwargs
_SESSION_OPTIONS = frozenset(
    {
        "enable_cpu_mem_arena",
        "enable_mem_pattern",
        "enable_mem_reuse",
        "execution_mode",
        "graph_optimization_level",
        "inter_op_num_threads",
        "intra_op_num_threads",
        "log_severity_level",
        "log_verbosity_level",
        "logid",
        "use_deterministic_compute",
    }
)
_O = TypeVar("_O")
_RUN_OPTIONS = frozenset({"log_severity_level", "log_verbosity_level", "logid", "only_execute_path_to_fetches"})


class QuiverBackendRep(BackendRep):
    """A prepared model: a `quiver.ort.InferenceSession`."""

    def __init__(self, session: InferenceSession) -> None:
        self._session = session

    def run(self, inputs: Any, **kwargs: Any) -> list[np.ndarray]:  # type: ignore[override]
        """A list of inputs in the model's order, or one input for a one-input model (ORT's rules)."""
        options = _set_allowed(RunOptions(), kwargs, _RUN_OPTIONS)
        declared = self._session.get_inputs()
        if isinstance(inputs, list):
            feeds = {arg.name: _scalar_as_array(inputs[i]) for i, arg in enumerate(declared)}
        else:
            if len(declared) != 1:
                raise RuntimeError(f"Model expect {len(declared)} inputs")
            feeds = {declared[0].name: _scalar_as_array(inputs)}
        return self._session.run(None, feeds, options)


def _set_allowed(options: _O, kwargs: dict[str, Any], allowed: frozenset[str]) -> _O:
    """As onnxruntime.backend: allowed attributes are set, other known ones are refused, unknown keys ignored."""
    for key, value in kwargs.items():
        if key in allowed:
            setattr(options, key, value)
        elif hasattr(options, key):
            raise RuntimeError(f"{type(options).__name__} attribute '{key}' is not permitted via the backend API")
    return options


def _scalar_as_array(value: Any) -> Any:
    return np.asarray(value) if isinstance(value, np.generic) else value


class QuiverBackend(Backend):
    """ONNX's backend API; `prepare` takes a path, bytes, an `onnx.ModelProto` or a session."""

    @classmethod
    def is_compatible(cls, model: Any, device: str | None = None, **kwargs: Any) -> bool:
        return cls.supports_device(device or "CPU")

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return str(device).upper() == "CPU"

    @classmethod
    def prepare(cls, model: Any, device: str | None = None, **kwargs: Any) -> QuiverBackendRep:  # type: ignore[override]
        if isinstance(model, QuiverBackendRep):
            return model
        if isinstance(model, InferenceSession):
            return QuiverBackendRep(model)
        if device is not None and not cls.supports_device(device):
            raise RuntimeError(f"Incompatible device expected '{device}', got 'CPU'")
        options = _set_allowed(SessionOptions(), kwargs, _SESSION_OPTIONS)
        source = model if isinstance(model, (str, bytes)) else model.SerializeToString()
        return QuiverBackendRep(InferenceSession(source, sess_options=options))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str | None = None, **kwargs: Any) -> Any:
        return cls.prepare(model, device, **kwargs).run(inputs, **kwargs)

    @classmethod
    def run_node(cls, node: Any, inputs: Any, device: str | None = None, outputs_info: Any = None, **_: Any) -> Any:
        raise NotImplementedError("It is much more efficient to run a whole model than every node independently.")


is_compatible = QuiverBackend.is_compatible
prepare = QuiverBackend.prepare
run = QuiverBackend.run_model
supports_device = QuiverBackend.supports_device

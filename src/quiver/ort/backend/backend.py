"""ONNX's backend API over `quiver.ort` sessions, as `onnxruntime.backend.backend` offers it."""

from __future__ import annotations

from typing import Any

from onnx.backend.base import Backend

from quiver.ort.backend.backend_rep import QuiverBackendRep, set_allowed
from quiver.ort.options import SessionOptions
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
        options = set_allowed(SessionOptions(), kwargs, _SESSION_OPTIONS)
        source = model if isinstance(model, (str, bytes)) else model.SerializeToString()
        return QuiverBackendRep(InferenceSession(source, sess_options=options))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str | None = None, **kwargs: Any) -> Any:
        return cls.prepare(model, device, **kwargs).run(inputs, **kwargs)

    @classmethod
    def run_node(cls, node: Any, inputs: Any, device: str | None = None, outputs_info: Any = None, **_: Any) -> Any:
        raise NotImplementedError("It is much more efficient to run a whole model than every node independently.")


OnnxRuntimeBackend = QuiverBackend  # the name onnxruntime.backend.backend gives it
is_compatible = QuiverBackend.is_compatible
prepare = QuiverBackend.prepare
run = QuiverBackend.run_model
supports_device = QuiverBackend.supports_device

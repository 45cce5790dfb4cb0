"""A model prepared by `quiver.ort.backend`, as `onnxruntime.backend.backend_rep` offers it."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
from onnx.backend.base import BackendRep

from quiver.ort.options import RunOptions
from quiver.ort.session import InferenceSession

_O = TypeVar("_O")
_RUN_OPTIONS = frozenset({"log_severity_level", "log_verbosity_level", "logid", "only_execute_path_to_fetches"})


class QuiverBackendRep(BackendRep):
    """A prepared model: a `quiver.ort.InferenceSession`."""

    def __init__(self, session: InferenceSession) -> None:
        self._session = session

    def run(self, inputs: Any, **kwargs: Any) -> list[np.ndarray]:  # type: ignore[override]
        """A list of inputs in the model's order, or one input for a one-input model (ORT's rules)."""
        options = set_allowed(RunOptions(), kwargs, _RUN_OPTIONS)
        declared = self._session.get_inputs()
        if isinstance(inputs, list):
            feeds = {arg.name: _scalar_as_array(inputs[i]) for i, arg in enumerate(declared)}
        else:
            if len(declared) != 1:
                raise RuntimeError(f"Model expect {len(declared)} inputs")
            feeds = {declared[0].name: _scalar_as_array(inputs)}
        return self._session.run(None, feeds, options)


def set_allowed(options: _O, kwargs: dict[str, Any], allowed: frozenset[str]) -> _O:
    """As onnxruntime.backend: allowed attributes are set, other known ones are refused, unknown keys ignored."""
    for key, value in kwargs.items():
        if key in allowed:
            setattr(options, key, value)
        elif hasattr(options, key):
            raise RuntimeError(f"{type(options).__name__} attribute '{key}' is not permitted via the backend API")
    return options


def _scalar_as_array(value: Any) -> Any:
    return np.asarray(value) if isinstance(value, np.generic) else value


OnnxRuntimeBackendRep = QuiverBackendRep  # the name onnxruntime.backend.backend_rep gives it

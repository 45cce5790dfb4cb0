"""ONNX Runtime's exception types (`onnxruntime.capi.onnxruntime_pybind11_state`), each also a QuiverError.

Each class derives from ORT's class of the same name, so code that catches ORT's errors catches Quiver's.
"""

from __future__ import annotations

from quiver import ort_package
from quiver.errors import QuiverError

_state = ort_package.submodule("capi.onnxruntime_pybind11_state")


def _ort(name: str) -> type[Exception]:
    """ORT's exception class of that name (older releases lack some: then a stand-in of our own)."""
    found = getattr(_state, name, None)
    return found if isinstance(found, type) and issubclass(found, Exception) else type(name, (Exception,), {})


class OrtError(QuiverError):
    """Base of the ORT-named errors of `quiver.ort`."""


class Fail(OrtError, _ort("Fail")):  # type: ignore[misc]
    pass


class InvalidArgument(OrtError, _ort("InvalidArgument")):  # type: ignore[misc]
    pass


class NoSuchFile(OrtError, _ort("NoSuchFile")):  # type: ignore[misc]
    pass


class NoModel(OrtError, _ort("NoModel")):  # type: ignore[misc]
    pass


class EngineError(OrtError, _ort("EngineError")):  # type: ignore[misc]
    """The backend failed in a way that needs a new session (QNN EP: an HTP subsystem restart)."""


class RuntimeException(OrtError, _ort("RuntimeException")):  # type: ignore[misc]
    pass


class InvalidProtobuf(OrtError, _ort("InvalidProtobuf")):  # type: ignore[misc]
    pass


class ModelLoaded(OrtError, _ort("ModelLoaded")):  # type: ignore[misc]
    pass


class NotImplemented(OrtError, _ort("NotImplemented")):  # type: ignore[misc]  # noqa: A001  (ORT's name)
    pass


class InvalidGraph(OrtError, _ort("InvalidGraph")):  # type: ignore[misc]
    pass


class EPFail(OrtError, _ort("EPFail")):  # type: ignore[misc]
    pass


class NotFound(OrtError, _ort("NotFound")):  # type: ignore[misc]
    pass


class ModelLoadCanceled(OrtError, _ort("ModelLoadCanceled")):  # type: ignore[misc]
    pass


class ModelRequiresCompilation(OrtError, _ort("ModelRequiresCompilation")):  # type: ignore[misc]
    pass


class DeviceReset(OrtError, _ort("DeviceReset")):  # type: ignore[misc]
    pass


class AdapterFileError(InvalidArgument, RuntimeError):
    """A file that is not a LoRA adapter: ORT raises RuntimeError there, so this is one too."""


class EnforceError(Fail, RuntimeError):
    """Where a check in ORT's Python binding fails (an unknown provider, thread settings that contradict
    the process's), ORT raises a plain RuntimeError: so is this."""


class MissingInputsError(OrtError, ValueError):
    """Required inputs absent from a run's feed: ORT checks that in Python and raises ValueError."""


def ort_error(exc: QuiverError) -> OrtError:
    """The ORT-named error for a Quiver error, keeping its message."""
    from quiver import errors

    kinds: list[tuple[type[QuiverError], type[OrtError]]] = [
        (errors.FileAccessError, NoSuchFile),
        (errors.ModelLoadError, InvalidProtobuf),
        (errors.UnsupportedOperatorError, NotImplemented),
        (errors.ConversionError, InvalidGraph),
        (errors.InvalidFeedError, InvalidArgument),
        (errors.FormatError, InvalidGraph),
        (errors.BackendError, EngineError),
        (errors.UnknownGraphError, InvalidArgument),
        (errors.SectionMismatchError, InvalidArgument),
        (errors.TensorUpdateError, InvalidArgument),
    ]
    if isinstance(exc, OrtError):
        return exc
    for quiver_type, ort_type in kinds:
        if isinstance(exc, quiver_type):
            return ort_type(str(exc))
    return Fail(str(exc))

"""ONNX Runtime's exception types (`onnxruntime.capi.onnxruntime_pybind11_state`), each also a QuiverError."""

from __future__ import annotations

from quiver.errors import QuiverError


class OrtError(QuiverError):
    """Base of the ORT-named errors of `quiver.ort`."""


class Fail(OrtError):
    pass


class InvalidArgument(OrtError):
    pass


class NoSuchFile(OrtError):
    pass


class NoModel(OrtError):
    pass


class EngineError(OrtError):
    """The backend failed in a way that needs a new session (QNN EP: an HTP subsystem restart)."""


class RuntimeException(OrtError):
    pass


class InvalidProtobuf(OrtError):
    pass


class ModelLoaded(OrtError):
    pass


class NotImplemented(OrtError):  # noqa: A001  (ORT's name)
    pass


class InvalidGraph(OrtError):
    pass


class EPFail(OrtError):
    pass


class NotFound(OrtError):
    pass


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

"""Quiver: one base model, many fine-tunes, in one weight-shared context binary."""

from quiver._version import __version__
from quiver.backends import Backend, CpuBackend, ReferenceBackend, available_backends, register_backend
from quiver.errors import (
    BackendError, BadMagicError, ChecksumMismatchError, ContextStateError, ConversionError, CorruptFileError,
    DuplicateGraphError, FeedDTypeError, FeedNameError, FeedShapeError, FormatError, HeaderTooLargeError,
    InputListError, InvalidFeedError, InvalidHeaderError, MisalignedTensorError, ModelLoadError, OutOfBoundsError,
    OverlappingRegionsError, QuiverError, TruncatedFileError, UnknownBackendError, UnknownGraphError,
    UnsupportedOperatorError, UnsupportedVersionError,
)
from quiver.ir.tensors import TensorInfo, TensorType
from quiver.runtime.context import Context, WeightStats
from quiver.runtime.graph import Graph

__all__ = [
    "__version__",
    # runtime
    "Context", "Graph", "TensorInfo", "TensorType", "WeightStats",
    # backends
    "Backend", "CpuBackend", "ReferenceBackend", "available_backends", "register_backend",
    # errors
    "QuiverError", "FormatError", "CorruptFileError", "BadMagicError", "TruncatedFileError", "HeaderTooLargeError",
    "ChecksumMismatchError", "InvalidHeaderError", "OutOfBoundsError", "OverlappingRegionsError",
    "MisalignedTensorError", "UnsupportedVersionError", "ModelLoadError", "ConversionError",
    "UnsupportedOperatorError", "UnknownGraphError", "DuplicateGraphError", "ContextStateError", "InvalidFeedError",
    "FeedNameError", "FeedShapeError", "FeedDTypeError", "BackendError", "UnknownBackendError", "InputListError",
]

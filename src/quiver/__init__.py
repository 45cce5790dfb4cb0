"""Quiver: one base model, many fine-tunes, in one weight-shared context binary."""

from quiver._version import __version__
from quiver.backends import Backend, CpuBackend, ReferenceBackend, available_backends, register_backend
from quiver.errors import (
    AdapterError,
    BackendError,
    BadMagicError,
    ChecksumMismatchError,
    ContextStateError,
    ConversionError,
    CorruptFileError,
    DuplicateGraphError,
    EncodingsError,
    FeedDTypeError,
    FeedNameError,
    FeedShapeError,
    FileAccessError,
    FormatError,
    HeaderTooLargeError,
    InputListError,
    InvalidFeedError,
    InvalidHeaderError,
    MisalignedTensorError,
    ModelLoadError,
    OutOfBoundsError,
    OverlappingRegionsError,
    QuantizationError,
    QuiverError,
    SectionMismatchError,
    TensorUpdateError,
    TruncatedFileError,
    UnknownBackendError,
    UnknownGraphError,
    UnsupportedOperatorError,
    UnsupportedVersionError,
)
from quiver.formats.encodings import Encoding, EncodingSet, load_encodings, save_encodings
from quiver.ir.tensors import TensorInfo, TensorType
from quiver.passes.quantize import QuantizeOptions, quantize
from quiver.runtime.context import Context, WeightStats
from quiver.runtime.graph import Graph
from quiver.tools.accuracy import AccuracyReport, accuracy_report
from quiver.tools.check import CheckReport, check_model
from quiver.tools.compare import Comparison, compare_models
from quiver.tools.netrun import parse_input_list, run_input_list
from quiver.tools.report import describe_context

__all__ = [
    "__version__",
    # runtime
    "Context",
    "Graph",
    "TensorInfo",
    "TensorType",
    "WeightStats",
    # quantization
    "quantize",
    "QuantizeOptions",
    "Encoding",
    "EncodingSet",
    "load_encodings",
    "save_encodings",
    "accuracy_report",
    "AccuracyReport",
    # tools
    "check_model",
    "CheckReport",
    "compare_models",
    "Comparison",
    "describe_context",
    "parse_input_list",
    "run_input_list",
    # backends
    "Backend",
    "CpuBackend",
    "ReferenceBackend",
    "available_backends",
    "register_backend",
    # errors
    "QuiverError",
    "FileAccessError",
    "FormatError",
    "CorruptFileError",
    "BadMagicError",
    "TruncatedFileError",
    "HeaderTooLargeError",
    "ChecksumMismatchError",
    "InvalidHeaderError",
    "OutOfBoundsError",
    "OverlappingRegionsError",
    "MisalignedTensorError",
    "UnsupportedVersionError",
    "ModelLoadError",
    "EncodingsError",
    "QuantizationError",
    "ConversionError",
    "UnsupportedOperatorError",
    "UnknownGraphError",
    "DuplicateGraphError",
    "ContextStateError",
    "InvalidFeedError",
    "FeedNameError",
    "FeedShapeError",
    "FeedDTypeError",
    "BackendError",
    "UnknownBackendError",
    "InputListError",
    "AdapterError",
    "SectionMismatchError",
    "TensorUpdateError",
]

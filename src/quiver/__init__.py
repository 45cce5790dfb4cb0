"""Quiver: one base model, many fine-tunes, in one weight-shared context binary.

Importing the package is cheap: errors are loaded at once, everything else (ONNX, ONNX Runtime, the
backends) on first use of the name that needs it, as `import onnxruntime` users expect of a library.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from quiver.errors import (
    AdapterError,
    BackendError,
    BadMagicError,
    ChecksumMismatchError,
    ContextStateError,
    ConversionError,
    CorruptFileError,
    DialogConfigError,
    DuplicateGraphError,
    EncodingsError,
    ExportResourceError,
    FeedDTypeError,
    FeedNameError,
    FeedShapeError,
    FileAccessError,
    FileChangedError,
    FormatError,
    GenerationError,
    HeaderTooLargeError,
    InputListError,
    InvalidFeedError,
    InvalidHeaderError,
    MisalignedTensorError,
    ModelFolderError,
    ModelLoadError,
    OutOfBoundsError,
    OverlappingRegionsError,
    QuantizationError,
    QuiverError,
    SectionMismatchError,
    TargetServerError,
    TensorUpdateError,
    TruncatedFileError,
    TuningError,
    UnknownBackendError,
    UnknownGraphError,
    UnsupportedOperatorError,
    UnsupportedVersionError,
)
from quiver.version import __version__

# name -> module that defines it, imported on first access (PEP 562)
_LAZY = {
    "TuningWarning": "quiver.runtime.tuned",
    "Backend": "quiver.backends",
    "CpuBackend": "quiver.backends",
    "ReferenceBackend": "quiver.backends",
    "available_backends": "quiver.backends",
    "register_backend": "quiver.backends",
    "Encoding": "quiver.formats.encodings",
    "EncodingSet": "quiver.formats.encodings",
    "load_encodings": "quiver.formats.encodings",
    "save_encodings": "quiver.formats.encodings",
    "TensorInfo": "quiver.ir.tensors",
    "TensorType": "quiver.ir.tensors",
    "QuantizeOptions": "quiver.passes.qdq",
    "quantize": "quiver.passes.qdq",
    "Context": "quiver.runtime.context",
    "WeightStats": "quiver.runtime.context",
    "Graph": "quiver.runtime.graph",
    "BoundRun": "quiver.runtime.bound_run",
    "AccuracyReport": "quiver.commands.accuracy",
    "accuracy_report": "quiver.commands.accuracy",
    "CheckReport": "quiver.commands.check",
    "check_model": "quiver.commands.check",
    "Comparison": "quiver.passes.compare",
    "compare_models": "quiver.passes.compare",
    "parse_input_list": "quiver.runtime.netrun",
    "run_input_list": "quiver.runtime.netrun",
    "describe_context": "quiver.commands.report",
}

if _TYPE_CHECKING:
    from quiver.backends import Backend, CpuBackend, ReferenceBackend, available_backends, register_backend
    from quiver.commands.accuracy import AccuracyReport, accuracy_report
    from quiver.commands.check import CheckReport, check_model
    from quiver.commands.report import describe_context
    from quiver.formats.encodings import Encoding, EncodingSet, load_encodings, save_encodings
    from quiver.ir.tensors import TensorInfo, TensorType
    from quiver.passes.compare import Comparison, compare_models
    from quiver.passes.qdq import QuantizeOptions, quantize
    from quiver.runtime.bound_run import BoundRun
    from quiver.runtime.context import Context, WeightStats
    from quiver.runtime.graph import Graph
    from quiver.runtime.netrun import parse_input_list, run_input_list


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quiver' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    # runtime
    "Context",
    "Graph",
    "BoundRun",
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
    "FileChangedError",
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
    "GenerationError",
    "ModelFolderError",
    "DialogConfigError",
    "ExportResourceError",
    "TuningError",
    "TargetServerError",
    "TuningWarning",
]

"""ONNX Runtime's Python API on Quiver: `import quiver.ort as ort` in place of `import onnxruntime as ort`.

Every public name of the installed onnxruntime is here, decided one by one (`surface.py`): sessions,
options, adapters, I/O binding and errors run over Quiver; data types and process-wide settings are
ORT's own objects (delegated); what Quiver cannot do is refused with an ORT-typed error saying why.
"""

import sys
from typing import Any

from quiver import ort_package
from quiver.ort import aliases
from quiver.ort.binding import IOBinding, SessionIOBinding
from quiver.ort.compiler import ModelCompiler
from quiver.ort.errors import (
    DeviceReset,
    EngineError,
    EPFail,
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    ModelLoadCanceled,
    ModelLoaded,
    ModelRequiresCompilation,
    NoModel,
    NoSuchFile,
    NotFound,
    NotImplemented,
    OrtError,
    RuntimeException,
)
from quiver.ort.options import ExecutionMode, GraphOptimizationLevel, LoraAdapter, RunOptions, SessionOptions
from quiver.ort.provider import PROVIDER
from quiver.ort.session import ExecutionPath, InferenceSession, ModelMetadata, NodeArg
from quiver.ort.surface import DELEGATED, DELEGATED_MODULES
from quiver.ort_package import onnxruntime as _onnxruntime
from quiver.ort_process import set_ort_log_severity, use_global_thread_pools

aliases.install(DELEGATED_MODULES)
__version__ = _onnxruntime.__version__  # the API's version: what code that checks it expects


def install() -> None:
    """Makes `import onnxruntime` give `quiver.ort` from now on in this process, for code you do not edit
    (a library that ships its own ONNX models and imports onnxruntime itself): call it before importing
    that library. Quiver's own engines keep using ONNX Runtime itself; `uninstall()` undoes it."""
    sys.modules[ort_package.NAME] = sys.modules[__name__]


def uninstall() -> None:
    """`import onnxruntime` gives ONNX Runtime itself again (modules that imported it meanwhile keep
    `quiver.ort`)."""
    sys.modules[ort_package.NAME] = _onnxruntime


def get_available_providers() -> list[str]:
    return [PROVIDER, "CPUExecutionProvider"]


def get_all_providers() -> list[str]:
    return get_available_providers()


def get_device() -> str:
    return "CPU"


def set_default_logger_severity(severity: int) -> None:
    """ORT's default log severity; Quiver's own ORT sessions log at it too from now on (by default they
    log fatal errors only, so that a normal load prints nothing)."""
    _onnxruntime.set_default_logger_severity(severity)
    set_ort_log_severity(severity)


if hasattr(_onnxruntime, "set_default_logger_callback"):  # ORT >= 1.32

    def set_default_logger_callback(callback: Any, severity: int = 2) -> None:
        """ORT's logging callback; Quiver's own ORT sessions log to it at that severity from now on."""
        _onnxruntime.set_default_logger_callback(callback, severity=severity)
        if callback is not None:
            set_ort_log_severity(severity)


def set_global_thread_pool_sizes(intra_op_num_threads: int = 0, inter_op_num_threads: int = 0) -> None:
    """ORT's process-wide thread pools; every session after this runs on them, Quiver's too (as in ORT,
    a session may then not ask for threads of its own)."""
    _onnxruntime.set_global_thread_pool_sizes(intra_op_num_threads, inter_op_num_threads)
    use_global_thread_pools()


def __getattr__(name: str) -> Any:
    """ORT's own object for a delegated name (the same object: isinstance checks and enums agree)."""
    if name in DELEGATED and hasattr(_onnxruntime, name):
        return getattr(_onnxruntime, name)
    if name == "backend" or name in DELEGATED_MODULES:
        if name == "backend":
            import importlib

            return importlib.import_module("quiver.ort.backend")
        return ort_package.submodule(name)
    raise AttributeError(f"module 'quiver.ort' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *(n for n in DELEGATED if hasattr(_onnxruntime, n)), *DELEGATED_MODULES, "backend"})


__all__ = [
    "install",
    "uninstall",
    "InferenceSession",
    "ExecutionPath",
    "SessionOptions",
    "RunOptions",
    "LoraAdapter",
    "NodeArg",
    "ModelMetadata",
    "IOBinding",
    "SessionIOBinding",
    "ModelCompiler",
    "GraphOptimizationLevel",
    "ExecutionMode",
    "get_available_providers",
    "get_all_providers",
    "get_device",
    "set_global_thread_pool_sizes",
    "set_default_logger_severity",
    "OrtError",
    "Fail",
    "InvalidArgument",
    "NoSuchFile",
    "NoModel",
    "EngineError",
    "RuntimeException",
    "InvalidProtobuf",
    "ModelLoaded",
    "NotImplemented",
    "InvalidGraph",
    "EPFail",
    "NotFound",
    "ModelLoadCanceled",
    "ModelRequiresCompilation",
    "DeviceReset",
]

if hasattr(_onnxruntime, "set_default_logger_callback"):
    __all__.append("set_default_logger_callback")

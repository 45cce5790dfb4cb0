"""ONNX Runtime's Python API on Quiver: `import quiver.ort as ort` in place of `import onnxruntime as ort`."""

from quiver.ort.errors import (
    EngineError,
    EPFail,
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    ModelLoaded,
    NoModel,
    NoSuchFile,
    NotFound,
    NotImplemented,
    OrtError,
    RuntimeException,
)
from quiver.ort.options import ExecutionMode, GraphOptimizationLevel, LoraAdapter, RunOptions, SessionOptions
from quiver.ort.provider import PROVIDER
from quiver.ort.session import InferenceSession, NodeArg

__version__ = "quiver"


def get_available_providers() -> list[str]:
    return [PROVIDER, "CPUExecutionProvider"]


def get_all_providers() -> list[str]:
    return get_available_providers()


def get_device() -> str:
    return "CPU"


__all__ = [
    "InferenceSession",
    "SessionOptions",
    "RunOptions",
    "LoraAdapter",
    "NodeArg",
    "GraphOptimizationLevel",
    "ExecutionMode",
    "get_available_providers",
    "get_all_providers",
    "get_device",
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
]

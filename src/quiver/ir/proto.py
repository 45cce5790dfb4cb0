"""ONNX's protobuf messages (ModelProto, TensorProto...) without importing the `onnx` package.

Loading a context parses skeletons and hands them to a backend; that needs ONNX's message classes, not
`onnx`'s helpers, checker and reference code, which cost ~45 ms more to import. The installed onnx's own
generated module is loaded under a private name: its descriptors register in protobuf's default pool
exactly as `import onnx` registers them, so the classes are the very same (`onnx.ModelProto is
ModelProto` once onnx is imported too).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING


def _generated() -> ModuleType:
    if "onnx" in sys.modules:  # imported already: nothing to save
        from onnx import onnx_ml_pb2

        return onnx_ml_pb2
    package = importlib.util.find_spec("onnx")  # locates the package without running its __init__
    if package is None or package.origin is None:
        raise ImportError("the onnx package is not installed; install Quiver's dependencies")
    spec = importlib.util.spec_from_file_location(
        "quiver.ir._onnx_ml_pb2", Path(package.origin).with_name("onnx_ml_pb2.py")
    )
    if spec is None or spec.loader is None:
        raise ImportError("onnx's generated protobuf module (onnx_ml_pb2.py) is missing; reinstall onnx")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto
else:
    _pb = _generated()
    AttributeProto = _pb.AttributeProto
    GraphProto = _pb.GraphProto
    ModelProto = _pb.ModelProto
    NodeProto = _pb.NodeProto
    TensorProto = _pb.TensorProto
    ValueInfoProto = _pb.ValueInfoProto

__all__ = ["AttributeProto", "GraphProto", "ModelProto", "NodeProto", "TensorProto", "ValueInfoProto"]

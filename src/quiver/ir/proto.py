"""ONNX's protobuf messages (ModelProto, TensorProto...) without importing the `onnx` package.

Loading a context parses skeletons and hands them to a backend; that needs ONNX's message classes, not
`onnx`'s helpers, checker and reference code, which cost much more to import. The installed onnx's own
generated module is loaded under a private name: its descriptors register in protobuf's default pool
exactly as `import onnx` registers them, so the classes are the very same (`onnx.ModelProto is
ModelProto` once onnx is imported too).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from quiver import portable


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

    def __getattr__(name: str) -> type:
        # Loaded on first use, not at import: protobuf's Python runtime alone takes ~55 ms to import, and
        # `import quiver.ort` must cost little more than `import onnxruntime`. Use these classes as
        # `proto.ModelProto` inside functions; `from quiver.ir.proto import X` at the top of a module
        # loads them at once.
        if name not in __all__:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        with _loading:  # one thread registers the descriptors; the others wait and reuse them
            generated = sys.modules.get("quiver.ir._onnx_ml_pb2") or _generated()
            for message in __all__:
                globals()[message] = getattr(generated, message)
        return getattr(generated, name)

    _loading = threading.Lock()

    def _new_lock_in_child() -> None:  # a child forked mid-load must not inherit the lock held
        global _loading
        _loading = threading.Lock()

    portable.at_fork(after_in_child=_new_lock_in_child)


__all__ = ["AttributeProto", "GraphProto", "ModelProto", "NodeProto", "TensorProto", "ValueInfoProto"]

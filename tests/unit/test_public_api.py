"""The package names its public API in `__all__`; everything that looks public is exported."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import quiver
import quiver.errors


def test_everything_in_all_exists() -> None:
    for name in quiver.__all__:
        assert hasattr(quiver, name), name


def test_every_public_error_is_exported_and_is_a_quiver_error() -> None:
    for name, value in vars(quiver.errors).items():
        if inspect.isclass(value) and issubclass(value, Exception) and value.__module__ == "quiver.errors":
            assert name in quiver.__all__, f"{name} is public in quiver.errors but not exported"
            assert issubclass(value, quiver.QuiverError)


def test_nothing_public_at_top_level_is_missing_from_all() -> None:
    public = {n for n, v in vars(quiver).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public <= set(quiver.__all__), public - set(quiver.__all__)


def test_every_module_has_a_docstring() -> None:
    import pkgutil

    for module in pkgutil.walk_packages(quiver.__path__, "quiver."):
        if module.name.endswith("__main__"):
            continue
        imported = __import__(module.name, fromlist=["_"])
        assert imported.__doc__ and imported.__doc__.strip(), module.name


_LOAD_AND_RUN = """
import sys, numpy as np, quiver
with quiver.Context.from_binary(sys.argv[1]) as context:
    graph = context.graph("base")
    graph.execute({"input_ids": np.ones((1, 4), np.int64)})
    context.wait_until_ready()
    graph.execute({"input_ids": np.ones((1, 4), np.int64)})
print(sorted(m for m in sys.modules if m == "onnx" or m.startswith("onnx.")))
"""


def test_loading_and_running_a_context_does_not_import_the_onnx_package(family_context: Path) -> None:
    # onnx's helpers, checker and reference code cost ~45 ms of every fresh process; loading needs only
    # its protobuf messages (quiver.ir.proto)
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_RUN, str(family_context)], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


_OPEN_EP_CONTEXT = """
import sys, numpy as np, quiver.ort
session = quiver.ort.InferenceSession(sys.argv[1])
session.run(None, {"input_ids": np.ones((1, 4), np.int64)})
print(sorted(m for m in sys.modules if m == "onnx" or m.startswith("onnx.")))
"""


def test_opening_an_ep_context_model_does_not_import_the_onnx_package(family_context: Path, tmp_path: Path) -> None:
    from quiver.ort.epcontext import wrap_context

    model = next(p for p in wrap_context(family_context, tmp_path) if p.name.startswith("base"))
    result = subprocess.run(
        [sys.executable, "-c", _OPEN_EP_CONTEXT, str(model)], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


_IMPORT_ORT = """
import sys, numpy, onnxruntime
before = set(sys.modules)
import quiver.ort
added = set(sys.modules) - before
print(sorted(m for m in added if m.split(".")[0] in ("google", "ml_dtypes", "onnx") or m in _HEAVY))
"""
_HEAVY = ("quiver.backends.cpu", "quiver.runtime.context", "quiver.formats.reader", "quiver.ort.engine_quiver")


def test_importing_quiver_ort_loads_no_protobuf_ml_dtypes_or_engine() -> None:
    # `import quiver.ort` must cost little more than `import onnxruntime` (benchmarks/wheel_models.py
    # measures it): protobuf (~55 ms), ml_dtypes (~10 ms) and the engines come with the first session
    code = f"_HEAVY = {_HEAVY!r}\n{_IMPORT_ORT}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_onnx_element_type_numbers_match_the_installed_onnx() -> None:
    import onnx

    from quiver.ir.dtypes import ElementType

    for name, number in onnx.TensorProto.DataType.items():
        if name in ElementType.__members__:  # newer onnx releases add types; the ones Quiver names must agree
            assert ElementType[name] == number, name
    assert {"FLOAT", "INT64", "BFLOAT16", "INT4", "STRING"} <= set(onnx.TensorProto.DataType.keys())

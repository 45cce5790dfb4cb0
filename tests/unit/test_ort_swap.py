"""`sys.modules["onnxruntime"] = quiver.ort` (`quiver.ort.install()`): libraries that import onnxruntime
themselves run on Quiver, and Quiver's own engines, imported after the swap, still use ONNX Runtime.

Each case runs in a child process (a swap is process-wide); the reference outputs come from plain
onnxruntime in this process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

# A library as those that ship ONNX models are written: it imports onnxruntime (and its subpackages)
# itself, at its own import, and makes its sessions with the names onnxruntime gives.
THIRD_PARTY = """
import numpy as np
import onnxruntime
import onnxruntime as ort
import onnxruntime.quantization
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument
import onnxruntime.backend as backend


class Detector:
    def __init__(self, path):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def __call__(self, x):
        return self.session.run(None, {self.session.get_inputs()[0].name: x})[0]

    def bad_feed(self):
        name = self.session.get_inputs()[0].name
        try:  # a feed of the wrong type: ORT's InvalidArgument
            self.session.run(None, {name: np.zeros((2, 8), np.int64)})
        except (Fail, InvalidArgument) as exc:
            return "caught"
        return "no error"
"""

CHILD = """
import json, sys
{before}
sys.path.insert(0, sys.argv[1])
import numpy as np
import third_party
import onnxruntime
x = np.load(sys.argv[3])
detector = third_party.Detector(sys.argv[2])
y = detector(x)
np.save(sys.argv[4], y)
print(json.dumps({{
    "swapped": onnxruntime.__name__,
    "engine": detector.session.execution_path.engine,
    "quantization": third_party.onnxruntime.quantization.__name__,
    "backend": third_party.backend.__name__,
    "bad_feed": detector.bad_feed(),
}}))
"""


def _matmul_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.write_bytes(model.SerializeToString())
    return path


def _run_child(tmp_path: Path, before: str) -> tuple[dict[str, str], np.ndarray, np.ndarray]:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "third_party.py").write_text(THIRD_PARTY)
    model = _matmul_model(tmp_path / "detector.onnx")
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = CHILD.format(before=textwrap.dedent(before))
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "lib"), str(model), str(tmp_path / "x.npy"), str(tmp_path / "y")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reference = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return json.loads(done.stdout.strip().splitlines()[-1]), np.load(tmp_path / "y.npy"), reference


@pytest.mark.parametrize(
    "before",
    [
        # the documented helper, nothing of Quiver's engines imported before the swap
        "import quiver.ort\nquiver.ort.install()",
        # by hand, as users of other drop-ins write it
        "import quiver.ort\nsys.modules['onnxruntime'] = quiver.ort",
        # the top-level package first, then the swap: its lazy names import the engines after it
        "import quiver, quiver.ort\nsys.modules['onnxruntime'] = quiver.ort\nquiver.Context",
    ],
    ids=["install", "by-hand", "engines-after-the-swap"],
)
def test_a_library_importing_onnxruntime_after_the_swap_runs_on_quivers_path(tmp_path: Path, before: str) -> None:
    seen, output, reference = _run_child(tmp_path, before)
    assert seen["swapped"] == "quiver.ort"  # the library got quiver.ort
    assert seen["engine"] == "quiver"  # and its session runs on Quiver's own engine
    assert seen["quantization"] == "onnxruntime.quantization"  # ORT's subpackages still import
    assert seen["backend"] == "quiver.ort.backend"
    assert seen["bad_feed"] == "caught"  # the library's `except` of ORT's classes catches the error
    np.testing.assert_allclose(output, reference, rtol=1e-6, atol=1e-6)


QUANTIZE_AFTER_SWAP = """
import sys
import quiver.ort
quiver.ort.install()
from quiver.passes.qdq import quant_type_of
from quiver.ort_package import onnxruntime, submodule
import onnxruntime as swapped
assert swapped is quiver.ort, swapped
assert onnxruntime.__name__ == "onnxruntime" and onnxruntime is not quiver.ort
quantization = submodule("quantization")
# ORT's quantization tools, imported after the swap, bind ORT's own session class, not quiver.ort's
assert quantization.quant_utils.InferenceSession is onnxruntime.InferenceSession
assert sys.modules["onnxruntime"] is quiver.ort  # and the swap is in place again after that import
print(quant_type_of("uint16").name)
"""


def test_quivers_own_use_of_onnxruntimes_tools_after_the_swap_binds_onnxruntime_itself() -> None:
    done = subprocess.run([sys.executable, "-c", QUANTIZE_AFTER_SWAP], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "QUInt16"


ANOTHER_STAND_IN = """
import sys, types
sys.modules["onnxruntime"] = types.ModuleType("somebody_elses_shim")
import quiver.ort
from quiver.ort_package import onnxruntime
assert onnxruntime.__name__ == "onnxruntime" and hasattr(onnxruntime, "InferenceSession")
assert sys.modules["onnxruntime"].__name__ == "somebody_elses_shim"  # the user's module stays
print(quiver.ort.InferenceSession(quiver.ort.datasets.get_example("mul_1.onnx")).execution_path.engine)
"""


def test_quiver_ort_imported_while_another_module_stands_in_for_onnxruntime_binds_the_real_one() -> None:
    done = subprocess.run([sys.executable, "-c", ANOTHER_STAND_IN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "quiver"


def test_uninstall_gives_onnxruntime_back() -> None:
    script = (
        "import sys, quiver.ort\nquiver.ort.install()\nimport onnxruntime as a\nquiver.ort.uninstall()\n"
        "import onnxruntime as b\nprint(a.__name__, b.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["quiver.ort", "onnxruntime"]


def test_no_module_of_quiver_imports_onnxruntime_by_name() -> None:
    """Only `quiver.ort_package` may: any other `import onnxruntime` would give a swap's quiver.ort."""
    source = Path(__file__).resolve().parents[2] / "src" / "quiver"
    pattern = re.compile(r"^\s*(import onnxruntime\b|from onnxruntime\b)", re.M)
    offenders = [
        str(path.relative_to(source))
        for path in source.rglob("*.py")
        if path.name != "ort_package.py" and pattern.search(path.read_text())
    ]
    assert offenders == []

"""ONNX's backend node tests (from the onnx 1.17.0 wheel) run on Quiver's backends and on plain ONNX Runtime.

`python tests/support/node_suite.py --json OUT.json` writes the counts and every non-pass with its reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

import quiver
from quiver.ir import dtypes
from quiver.ir.ops import is_supported, iter_nodes, op_id

ort.set_default_logger_severity(3)
EXTRACT_TO = Path(__file__).resolve().parents[2] / ".node_tests"
WHEEL = "onnx==1.17.0"
MEMBER = "onnx/backend/test/data/node/"


def node_test_root() -> Path:
    """The node tests of the installed onnx 1.17.0 or, failing that, extracted from its wheel."""
    installed = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    if onnx.__version__ == "1.17.0" and installed.is_dir():
        return installed
    target = EXTRACT_TO / "node"
    if not target.is_dir():
        EXTRACT_TO.mkdir(exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL, "-d", str(EXTRACT_TO)],
            check=True,
            capture_output=True,
        )
        wheel = next(EXTRACT_TO.glob("onnx-1.17.0-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if member.startswith(MEMBER):
                    archive.extract(member, EXTRACT_TO / "wheel")
        (EXTRACT_TO / "wheel" / MEMBER).rename(target)
    return target


@dataclass
class Case:
    name: str
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    expected: list[np.ndarray]


def _scope_problem(model: onnx.ModelProto) -> str | None:
    """Why a case is outside what Quiver supports, or None."""
    unsupported = sorted({op_id(n) for n in iter_nodes(model.graph) if not is_supported(n)})
    if unsupported:
        return f"operator not in Quiver's list: {', '.join(unsupported)}"
    for value in list(model.graph.input) + list(model.graph.output):
        if value.type.WhichOneof("value") != "tensor_type":
            return "non-tensor input/output (sequence, optional or map)"
        if value.type.tensor_type.elem_type not in {dtypes.onnx_of(n) for n in dtypes.IO_DTYPE_NAMES}:
            name = onnx.TensorProto.DataType.Name(value.type.tensor_type.elem_type)
            return f"element type {name} (complex, or another Quiver does not exchange)"
    return None


def load_case(folder: Path) -> Case | str:
    """The case, or why it is out of scope."""
    model = onnx.load(str(folder / "model.onnx"))
    problem = _scope_problem(model)
    if problem:
        return problem
    data = folder / "test_data_set_0"

    def read(kind: str) -> list[np.ndarray]:
        arrays = []
        for file in sorted(data.glob(f"{kind}_*.pb"), key=lambda p: int(p.stem.split("_")[1])):
            tensor = onnx.TensorProto()
            tensor.ParseFromString(file.read_bytes())
            arrays.append(numpy_helper.to_array(tensor))
        return arrays

    initializer_names = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializer_names]

    def typed(values: list[np.ndarray], infos: list[onnx.ValueInfoProto]) -> list[np.ndarray]:
        # onnx decodes bfloat16 test data as its raw uint16 bits, and (1.17) float8 and 4-bit data as
        # structured dtypes of its own: both as the types Quiver exchanges
        typed = []
        for value, info in zip(values, infos):
            name = dtypes.io_name_of_onnx(info.type.tensor_type.elem_type)
            if name == "bfloat16" and value.dtype == np.uint16:
                value = value.view(dtypes.numpy_of("bfloat16"))
            elif name in dtypes.IO_DTYPE_NAMES - dtypes.DTYPE_NAMES:
                value = dtypes.as_io_array(value, name)
            typed.append(value)
        return typed

    feeds = dict(zip([i.name for i in inputs], typed(read("input"), inputs)))
    return Case(folder.name, model, feeds, typed(read("output"), list(model.graph.output)))


def _matches(expected: list[np.ndarray], actual: list[np.ndarray]) -> str | None:
    if len(expected) != len(actual):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        a = np.asarray(a)
        if e.dtype != a.dtype and not (e.dtype.kind == a.dtype.kind == "U"):
            return f"output {i}: dtype {a.dtype}, expected {e.dtype}"
        if e.shape != a.shape:
            return f"output {i}: shape {a.shape}, expected {e.shape}"
        try:
            if e.dtype.kind in "fc" or (e.dtype.kind == "V" and e.dtype.itemsize <= 2 and "int" not in e.dtype.name):
                np.testing.assert_allclose(
                    a.astype(np.float64), e.astype(np.float64), rtol=1e-3, atol=1e-6, equal_nan=True
                )
            else:
                np.testing.assert_array_equal(a, e)
        except AssertionError:
            return f"output {i}: values differ"
    return None


def run_on_quiver(case: Case, backend: str) -> str | None:
    """None if the case passes on the backend, else why not."""
    context = quiver.Context.create(backend)
    try:
        context.add_graph("node", case.model)
        context.finalize()
        outputs = context.graph("node").execute(case.inputs)
        return _matches(case.expected, list(outputs.values()))
    except quiver.QuiverError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        context.close()


def run_on_onnxruntime(case: Case) -> str | None:
    try:
        session = ort.InferenceSession(case.model.SerializeToString(), providers=["CPUExecutionProvider"])
        return _matches(case.expected, session.run(None, case.inputs))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def run_suite(backends: tuple[str, ...] = ("cpu", "reference"), limit: int | None = None) -> dict[str, object]:
    """Runs every in-scope case on the backends and on ORT; returns counts and failures."""
    root = node_test_root()
    folders = sorted(p for p in root.iterdir() if (p / "model.onnx").is_file())[:limit]
    out_of_scope: Counter[str] = Counter()
    failures: dict[str, dict[str, str]] = {name: {} for name in (*backends, "onnxruntime")}
    passed: dict[str, list[str]] = {name: [] for name in (*backends, "onnxruntime")}
    in_scope = 0
    for folder in folders:
        case = load_case(folder)
        if isinstance(case, str):
            out_of_scope[case.split(":")[0]] += 1
            continue
        in_scope += 1
        runners = {name: (lambda c, b=name: run_on_quiver(c, b)) for name in backends}
        runners["onnxruntime"] = run_on_onnxruntime
        for name, runner in runners.items():
            problem = runner(case)
            if problem is None:
                passed[name].append(case.name)
            else:
                failures[name][case.name] = problem
    return {
        "onnx_version": onnx.__version__,
        "onnxruntime_version": ort.__version__,
        "cases": len(folders),
        "in_scope": in_scope,
        "out_of_scope": dict(out_of_scope),
        "passed": {name: len(v) for name, v in passed.items()},
        "passed_cases": passed,
        "failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args()
    report = run_suite()
    summary = {k: report[k] for k in ("cases", "in_scope", "out_of_scope", "passed")}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

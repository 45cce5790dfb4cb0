"""Runs ONNX Runtime's own Python API tests on onnxruntime and on quiver.ort, two ways, and compares.

    python ci/ort_api/run.py [--min-pass 0.9] [--json OUT] [--extra DIR]

The tests come from ORT's source as Debian ships it (downloaded once, checked against its SHA-256,
cached under ~/.cache/quiver/ort-api-tests); none of ORT's code is kept in this repository. Debian
strips the binary test models, so `models.py` rebuilds them. The quiver.ort runs are the same files
with every `onnxruntime` import rewritten to `quiver.ort` ("imports"), and the files unchanged with
`sys.modules["onnxruntime"]` swapped for `quiver.ort` before they run (`quiver.ort.install()` in a
sitecustomize: "swap", as users put a library they do not edit on Quiver). The score of each is the
share of the tests passing on plain onnxruntime that also pass there; a crash (a run killed by a
signal) fails outright.
`--extra DIR` adds test files from DIR (newer suites, e.g. the compile API's) to both runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import models  # noqa: E402  (beside this script, not a package)

SOURCE = "onnxruntime_1.21.0+dfsg.orig.tar.xz"
SOURCE_PACKAGE, SOURCE_SUITE = "onnxruntime", "trixie"  # Debian's source package of ORT 1.21, from trixie
SOURCE_MD5 = "3b5e44fc802ab8df6aa24c18138f138e"  # Debian trixie's Sources index
SYSTEM_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
SUITES = [
    "onnxruntime_test_python.py",
    "onnxruntime_test_python_iobinding.py",
    "onnxruntime_test_python_backend.py",
    "onnxruntime_test_python_backend_mlops.py",
    "onnxruntime_test_python_mlops.py",
    "onnxruntime_test_python_sparse_matmul.py",
    "onnxruntime_test_python_nested_control_flow_op.py",
]
TEST_DIR = "onnxruntime-1.21.0/onnxruntime/test/python/"
TESTDATA_DIR = "onnxruntime-1.21.0/onnxruntime/test/testdata/"
# ORT's own scripts for some of its models: (script, arguments, model written)
GENERATORS = [
    (
        "sparse_initializer_as_output.py",
        ["--node_name", "Constant", "--output_file"],
        "sparse_initializer_as_output.onnx",
    ),
    ("sparse_to_dense_matmul.py", ["--output_file"], "sparse_to_dense_matmul.onnx"),
    ("model_with_external_initializer_come_from_user.py", [], "model_with_external_initializer_come_from_user.onnx"),
]
# onnx removed `onnx.mapping` (1.17); the IOBinding suite still imports it: a sitecustomize puts it back
SITECUSTOMIZE = """\
import sys, types
from onnx import helper
import onnx
if not hasattr(onnx, "mapping"):
    onnx.mapping = sys.modules["onnx.mapping"] = types.ModuleType("onnx.mapping")
    onnx.mapping.TENSOR_TYPE_MAP = {
        t: types.SimpleNamespace(np_dtype=helper.tensor_dtype_to_np_dtype(t), name=helper.tensor_dtype_to_string(t))
        for t in helper.get_all_tensor_dtypes()
    }
"""


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quiver" / "ort-api-tests"


def _debian_mirror() -> str:
    """The Debian mirror this machine's apt already uses (read from its sources, never written here)."""
    fields = [line.split(":", 1) for line in SYSTEM_SOURCES.read_text().splitlines() if ":" in line]
    uris = [value.split()[0] for key, value in fields if key.strip() == "URIs" and value.strip().endswith("/debian")]
    if not uris:
        raise SystemExit(f"no Debian mirror in {SYSTEM_SOURCES}: apt-get cannot fetch ORT's source")
    return uris[0]


def _download(cache: Path) -> Path:
    """ORT's source tarball through apt-get's own client (`apt-get source`), with a private list of
    trixie's sources so the machine's apt configuration is left as it is."""
    archive = cache / SOURCE
    if not archive.is_file():
        apt = cache / "apt"
        (apt / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
        (apt / "sources.list").write_text(f"deb-src [signed-by={keyring}] {_debian_mirror()} {SOURCE_SUITE} main\n")
        private = [
            f"-oDir::Etc::SourceList={apt / 'sources.list'}",
            "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={apt / 'lists'}",
            f"-oDir::Cache={apt / 'cache'}",
        ]
        subprocess.run(["apt-get", "-q", *private, "update"], check=True, capture_output=True)
        # the orig tarball is all the tests need; a mirror missing the packaging files fails the rest
        subprocess.run(["apt-get", "-q", *private, "source", "--download-only", SOURCE_PACKAGE], cwd=cache,
                       capture_output=True)  # fmt: skip
        if not archive.is_file() or hashlib.md5(archive.read_bytes()).hexdigest() != SOURCE_MD5:
            archive.unlink(missing_ok=True)
            raise SystemExit(f"apt-get source {SOURCE_PACKAGE}: no {SOURCE} matching Debian's index")
    return archive


def _extract(archive: Path, cache: Path) -> Path:
    """The test files and the testdata scripts and adapters (not its C++ or its models)."""
    source = cache / "source"
    if not (source / "done").is_file():
        shutil.rmtree(source, ignore_errors=True)
        with tarfile.open(archive) as tar:
            wanted = [
                m
                for m in tar.getmembers()
                if m.isfile()
                and (
                    (m.name.startswith(TEST_DIR) and m.name.count("/") == TEST_DIR.count("/"))
                    or (m.name.startswith(TESTDATA_DIR) and m.name.endswith((".py", ".onnx_adapter")))
                )
            ]
            tar.extractall(source, members=wanted, filter="data")
        (source / "done").write_text("")
    return source


def _swap_imports(text: str) -> str:
    """`onnxruntime` to `quiver.ort` in import statements, and nothing else (strings, provider names stay)."""
    text = re.sub(r"^(\s*)import onnxruntime((?:\.\w+)*) as ", r"\1import quiver.ort\2 as ", text, flags=re.M)
    text = re.sub(r"^(\s*)from onnxruntime([. ])", r"\1from quiver.ort\2", text, flags=re.M)
    return re.sub(r"^(\s*)import onnxruntime$", r"\1import quiver.ort as onnxruntime", text, flags=re.M)


def _testdata(source: Path, folder: Path) -> Path:
    """The suites' test models: onnxruntime.datasets' three, `models.py`'s, and those ORT's scripts make."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "lora").mkdir(parents=True)
    data = source / TESTDATA_DIR
    import onnxruntime.datasets

    datasets = Path(onnxruntime.datasets.__file__).parent
    for name in ("mul_1.onnx", "sigmoid.onnx", "logreg_iris.onnx"):
        shutil.copy(datasets / name, folder / name)
    models.build_all(folder, folder / "mul_1.onnx")
    for script, arguments, output in GENERATORS:
        command = [sys.executable, str(data / script), *arguments] + ([output] if arguments else [])
        subprocess.run(command, cwd=folder, check=True, capture_output=True)
    lora = data / "lora"
    shutil.copy(lora / "two_params_lora_model.onnx_adapter", folder / "lora")
    subprocess.run(
        [sys.executable, "-c", "import two_params_lora_model as m; m.create_model('two_params_lora_model.onnx')"],
        cwd=lora,
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(lora)},
    )
    shutil.move(lora / "two_params_lora_model.onnx", folder / "lora" / "two_params_lora_model.onnx")
    return folder


SWAP = "import quiver.ort\nquiver.ort.install()\n"
VARIANTS = ("onnxruntime", "quiver.ort", "quiver.ort (swap)")


def _prepare(source: Path, testdata: Path, work: Path, extra: Path | None, variant: str) -> list[str]:
    """A folder with the suites (imports rewritten for quiver.ort, or a sitecustomize that swaps the
    module), helper.py and a copy of the test data; returns the suite files."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(testdata, work / "testdata")  # a copy: some tests write into it
    tests = source / TEST_DIR
    suites = [s for s in SUITES if (tests / s).is_file()]
    files = [tests / s for s in suites] + [tests / "helper.py"]
    if extra is not None:
        files += sorted(extra.glob("*.py"))
        suites += sorted(p.name for p in extra.glob("*.py") if p.name.startswith(("test_", "onnxruntime_test_")))
    for path in files:
        text = path.read_text()
        (work / path.name).write_text(_swap_imports(text) if variant == "quiver.ort" else text)
    (work / "onnx_mapping_shim").mkdir()
    (work / "onnx_mapping_shim" / "sitecustomize.py").write_text(SITECUSTOMIZE + (SWAP if "swap" in variant else ""))
    return suites


def _run(work: Path, suites: list[str]) -> tuple[dict[str, str], list[int]]:
    """pytest over each suite in `work` in a process of its own, as ORT's CI runs them (process-wide state,
    such as global thread pools, stays within its suite); returns {test id: passed|failed: message|skipped}
    and the suites' exit codes."""
    env = {**os.environ, "PYTHONPATH": f"{work / 'onnx_mapping_shim'}{os.pathsep}{work}"}
    outcomes: dict[str, str] = {}
    codes = []
    for suite in suites:
        report = work / f"{suite}.xml"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", suite],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        codes.append(done.returncode)
        if not report.is_file():
            continue
        for case in ET.parse(report).getroot().iter("testcase"):
            test = f"{case.get('classname')}::{case.get('name')}"
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is not None:
                message = (problem.get("message") or "").strip().splitlines()
                outcomes[test] = "failed: " + (message[0][:300] if message else "")
            elif case.find("skipped") is not None:
                outcomes[test] = "skipped"
            else:
                outcomes[test] = "passed"
    return outcomes, codes


PATHS_SCRIPT = """
import json, sys, warnings
import quiver.ort
warnings.simplefilter("ignore")
paths = {}
for name in sys.argv[1:]:
    try:
        session = quiver.ort.InferenceSession(name)
    except Exception as exc:
        paths[name] = f"refused: {type(exc).__name__}"
        continue
    path = session.execution_path
    paths[name] = "quiver" if path.on_quiver else f"onnxruntime: {path.reason}"
print(json.dumps(paths))
"""


def _paths(work: Path) -> dict[str, str]:
    """Which test models quiver.ort runs itself and which it hands to plain ORT (and why)."""
    names = sorted(str(p.relative_to(work)) for p in (work / "testdata").rglob("*.onnx"))
    done = subprocess.run(
        [sys.executable, "-c", PATHS_SCRIPT, *names], cwd=work, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-pass", type=float, default=0.0, help="fail below this share (0.9 = 90 %%)")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    parser.add_argument("--extra", type=Path, help="a folder of further test files to run in both")
    args = parser.parse_args()
    cache = _cache()
    source = _extract(_download(cache), cache)
    testdata = _testdata(source, cache / "work" / "testdata")
    results = {}
    for variant in VARIANTS:
        work = cache / "work" / variant.replace(" ", "-").strip("()")
        suites = _prepare(source, testdata, work, args.extra, variant)
        results[variant] = _run(work, suites)
    ort, ort_codes = results["onnxruntime"]
    baseline = sorted(t for t, outcome in ort.items() if outcome == "passed")
    summary: dict[str, object] = {
        "onnxruntime": __import__("onnxruntime").__version__,
        "tests_source": SOURCE,
        "passing_on_onnxruntime": len(baseline),
        "onnxruntime_exit_codes": ort_codes,
        "models": _paths(cache / "work" / "quiver.ort"),
        "failing_on_onnxruntime": {t: o for t, o in sorted(ort.items()) if o != "passed"},
    }
    failed = False
    for model, path in summary["models"].items():  # type: ignore[attr-defined]
        print(f"  {model}: {path}")
    for variant in VARIANTS[1:]:
        quiver, quiver_codes = results[variant]
        passing = [t for t in baseline if quiver.get(t) == "passed"]
        missing = {t: quiver.get(t, "not run") for t in baseline if quiver.get(t) != "passed"}
        crashed = any(code < 0 for code in quiver_codes)  # killed by a signal
        share = len(passing) / len(baseline) if baseline else 0.0
        suites: dict[str, dict[str, int]] = {}
        for test in baseline:
            counts = suites.setdefault(test.split("::")[0].split(".")[0], {"onnxruntime": 0, variant: 0})
            counts["onnxruntime"] += 1
            counts[variant] += quiver.get(test) == "passed"
        summary[variant] = {
            "also_passing": len(passing),
            "share": round(share, 4),
            "suites": suites,
            "exit_codes": quiver_codes,
            "crashed": crashed,
            "not_passing": missing,
        }
        for test, outcome in missing.items():
            print(f"  {variant} {outcome.split(':')[0]}: {test}: {outcome.partition(': ')[2]}")
        print(
            f"ORT {summary['onnxruntime']} API tests: {len(passing)}/{len(baseline)} of those passing on onnxruntime "
            f"pass on {variant} ({share:.1%}); {len(ort) - len(baseline)} fail or skip on onnxruntime itself"
        )
        if crashed:
            print(f"{variant}'s run crashed (exit codes {quiver_codes})")
        failed = failed or crashed or share < args.min_pass
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

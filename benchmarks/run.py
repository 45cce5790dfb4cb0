"""Quiver vs. ONNX Runtime on a transformer family made in-process: size, open-to-first-output, latency, memory.

    python benchmarks/run.py --json benchmarks/results/latest.json

Every ratio is measured side by side in one run. Open-to-first-output and memory run in fresh processes.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

import quiver
from quiver.testing.family import BENCH, make_family, sample_input_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accurate_int4 import measure_accurate_int4  # noqa: E402
from clients import measure_clients  # noqa: E402
from families import measure_families  # noqa: E402
from gguf_blocks import measure_gguf  # noqa: E402  (a sibling script, not a package; not `gguf`: that is the package)
from int4_profile import measure_int4_profile  # noqa: E402
from kv_memory import measure_kv_memory  # noqa: E402
from lm_eval_check import measure_lm_eval  # noqa: E402
from lora import measure_lora  # noqa: E402
from minilm_quantizers import measure_minilm_quantizers  # noqa: E402
from ort_api import measure_ort_api  # noqa: E402
from prefix_reuse import measure_prefix_reuse  # noqa: E402
from quantization import measure_quantization  # noqa: E402
from quantizers import measure_quantizers  # noqa: E402
from real_models import FLOOR_WORKER, floor_setup, measure_real_models  # noqa: E402
from real_size import measure_real_size  # noqa: E402
from serve import measure_serve  # noqa: E402
from serve_ray import measure_serve_ray, measure_serve_ray_defaults  # noqa: E402
from size_models import corpus as _corpus  # noqa: E402
from structured import measure_structured  # noqa: E402
from t2t import measure_t2t  # noqa: E402
from timing import alternating_medians  # noqa: E402
from tuning import measure_tuning  # noqa: E402
from wheel_models import measure_wheel_models  # noqa: E402

SEQ = 128
SHORT_SEQ = 16  # a short prompt: load time dominates the first output
BACKENDS = ("cpu", "cpu-noprepack")


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "quiver": quiver.__version__,
        "platform": platform.platform(),
    }


def _worker(code: str, *args: str) -> dict[str, Any]:
    """Runs `code` in a fresh interpreter; it prints one JSON line."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


_OPEN_WORKER = """
import json, sys, time
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper
import quiver
import quiver.backends.cpu.backend, quiver.runtime.context  # what opening needs, loaded before the clock as ORT is
kind, path, backend = sys.argv[1:4]
ids = np.load(sys.argv[4])
ort.set_default_logger_severity(3)
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
tiny = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "t", [x], [y]))
start = time.perf_counter()  # the same warm-up on both sides: ORT's runtime, one tiny session
ort.InferenceSession(tiny.SerializeToString()).run(None, {"x": np.ones(1, np.float32)})
env_ms = (time.perf_counter() - start) * 1e3
start = time.perf_counter()
if kind == "ort":
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    session.run(None, {"input_ids": ids})
else:
    context = quiver.Context.from_binary(path, backend=backend)
    context.graph("base").execute({"input_ids": ids})
print(json.dumps({"env_ms": env_ms, "open_first_ms": (time.perf_counter() - start) * 1e3}))
"""

_BUILD_WORKER = """
import json, sys
import quiver

def high_water_mark():  # VmHWM: peak RSS of this address space (ru_maxrss would include the parent's)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

before = high_water_mark()
context = quiver.Context.create("cpu", workdir=sys.argv[1])
for path in sys.argv[3:]:
    context.add_graph(path.rsplit("/", 1)[-1].removesuffix(".onnx"), path)
context.save(sys.argv[2])
print(json.dumps({"peak_rss_bytes": high_water_mark(), "rss_before_bytes": before}))
"""

_MEMORY_WORKER = """
import gc, json, sys
import numpy as np, onnxruntime as ort, psutil
import quiver
kind, backend, ids_path = sys.argv[1:4]
paths = sys.argv[4:]
ids = np.load(ids_path)
process = psutil.Process()
gc.collect()
rss = [process.memory_info().rss]
keep = []
if kind == "ort":
    for path in paths:
        keep.append(ort.InferenceSession(path, providers=["CPUExecutionProvider"]))
        keep[-1].run(None, {"input_ids": ids})
        gc.collect()
        rss.append(process.memory_info().rss)
else:
    context = quiver.Context.from_binary(paths[0], backend=backend)
    for name in context.graph_names:
        context.graph(name).execute({"input_ids": ids})
        context.wait_until_ready()
        gc.collect()
        rss.append(process.memory_info().rss)
print(json.dumps({"rss": rss}))
"""


def build_family(folder: Path, count: int) -> tuple[dict[str, Path], Path, float]:
    family = make_family(BENCH, count=count, tuned_layers=1, seed=0)
    paths = {}
    for name, model in family.items():
        paths[name] = folder / f"{name}.onnx"
        onnx.save(model, str(paths[name]))
    del family
    start = time.perf_counter()
    context = quiver.Context.create("cpu", workdir=folder)
    for name, path in paths.items():
        context.add_graph(name, path)
    qctx = context.save(folder / "family.qctx")
    context.close()
    return paths, qctx, time.perf_counter() - start


def measure_build_memory(paths: dict[str, Path], folder: Path) -> dict[str, Any]:
    """Peak RSS of building the whole family from its files, in a fresh process: bounded by one model."""
    result = _worker(_BUILD_WORKER, str(folder), str(folder / "rebuilt.qctx"), *map(str, paths.values()))
    largest = max(p.stat().st_size for p in paths.values())
    result["largest_model_bytes"] = largest
    result["family_bytes"] = sum(p.stat().st_size for p in paths.values())
    result["peak_over_largest_model"] = (result["peak_rss_bytes"] - result["rss_before_bytes"]) / largest
    (folder / "rebuilt.qctx").unlink()
    return result


def measure_size(paths: dict[str, Path], qctx: Path) -> dict[str, Any]:
    with quiver.Context.from_binary(qctx, backend="reference") as context:
        stats = context.weight_stats()
    separate = sum(p.stat().st_size for p in paths.values())
    size = qctx.stat().st_size
    return {
        "graphs": len(paths),
        "context_bytes": size,
        "unique_weight_bytes": stats.unique_bytes,
        "referenced_weight_bytes": stats.referenced_bytes,
        "separate_onnx_bytes": separate,
        "context_over_unique": size / stats.unique_bytes,
        "context_over_separate": size / separate,
    }


def measure_open(base: Path, qctx: Path, ids_path: Path, repeats: int) -> dict[str, Any]:
    case = {"input_ids": np.load(ids_path)}
    npz = ids_path.with_suffix(".npz")
    np.savez(npz, **case)
    floor = floor_setup(qctx, "base", case)
    runs: dict[str, list[dict[str, Any]]] = {"ort": [], **{b: [] for b in BACKENDS}, "ort_floor": []}
    for _ in range(repeats):  # interleaved, so drift hits every variant alike
        runs["ort"].append(_worker(_OPEN_WORKER, "ort", str(base), "-", str(ids_path)))
        for backend in BACKENDS:
            runs[backend].append(_worker(_OPEN_WORKER, "quiver", str(qctx), backend, str(ids_path)))
        runs["ort_floor"].append(_worker(FLOOR_WORKER, str(floor), str(npz), "-"))
    ort_ms = statistics.median(r["open_first_ms"] for r in runs["ort"])
    env_ms = statistics.median(r["env_ms"] for group in runs.values() for r in group if "env_ms" in r)
    result: dict[str, Any] = {"repeats": repeats, "ort_ms": ort_ms, "runtime_warm_up_ms": env_ms}
    floor_ms = statistics.median(r["open_first_ms"] for r in runs["ort_floor"])
    # ORT's own share of the cpu backend's open (see real_models.FLOOR_WORKER): the least it can take
    result["ort_floor"] = {"ms": floor_ms, "ratio_to_ort": floor_ms / ort_ms}
    for backend in BACKENDS:
        ms = statistics.median(r["open_first_ms"] for r in runs[backend])
        result[backend] = {
            "ms": ms,
            "ratio_to_ort": ms / ort_ms,
            "ratio_to_ort_including_warm_up": (ms + env_ms) / (ort_ms + env_ms),
        }
    return result


def measure_latency(base: Path, qctx: Path, ids: np.ndarray, rounds: int, iterations: int) -> dict[str, Any]:
    session = ort.InferenceSession(str(base), providers=["CPUExecutionProvider"])
    contexts = {b: quiver.Context.from_binary(qctx, backend=b) for b in BACKENDS}
    graphs = {b: context.graph("base") for b, context in contexts.items()}
    feeds = {"input_ids": ids}
    reference = session.run(None, feeds)[0]
    for backend, graph in graphs.items():  # warm-up, and the outputs must agree
        np.testing.assert_allclose(graph.execute(feeds)["last_hidden_state"], reference, atol=1e-4, rtol=0)
        contexts[backend].wait_until_ready()  # steady state: weights packed
    timed = {"ort": lambda: session.run(None, feeds), **{b: lambda g=g: g.execute(feeds) for b, g in graphs.items()}}
    samples = alternating_medians(timed, rounds, iterations)
    ort_ms = statistics.median(samples["ort"])
    result: dict[str, Any] = {"batch": int(ids.shape[0]), "sequence": int(ids.shape[1]), "ort_ms": ort_ms}
    for backend in BACKENDS:
        ms = statistics.median(samples[backend])
        result[backend] = {"ms": ms, "ratio_to_ort": ms / ort_ms}
    return result


def measure_memory(paths: dict[str, Path], qctx: Path, ids_path: Path, counts: tuple[int, ...]) -> dict[str, Any]:
    unique_per_added = None
    with quiver.Context.from_binary(qctx, backend="reference") as context:
        file = context.file
        names = context.graph_names
        base = set(file.graphs[names[0]].weights.values())
        added = set(file.graphs[names[1]].weights.values()) - base
        unique_per_added = sum(file.weights[i].length for i in added)
        full_graph = sum(file.weights[i].length for i in base)
    result: dict[str, Any] = {"unique_bytes_per_added_graph": unique_per_added, "full_graph_weight_bytes": full_graph}
    for label, kind, backend in (("ort", "ort", "-"), *((b, "quiver", b) for b in BACKENDS)):
        rows = {}
        for count in counts:
            if kind == "ort":
                args = [str(p) for p in list(paths.values())[:count]]
            else:  # a context of the family's first `count` graphs
                args = [str(_subset_context(paths, count, qctx.parent / f"first{count}.qctx"))]
            rss = _worker(_MEMORY_WORKER, kind, backend, str(ids_path), *args)["rss"]
            growth = [b - a for a, b in zip(rss, rss[1:])]
            rows[str(count)] = {
                "rss_bytes": rss[-1],
                "rss_growth_bytes": rss[-1] - rss[0],
                "first_graph_bytes": growth[0],
                "per_added_graph_bytes": statistics.mean(growth[1:]) if len(growth) > 1 else None,
            }
        result[label] = rows
    return result


_SUBSETS: dict[int, Path] = {}


def _subset_context(paths: dict[str, Path], count: int, target: Path) -> Path:
    if count not in _SUBSETS:
        context = quiver.Context.create("cpu", workdir=target.parent)
        for name, path in list(paths.items())[:count]:
            context.add_graph(name, path)
        _SUBSETS[count] = context.save(target)
        context.close()
    return _SUBSETS[count]


def _size_models() -> tuple[Path, Path]:
    """Where the real-shape random-weight models are kept (benchmarks/size_models.py), and the tokenizer
    they are given."""
    return Path.home() / ".cache" / "quiver" / "size-models", _corpus("llms") / "smollm2" / "tokenizer.json"


SECTIONS = (
    "family",
    "real_models",
    "wheel_models",
    "lora_sections",
    "quantization",
    "minilm_quantizers",
    "ort_api",
    "t2t",
    "gguf",
    "families",
    "real_size",
    "accurate_int4",
    "prefix_reuse",
    "structured",
    "lm_eval",
    "clients",
    "kv_memory",
    "quantizers",
    "int4_profile",
    "serve",
    "serve_ray",
    "serve_ray_defaults",
    "tuning",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/latest.json"))
    parser.add_argument("--graphs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7, help="fresh processes per open-to-first-output variant")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved latency rounds")
    parser.add_argument("--iterations", type=int, default=20, help="runs per latency round")
    parser.add_argument(
        "--only",
        choices=SECTIONS,
        action="append",
        help="measure only these sections and update them in the --json file (repeatable); default: all",
    )
    args = parser.parse_args()
    ort.set_default_logger_severity(3)
    # Fresh processes import Quiver as an installed package does: from bytecode compiled ahead (pip
    # compiles at install; an editable checkout, run where PYTHONDONTWRITEBYTECODE is set, would
    # otherwise compile every module in every process, ~35 ms measured).
    compileall.compile_dir(Path(quiver.__file__).parent, quiet=1)
    sections = set(args.only or SECTIONS)
    report: dict[str, Any] = {}
    if args.only and args.json.exists():
        report = json.loads(args.json.read_text())  # the other sections keep their last measured values

    with tempfile.TemporaryDirectory(prefix="quiver-bench-") as tmp:
        folder = Path(tmp)
        report["machine"] = _machine()
        report["command"] = "python benchmarks/run.py " + " ".join(sys.argv[1:])
        if "family" in sections:
            print(f"building a {args.graphs}-graph family in {folder} ...", file=sys.stderr)
            paths, qctx, build_s = build_family(folder, args.graphs)
            ids = sample_input_ids(BENCH, batch=1, seq=SEQ)
            ids_path = folder / "ids.npy"
            np.save(ids_path, ids)
            report["model"] = {"shape": vars(BENCH), "input": [1, SEQ]}
            report["build_seconds"] = build_s
            print("size ...", file=sys.stderr)
            report["size"] = measure_size(paths, qctx)
            report["build_memory"] = measure_build_memory(paths, folder)
            print("open to first output ...", file=sys.stderr)
            report["open_to_first_output"] = measure_open(paths["base"], qctx, ids_path, args.repeats)
            short_ids_path = folder / "short_ids.npy"
            np.save(short_ids_path, sample_input_ids(BENCH, batch=1, seq=SHORT_SEQ))
            report["open_to_first_output_short_input"] = measure_open(paths["base"], qctx, short_ids_path, args.repeats)
            report["open_to_first_output_short_input"]["input"] = [1, SHORT_SEQ]
            print("steady-state latency ...", file=sys.stderr)
            report["latency"] = measure_latency(paths["base"], qctx, ids, args.rounds, args.iterations)
            print("memory ...", file=sys.stderr)
            counts = tuple(c for c in (1, 4, 16) if c <= args.graphs)
            report["memory"] = measure_memory(paths, qctx, ids_path, counts)
        if "real_models" in sections:
            corpus = _corpus()
            print("real models ...", file=sys.stderr)
            report["real_models"] = measure_real_models(folder, corpus, args.repeats)
        if "wheel_models" in sections:
            corpus = _corpus("wheels")
            print("wheel models ...", file=sys.stderr)
            report["wheel_models"] = measure_wheel_models(corpus, args.rounds, args.iterations)
        if "lora_sections" in sections:
            print("adapter switching ...", file=sys.stderr)
            report["lora_sections"] = measure_lora(folder)
        if "quantization" in sections:
            print("quantization ...", file=sys.stderr)
            report["quantization"] = measure_quantization(folder)
        if "ort_api" in sections:
            print("quiver.ort sessions ...", file=sys.stderr)
            ort_ids = folder / "ort_ids.npy"
            np.save(ort_ids, sample_input_ids(BENCH, batch=1, seq=SEQ))
            report["ort_api"] = measure_ort_api(folder, ort_ids, args.repeats)
        if "t2t" in sections:
            corpus = _corpus("llms")
            print("text generation ...", file=sys.stderr)
            report["t2t"] = measure_t2t(folder, corpus, rounds=15)
        if "gguf" in sections:
            print("a GGUF file's blocks ...", file=sys.stderr)
            report["gguf"] = measure_gguf(folder, _corpus("llms"), _corpus("families"), rounds=args.rounds)
        if "families" in sections:
            corpus = _corpus("families")
            quiver_cache = Path.home() / ".cache" / "quiver"
            print("every family beside onnxruntime-genai ...", file=sys.stderr)
            report["families"] = measure_families(
                folder,
                corpus,
                quiver_cache / "export-venv" / "bin" / "python",
                quiver_cache / "genai-families" / corpus.name,
                rounds=args.rounds,
            )
        if "kv_memory" in sections:
            print("serving memory that follows the tokens ...", file=sys.stderr)
            report["kv_memory"] = measure_kv_memory(folder, _corpus("llms"))
        if "real_size" in sections:
            print("models of real size ...", file=sys.stderr)
            venv = Path.home() / ".cache" / "quiver" / "export-venv" / "bin" / "python"
            report["real_size"] = measure_real_size(folder, *_size_models(), venv)
        if "clients" in sections:
            print("the clients people use, against quiver serve ...", file=sys.stderr)
            report["clients"] = measure_clients(folder, _corpus("llms"))
        if "prefix_reuse" in sections:
            print("prefix reuse in quiver serve ...", file=sys.stderr)
            report["prefix_reuse"] = measure_prefix_reuse(folder, _corpus("llms"))
        if "lm_eval" in sections:
            print("lm-eval against quiver serve and against transformers ...", file=sys.stderr)
            report["lm_eval"] = measure_lm_eval(folder, _corpus("llms"))
        if "structured" in sections:
            print("structured outputs in quiver serve ...", file=sys.stderr)
            report["structured"] = measure_structured(folder, _corpus("llms"))
        if "accurate_int4" in sections:
            print("accurate 4-bit at 1B ...", file=sys.stderr)
            report["accurate_int4"] = measure_accurate_int4(folder, *_size_models())
        if "minilm_quantizers" in sections:
            corpus = _corpus()
            print("4-bit quantizers on MiniLM ...", file=sys.stderr)
            report["minilm_quantizers"] = measure_minilm_quantizers(corpus)
        if "quantizers" in sections:
            corpus = _corpus("llms")
            print("4-bit quantizers ...", file=sys.stderr)
            report["quantizers"] = measure_quantizers(folder, corpus)
        if "int4_profile" in sections:
            corpus = _corpus("llms")
            print("int4 decode profile ...", file=sys.stderr)
            report["int4_profile"] = measure_int4_profile(folder, corpus)
        if "serve" in sections:
            corpus = _corpus("llms")
            print("serving ...", file=sys.stderr)
            report["serve"] = measure_serve(folder, corpus)
        if "serve_ray" in sections:
            corpus = _corpus("llms")
            print("serving on Ray ...", file=sys.stderr)
            report["serve_ray"] = measure_serve_ray(folder, corpus)
        if "serve_ray_defaults" in sections:
            corpus = _corpus("llms")
            print("serving on Ray at its default settings ...", file=sys.stderr)
            report["serve_ray_defaults"] = measure_serve_ray_defaults(folder, corpus)
        if "tuning" in sections:
            models = _corpus()
            llms = _corpus("llms")
            print("tuning ...", file=sys.stderr)
            report["tuning"] = measure_tuning(folder, models, llms)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

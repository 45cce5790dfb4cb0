"""Real exports with real weights (the test corpus of tests/real/make_models.py): MiniLM-L6 (BERT encoder,
dynamic and fixed shapes, a16w8, a16w4), its fine-tune, and SmolLM2's first layers (Llama decoder). Quiver
against ONNX Runtime on the same files, side by side: open-to-first-output (in a warm process and counting
imports in a fresh one), steady latency, context size against unique weights, RSS per added fine-tune."""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

import quiver
import quiver.ort
from timing import alternating_medians

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the corpus helpers live with the tests
from tests.real.corpus import OUTPUTS, quantize_minilm  # noqa: E402

# What every open worker runs before its clock starts: ORT's runtime and one tiny session.
_WARM_UP = """from onnx import TensorProto, helper
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
tiny = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "t", [x], [y]))
ort.InferenceSession(tiny.SerializeToString()).run(None, {"x": np.ones(1, np.float32)})
"""

# One fresh interpreter per measurement. It times its imports, then (after _WARM_UP, the same on both sides)
# the open and the first output.
_OPEN_WORKER = """
import json, sys, time
start = time.perf_counter()
import numpy as np
kind, path, graph, npz, output = sys.argv[1:6]
if kind == "ort":
    import onnxruntime as ort
elif kind == "quiver_ort":
    import quiver.ort
    import quiver.ort.engine_quiver  # what its first session needs (imported lazily by quiver.ort)
    import onnxruntime as ort
else:
    import quiver
    import quiver.backends.cpu.backend, quiver.runtime.context  # what opening needs (imported lazily by quiver)
    import onnxruntime as ort
imports_ms = (time.perf_counter() - start) * 1e3
case = dict(np.load(npz)); case.pop(output)
{warm_up}start = time.perf_counter()
if kind == "ort":
    ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, case)
elif kind == "quiver_ort":  # an EPContext model: its context opened through the ORT-shaped API
    quiver.ort.InferenceSession(path).run(None, case)
else:
    quiver.Context.from_binary(path).graph(graph).execute(case)
print(json.dumps({"imports_ms": imports_ms, "open_first_ms": (time.perf_counter() - start) * 1e3}))
import os; os._exit(0)  # the background packing thread is not part of what is measured
""".replace("{warm_up}", _WARM_UP)

_RSS_WORKER = """
import gc, json, sys
import numpy as np, psutil, quiver
path, npz = sys.argv[1:3]
case = dict(np.load(npz)); case.pop("last_hidden_state")
process = psutil.Process()
context = quiver.Context.from_binary(path)
rss = []
for name in context.graph_names:
    context.graph(name).execute(case)
    context.wait_until_ready()
    gc.collect()
    rss.append(process.memory_info().rss)
print(json.dumps({"rss": rss}))
"""

# Anonymous memory (RssAnon: not the mapped weights) the added graph holds in steady use: the base graph
# runs 20 times first, then the added one's growth is read after its 1st and its 20th run.
_ANON_WORKER = """
import json, sys
import numpy as np, quiver
path, npz = sys.argv[1:3]
case = dict(np.load(npz)); case.pop("last_hidden_state")
def anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon"))
context = quiver.Context.from_binary(path)
base, added = context.graph_names
for _ in range(20):
    context.graph(base).execute(case)
context.wait_until_ready()
before = anon()
growth = {}
for run in range(1, 21):
    context.graph(added).execute(case)
    if run == 1:
        growth["after_1_run"] = anon() - before
context.wait_until_ready()
context.graph(added).execute(case)
growth["after_20_runs"] = anon() - before
print(json.dumps(growth))
import os; os._exit(0)
"""


# ORT's own share of Quiver's open: the same session Quiver makes first (its model, settings and weights,
# captured from a Quiver open by `floor_setup`) made and run directly, over weights mapped from the
# context. What Quiver adds (reading the header, parsing the graph, choosing the prepared form, the
# store) is left out, so this is the least any Quiver open can take on this ORT.
FLOOR_WORKER = """
import json, mmap, sys, time, types
start = time.perf_counter()
import numpy as np
import onnxruntime as ort
from quiver.backends.cpu import CpuBackend, SessionSettings, sessions, weights as cpu_weights
imports_ms = (time.perf_counter() - start) * 1e3
plan_path, npz, output = sys.argv[1:4]
plan = json.loads(open(plan_path).read())
case = {k: v for k, v in np.load(npz).items() if k != output}
{warm_up}start = time.perf_counter()
with open(plan["context"], "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
def views(entries):
    count = lambda shape: int(np.prod(shape, dtype=np.int64))
    return {n: np.frombuffer(mapped, d, count(s), o).reshape(s) for n, (o, d, s) in entries.items()}
with open(plan["model"], "rb") as f:
    weights = cpu_weights.SessionWeights(f.read(), views(plan["shared"]), views(plan["readable"]), plan["folder"], None)
session = sessions.create_session(
    types.SimpleNamespace(name=plan["graph"]), weights, SessionSettings(**plan["settings"]), CpuBackend().container,
    **plan["how"],
)
session.run(plan["outputs"], case, {}, {})
print(json.dumps({"imports_ms": imports_ms, "open_first_ms": (time.perf_counter() - start) * 1e3}))
import os; os._exit(0)
""".replace("{warm_up}", _WARM_UP)


def floor_setup(qctx: Path, graph: str, case: dict[str, np.ndarray]) -> Path:
    """The first session Quiver makes for `graph` (captured from one open on `case`), as a plan for
    FLOOR_WORKER: its model bytes in a file, and where each of its weights lies in the context."""
    from quiver.backends.cpu import sessions

    captured: list[tuple[Any, ...]] = []
    create = sessions.create_session

    def capture(graph_: Any, weights: Any, settings: Any, container: Any, **how: Any) -> Any:
        captured.append((weights, settings, how))
        return create(graph_, weights, settings, container, **how)

    sessions.create_session = capture  # type: ignore[assignment]
    try:
        with quiver.Context.from_binary(qctx) as context:
            context.graph(graph).execute(case)
            weights, settings, how = captured[0]
            base = np.frombuffer(context.file._buffer, np.uint8).ctypes.data

            size = context.file.size

            def where(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
                entries = {n: (a.ctypes.data - base, a.dtype.str, list(a.shape)) for n, a in arrays.items()}
                if any(not 0 <= offset < size for offset, _, _ in entries.values()):
                    raise RuntimeError(f"{graph}: a weight of its first session is not mapped from the context")
                return entries

            plan = {
                "context": str(qctx),
                "graph": graph,
                "model": str(qctx.with_suffix(".floor.onnx")),
                "shared": where(weights.shared),
                "readable": where(weights.readable),
                "folder": weights.folder,
                "settings": dataclasses.asdict(settings),
                "how": how,
                "outputs": [o.name for o in context.graph(graph).outputs],
            }
    finally:
        sessions.create_session = create  # type: ignore[assignment]
    Path(plan["model"]).write_bytes(weights.model)
    path = qctx.with_suffix(".floor.json")
    path.write_text(json.dumps(plan))
    return path


def _worker(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _context(folder: Path, name: str, sources: dict[str, Path], prepare_ahead: bool = True, **add: Any) -> Path:
    context = quiver.Context.create("cpu", workdir=folder)
    for graph, source in sources.items():
        context.add_graph(graph, source, **add)
    path = context.save(folder / f"{name}.qctx", prepare_ahead=prepare_ahead)
    context.close()
    return path


def _ep_context(folder: Path, model: Path) -> Path:
    """The EPContext model (`<name>_ctx.onnx` + `.qctx`) quiver.ort writes with ep.context_enable=1."""
    options = quiver.ort.SessionOptions()
    target = folder / "ep_context" / f"{model.stem}_ctx.onnx"
    options.add_session_config_entry("ep.context_enable", "1")
    options.add_session_config_entry("ep.context_file_path", str(target))
    quiver.ort.InferenceSession(str(model), options).close()
    return target


def _open(
    model: Path, qctx: Path, graph: str, npz: Path, output: str, repeats: int, kind: str = "quiver"
) -> dict[str, Any]:
    floor = None
    if kind == "quiver":  # the EPContext row opens through quiver.ort: no floor of its own
        floor = floor_setup(qctx, graph, {k: v for k, v in np.load(npz).items() if k != output})
    runs: dict[str, list[dict[str, Any]]] = {"ort": [], "quiver": [], "ort_floor": []}
    for _ in range(repeats):  # interleaved: drift hits all alike
        runs["ort"].append(_worker(_OPEN_WORKER, "ort", str(model), graph, str(npz), output))
        runs["quiver"].append(_worker(_OPEN_WORKER, kind, str(qctx), graph, str(npz), output))
        if floor is not None:
            runs["ort_floor"].append(_worker(FLOOR_WORKER, str(floor), str(npz), output))
    median = {
        k: {m: statistics.median(r[m] for r in v) for m in ("imports_ms", "open_first_ms")}
        for k, v in runs.items()
        if v
    }
    fresh = {k: v["imports_ms"] + v["open_first_ms"] for k, v in median.items()}
    result = {
        "ort": median["ort"],
        "quiver": median["quiver"],
        "ratio_to_ort": median["quiver"]["open_first_ms"] / median["ort"]["open_first_ms"],
        "ratio_to_ort_fresh_process": fresh["quiver"] / fresh["ort"],
    }
    if floor is not None:
        # the floor in a fresh process: ORT's own imports (numpy and onnxruntime), which any open on ORT needs
        result["ort_floor"] = {
            "open_first_ms": median["ort_floor"]["open_first_ms"],
            "ratio_to_ort": median["ort_floor"]["open_first_ms"] / median["ort"]["open_first_ms"],
            "ratio_to_ort_fresh_process": (median["ort"]["imports_ms"] + median["ort_floor"]["open_first_ms"])
            / fresh["ort"],
        }
    return result


def _latency(
    model: Path, qctx: Path, graph: str, feeds: dict[str, np.ndarray], rounds: int, iterations: int
) -> dict[str, Any]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    context = quiver.Context.from_binary(qctx)
    ours = context.graph(graph)
    ours.execute(feeds)
    context.wait_until_ready()
    samples = alternating_medians(
        {"ort": lambda: session.run(None, feeds), "quiver": lambda: ours.execute(feeds)}, rounds, iterations, warm_up=2
    )
    context.close()
    ratios = [q / o for q, o in zip(samples["quiver"], samples["ort"])]
    return {
        "ort_ms": statistics.median(samples["ort"]),
        "quiver_ms": statistics.median(samples["quiver"]),
        "ratio_to_ort": statistics.median(ratios),
    }


def measure_real_models(
    folder: Path, corpus: Path, repeats: int, rounds: int = 7, iterations: int = 20
) -> dict[str, Any]:
    npz = {name: corpus / f"{name}.npz" for name in OUTPUTS}
    feeds = {}
    for name in OUTPUTS:
        case = dict(np.load(npz[name]))
        case.pop(OUTPUTS[name])
        feeds[name] = case
    shape = list(feeds["minilm"]["input_ids"].shape)
    quantized = quantize_minilm(corpus, folder)
    fixed = {"input_shapes": {"input_ids": shape, "attention_mask": shape}}
    models = {  # row: (source .onnx, corpus case, how the context is built)
        "minilm": (corpus / "minilm.onnx", "minilm", {}),
        "minilm_fixed_shape": (corpus / "minilm.onnx", "minilm", fixed),
        "minilm_a16w8": (quantized["a16w8"], "minilm", {}),
        "minilm_a16w4": (quantized["a16w4"], "minilm", {}),
        "smollm": (corpus / "smollm.onnx", "smollm", {}),
    }  # fmt: skip
    rows: dict[str, Any] = {}
    for row, (source, case, add) in models.items():
        print(f"  {row} ...", file=sys.stderr)
        qctx = _context(folder, row, {row: source}, **add)
        output = OUTPUTS[case]
        entry: dict[str, Any] = {
            "input": list(feeds[case]["input_ids"].shape),
            "open_to_first_output": _open(source, qctx, row, npz[case], output, repeats),
            "latency": _latency(source, qctx, row, feeds[case], rounds, iterations),
        }
        with quiver.Context.from_binary(qctx) as context:
            entry["context_over_unique_weights"] = qctx.stat().st_size / context.weight_stats().unique_bytes
        if "a16" in row:
            entry["context_over_float_weights"] = qctx.stat().st_size / (corpus / "minilm.onnx.data").stat().st_size
        rows[row] = entry
    # the same context without ONNX Runtime's prepared form (format 1.6): what preparing ahead saves
    portable = _context(folder, "minilm_portable", {"minilm": corpus / "minilm.onnx"}, prepare_ahead=False)
    rows["minilm_without_prepared_form"] = {
        "input": list(feeds["minilm"]["input_ids"].shape),
        "open_to_first_output": _open(
            corpus / "minilm.onnx", portable, "minilm", npz["minilm"], OUTPUTS["minilm"], repeats
        ),
    }
    rows["minilm_ep_context_reopen"] = {
        "input": list(feeds["minilm"]["input_ids"].shape),
        "open_to_first_output": _open(
            corpus / "minilm.onnx", _ep_context(folder, corpus / "minilm.onnx"), "minilm", npz["minilm"],
            OUTPUTS["minilm"], repeats, kind="quiver_ort",
        ),
    }  # fmt: skip
    pair = _context(folder, "pair", {"minilm": corpus / "minilm.onnx", "minilm_tuned": corpus / "minilm_tuned.onnx"})
    with quiver.Context.from_binary(pair) as context:
        stats = context.weight_stats()
        file = context.file
        base = set(file.graphs["minilm"].weights.values())
        added = sum(file.weights[i].length for i in set(file.graphs["minilm_tuned"].weights.values()) - base)
    rss = _worker(_RSS_WORKER, str(pair), str(npz["minilm"]))["rss"]
    rows["fine_tune_pair"] = {
        "context_bytes": pair.stat().st_size,
        "unique_weight_bytes": stats.unique_bytes,
        "referenced_weight_bytes": stats.referenced_bytes,
        "context_over_unique": pair.stat().st_size / stats.unique_bytes,
        "unique_bytes_of_added_graph": added,
        "rss_growth_of_added_graph": rss[1] - rss[0],
        "rss_over_unique_of_added_graph_mb": (rss[1] - rss[0] - added) / 1e6,
    }
    anon = _worker(_ANON_WORKER, str(pair), str(npz["minilm"]))
    rows["fine_tune_pair"].update(
        {f"anon_growth_of_added_graph_{k}": v for k, v in anon.items()}
        | {"anon_over_unique_of_added_graph_after_20_runs_mb": (anon["after_20_runs"] - added) / 1e6}
    )
    return rows

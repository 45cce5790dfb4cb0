"""`quiver.ort`: opening an EPContext model vs. the source `.onnx`, and RSS of four sessions over one context.

Every measurement runs in a fresh interpreter, interleaved, as the open-to-first-output ones in run.py do.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx

import quiver
import quiver.ort
from quiver.ort.epcontext import wrap_context
from quiver.testing.family import BENCH, make_family

_OPEN = """
import json, sys, time
import numpy as np
import onnxruntime
import quiver.ort
kind, path, ids_path = sys.argv[1:4]
ids = np.load(ids_path)
onnxruntime.set_default_logger_severity(3)
module = onnxruntime if kind == "onnxruntime" else quiver.ort
start = time.perf_counter()
session = module.InferenceSession(path)
session.run(None, {"input_ids": ids})
print(json.dumps({"ms": (time.perf_counter() - start) * 1e3}))
"""

_MEMORY = """
import gc, json, sys
import numpy as np, onnxruntime, psutil
import quiver.ort
kind, ids_path = sys.argv[1:3]
paths = sys.argv[3:]
ids = np.load(ids_path)
onnxruntime.set_default_logger_severity(3)
process = psutil.Process()
gc.collect()
before = process.memory_info().rss
sessions = []
for path in paths:
    if kind == "onnxruntime":
        session = onnxruntime.InferenceSession(path)
    else:
        options = quiver.ort.SessionOptions()
        if kind == "shared":
            options.add_session_config_entry("ep.share_ep_contexts", "1")
        session = quiver.ort.InferenceSession(path, options)
    session.run(None, {"input_ids": ids})
    sessions.append(session)
for session in sessions:  # packed sessions are in place (the cpu backend packs in the background)
    context = getattr(session, "_context", None)
    if context is not None:
        context.wait_until_ready()
gc.collect()
print(json.dumps({"rss_growth_bytes": process.memory_info().rss - before}))
"""


def _worker(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_ort_api(folder: Path, ids_path: Path, repeats: int = 5) -> dict[str, Any]:
    family = make_family(BENCH, count=4, tuned_layers=1, seed=0)
    sources = []
    for name, model in family.items():
        sources.append(folder / f"ort_{name}.onnx")
        onnx.save(model, str(sources[-1]))
    del family
    # ep.context_enable on the first model: <model>_ctx.onnx + .qctx
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("ep.context_enable", "1")
    quiver.ort.InferenceSession(str(sources[0]), options).close()
    cached = sources[0].with_name(sources[0].stem + "_ctx.onnx")

    runs: dict[str, list[float]] = {"onnxruntime_source": [], "quiver_ort_source": [], "quiver_ort_ctx": []}
    for _ in range(repeats):
        runs["onnxruntime_source"].append(_worker(_OPEN, "onnxruntime", str(sources[0]), str(ids_path))["ms"])
        runs["quiver_ort_source"].append(_worker(_OPEN, "quiver", str(sources[0]), str(ids_path))["ms"])
        runs["quiver_ort_ctx"].append(_worker(_OPEN, "quiver", str(cached), str(ids_path))["ms"])
    opened = {k: statistics.median(v) for k, v in runs.items()}

    # four graphs in one context, wrapped: one _ctx.onnx per graph
    context = quiver.Context.create("cpu", workdir=folder)
    for index, path in enumerate(sources):
        context.add_graph(f"g{index}", path)
    qctx = context.save(folder / "ort_four.qctx")
    context.close()
    wrapped = [str(p) for p in wrap_context(qctx, folder / "wrapped")]
    memory = {
        "onnxruntime_4_sources": _worker(_MEMORY, "onnxruntime", str(ids_path), *map(str, sources)),
        "quiver_ort_4_wrapped_shared": _worker(_MEMORY, "shared", str(ids_path), *wrapped),
        "quiver_ort_4_wrapped_unshared": _worker(_MEMORY, "unshared", str(ids_path), *wrapped),
    }
    with quiver.Context.from_binary(qctx, backend="reference") as opened_context:
        stats = opened_context.weight_stats()
    return {
        "repeats": repeats,
        "open_to_first_output_ms": opened,
        "ctx_over_source_same_api": opened["quiver_ort_ctx"] / opened["quiver_ort_source"],
        "ctx_over_onnxruntime_source": opened["quiver_ort_ctx"] / opened["onnxruntime_source"],
        "rss_growth_bytes": {k: v["rss_growth_bytes"] for k, v in memory.items()},
        "unique_weight_bytes_4_graphs": stats.unique_bytes,
        "weight_bytes_one_graph": sources[0].stat().st_size,
    }

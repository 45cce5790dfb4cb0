"""The wheel corpus (OCR, detection, audio models as their wheels ship them) on quiver.ort and on ORT, side
by side: session creation, steady latency, and the cost of importing each module."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import onnxruntime as ort

import quiver.ort
from quiver.ort.context_cache import CACHE_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.real.wheel_corpus import MODELS, feeds  # noqa: E402

from timing import alternating_medians  # noqa: E402

THREADS = 2  # the same intra-op thread count on both sides
_IMPORT = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def _options(module: Any) -> Any:
    options = module.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.log_severity_level = 3
    return options


def _session(module: Any, path: Path, kept_in: str = "off") -> Any:
    """A session; for quiver.ort, with its kept contexts in `kept_in` ("off": every session builds its own)."""
    os.environ[CACHE_ENV] = kept_in
    return module.InferenceSession(str(path), _options(module), providers=["CPUExecutionProvider"])


def measure_import(repeats: int) -> dict[str, float]:
    """Median seconds each import takes in a fresh process (numpy loaded by both), the order turning."""
    samples: dict[str, list[float]] = {"onnxruntime": [], "quiver.ort": []}
    for round_ in range(repeats):
        for module in list(samples) if round_ % 2 == 0 else list(samples)[::-1]:
            code = "import numpy; " + _IMPORT.format(module=module)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            samples[module].append(float(out.strip().splitlines()[-1]))
    return {f"{module}_ms": statistics.median(s) * 1e3 for module, s in samples.items()}


def measure_wheel_models(corpus: Path, rounds: int, iterations: int) -> dict[str, Any]:
    rows = {}
    kept_in = tempfile.mkdtemp(prefix="quiver-bench-kept-")
    for name in MODELS:
        path = corpus / f"{name}.onnx"
        _session(quiver.ort, path, kept_in).close()  # kept for the "kept" candidate
        makers = {
            "ort": partial(_session, ort, path),
            "quiver": partial(_session, quiver.ort, path),  # builds the context from the .onnx
            "quiver_kept": partial(_session, quiver.ort, path, kept_in),  # maps the context kept before
        }
        created = alternating_medians(makers, rounds, 3)
        theirs, ours = makers["ort"](), makers["quiver"]()
        inputs = feeds(name, theirs.get_inputs())
        for session in (theirs, ours):  # the first runs (Quiver packs its weights after its first)
            for _ in range(3):
                session.run(None, inputs)
        runs = {"ort": partial(theirs.run, None, inputs), "quiver": partial(ours.run, None, inputs)}
        latency = alternating_medians(runs, rounds, iterations, warm_up=2)
        create = {k: statistics.median(v) for k, v in created.items()}
        os.environ[CACHE_ENV] = "off"
        run = {k: statistics.median(v) for k, v in latency.items()}
        rows[name] = {
            "path": ours.execution_path.engine,
            "create_ms": create,
            "create_ratio": create["quiver"] / create["ort"],
            "create_kept_ratio": create["quiver_kept"] / create["ort"],
            "latency_ms": run,
            "latency_ratio": run["quiver"] / run["ort"],
        }
        ours.close()
        print(f"  {name}: create {rows[name]['create_ratio']:.2f}x (kept {rows[name]['create_kept_ratio']:.2f}x), "
              f"latency {rows[name]['latency_ratio']:.2f}x", file=sys.stderr)  # fmt: skip
    shutil.rmtree(kept_in, ignore_errors=True)
    return {"threads": THREADS, "onnxruntime": ort.__version__, "models": rows, "import": measure_import(rounds)}

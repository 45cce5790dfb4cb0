"""Tuning mode on real models: what each cpu knob does, what tuning chooses, a warm cache, a target server.

    python benchmarks/run.py --only tuning

* `quiver tune` (the library call) on real MiniLM (fp32 at two input sizes, a16w4) and on SmolLM2's
  prefill and decode graphs: the chosen configuration, default and tuned latency measured side by side,
  the noise, and every candidate's paired ratio and verdict.
* The knobs left out of the cpu knob space (ORT's parallel executor, its memory arena and pattern
  planner, flushing denormals), measured the same way (paired, interleaved) on plain ORT sessions.
* A second tune with the warm cache; tuning through `quiver target-server` on loopback (same choice?
  bytes sent the first and the second time).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

import quiver
from quiver.tuning import tune_context
from quiver.tuning.client import RemoteProfiler
from quiver.tuning.measure import compare, noise_of, runs_per_block, time_block
from quiver.tuning.workload import Workload, workload_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.real.corpus import quantize_minilm  # noqa: E402

_SAMPLE = "The history of the river begins in the mountains, where snow melts each spring and feeds small streams. "


def _context(folder: Path, name: str, source: Path) -> Path:
    with quiver.Context.create("cpu", workdir=folder) as context:
        context.add_graph(name, source)
        return context.save(folder / f"{name}.qctx")


def _encoder_feeds(corpus: Path, batch: int, sequence: int) -> dict[str, np.ndarray]:
    case = np.load(corpus / "minilm.npz")
    if (batch, sequence) == case["input_ids"].shape:
        return {"input_ids": case["input_ids"], "attention_mask": case["attention_mask"]}
    ids = np.random.default_rng(0).integers(1000, 20000, (batch, sequence)).astype(np.int64)
    ids[:, 0] = 101
    return {"input_ids": ids, "attention_mask": np.ones((batch, sequence), np.int64)}


def _tune(path: Path, workloads: Callable[[quiver.Context], list[Workload]], cache: Path, **options: Any) -> Any:
    with quiver.Context.from_binary(path) as context:
        start = time.perf_counter()
        result = tune_context(context, workloads(context), None, cache_dir=cache, **options)
        result.seconds = time.perf_counter() - start
    return result


def _summary(result: Any) -> dict[str, Any]:
    return {
        "seconds": round(result.seconds, 2),
        "graphs": {name: graph.to_json() for name, graph in result.graphs.items()},
    }


def _dropped_knobs(model: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """ORT session options outside the knob space, each against the defaults: paired, interleaved."""

    def session(**changes: Any) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        for key, value in changes.items():
            if key.startswith("session."):
                options.add_session_config_entry(key, value)
            else:
                setattr(options, key, value)
        return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])

    default = session()
    twin = session()
    candidates = {
        "execution_mode=parallel": session(execution_mode=ort.ExecutionMode.ORT_PARALLEL, inter_op_num_threads=2),
        "enable_cpu_mem_arena=False": session(enable_cpu_mem_arena=False),
        "enable_mem_pattern=False": session(enable_mem_pattern=False),
        "session.set_denormal_as_zero=1": session(**{"session.set_denormal_as_zero": "1"}),
    }
    runs = runs_per_block(statistics.median(time_block(lambda: default.run(None, feeds), 3)))

    def timer(s: ort.InferenceSession) -> Callable[[], list[float]]:
        return lambda: time_block(lambda: s.run(None, feeds), runs)

    same = compare(timer(default), timer(twin), 8)
    result: dict[str, Any] = {"default_ms": same.best_s * 1e3, "noise": noise_of(same)}
    for label, candidate in candidates.items():
        comparison = compare(timer(default), timer(candidate), 8)
        result[label] = {"ratio": comparison.ratio, "beats_noise": comparison.beats(noise_of(same))}
    return result


def _remote(path: Path, workloads: Callable[[quiver.Context], list[Workload]]) -> dict[str, Any]:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "quiver", "target-server", "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()  # serving
        sent = []
        configs = []
        with quiver.Context.from_binary(path) as context:
            for _ in range(2):
                client = RemoteProfiler(f"127.0.0.1:{port}")
                result = tune_context(context, workloads(context), None, profiler=client)
                sent.append(client.sent_bytes)
                configs.append({n: g.config for n, g in result.graphs.items()})
                client.close()
            weights = sum(w.length for w in context.file.weights)
        return {"configs": configs, "sent_bytes": sent, "context_weight_bytes": weights}
    finally:
        server.terminate()
        server.wait(30)


def measure_tuning(folder: Path, models: Path, llms: Path) -> dict[str, Any]:
    cache = folder / "performance-cache"
    minilm = _context(folder, "minilm", models / "minilm.onnx")
    report: dict[str, Any] = {}
    for batch, sequence in ((2, 13), (8, 128)):
        label = f"minilm fp32 {batch}x{sequence}"
        feeds = _encoder_feeds(models, batch, sequence)
        print(f"  tuning {label}", file=sys.stderr)
        result = _tune(minilm, lambda c, f=feeds: [workload_of(c, "minilm", [f])], cache)
        report[label] = _summary(result)
        report[label]["dropped_knobs"] = _dropped_knobs(models / "minilm.onnx", feeds)
        if batch == 2:
            warm = _tune(minilm, lambda c, f=feeds: [workload_of(c, "minilm", [f])], cache)
            report["warm cache"] = {"seconds": round(warm.seconds, 3), "measured": warm.graphs["minilm"].measured}
            print("  tuning through a target server", file=sys.stderr)
            report["target server"] = _remote(minilm, lambda c, f=feeds: [workload_of(c, "minilm", [f])])
            report["target server"]["local_config"] = {"minilm": result.graphs["minilm"].config}
    quantized = quantize_minilm(models, folder)
    a16w4 = _context(folder, "minilm_a16w4", quantized["a16w4"])
    feeds = _encoder_feeds(models, 2, 13)
    print("  tuning minilm a16w4", file=sys.stderr)
    report["minilm a16w4 2x13"] = _summary(_tune(a16w4, lambda c: [workload_of(c, "minilm_a16w4", [feeds])], cache))

    from quiver.t2t.dialog import Dialog
    from quiver.t2t.export import ExportOptions, export

    config = export(llms / "smollm2", folder / "smollm2", options=ExportOptions(context_size=1024, n_threads=2)).path
    with Dialog.from_config(config) as dialog:
        ids: list[int] = []
        while len(ids) < 128:
            ids += dialog.tokenizer.encode(_SAMPLE)
        samples = dialog.sample_feeds(ids[:128])
        print("  tuning smollm2 prefill and decode", file=sys.stderr)
        start = time.perf_counter()
        result = tune_context(
            dialog.context, [workload_of(dialog.context, g, f) for g, f in samples.items()], None, cache_dir=cache
        )
        result.seconds = time.perf_counter() - start
    report["smollm2 fp32 t2t (128-token prompt)"] = _summary(result)
    return report

"""Float vs. a16w8 vs. a16w4 on the benchmark transformer: context size, latency (Quiver cpu and ORT on the
same ONNX model, side by side), and accuracy against float on inputs not used for calibration."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

import quiver
from quiver.commands.accuracy import cosine, sqnr_db
from quiver.passes.qdq import QuantizeOptions, quantize
from quiver.testing.family import BENCH, build_model, family_weights, sample_input_ids
from timing import alternating_medians

VARIANTS = {"a16w8": QuantizeOptions(activation_bits=16, weight_bits=8), "a16w4": QuantizeOptions(16, 4, block_size=64)}


def measure_quantization(folder: Path, sequence: int = 128, rounds: int = 5, iterations: int = 10) -> dict[str, Any]:
    model = build_model(BENCH, family_weights(BENCH, seed=0), "encoder")
    calibration = [{"input_ids": sample_input_ids(BENCH, 1, sequence, seed=i)} for i in range(4)]
    held_out = [sample_input_ids(BENCH, 1, sequence, seed=100 + i) for i in range(4)]
    paths = {"float": folder / "float.onnx"}
    onnx.save(model, paths["float"])
    quantize_seconds = {}
    for name, options in VARIANTS.items():
        start = time.perf_counter()
        qdq, _ = quantize(model, calibration, options)
        quantize_seconds[name] = time.perf_counter() - start
        paths[name] = folder / f"{name}.onnx"
        onnx.save(qdq, paths[name])

    report: dict[str, Any] = {"input": [1, sequence], "calibration_inputs": len(calibration), "variants": {}}
    sessions, graphs, contexts = {}, {}, []
    reference_outputs = None
    for name, path in paths.items():
        context = quiver.Context.create("cpu", workdir=folder)
        context.add_graph(name, path)
        qctx = context.save(folder / f"{name}.qctx")
        context.close()
        runtime = quiver.Context.from_binary(qctx, backend="cpu")
        contexts.append(runtime)
        graphs[name] = runtime.graph(name)
        sessions[name] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outputs = [sessions[name].run(None, {"input_ids": ids})[0] for ids in held_out]
        ours = [graphs[name].execute({"input_ids": ids})["last_hidden_state"] for ids in held_out]
        runtime.wait_until_ready()
        if reference_outputs is None:
            reference_outputs = outputs
        float_all, these = (
            np.concatenate([o.ravel() for o in reference_outputs]),
            np.concatenate([o.ravel() for o in outputs]),
        )
        pooled = [cosine(f.mean(axis=1), o.mean(axis=1)) for f, o in zip(reference_outputs, outputs)]
        report["variants"][name] = {
            "context_bytes": qctx.stat().st_size,
            "onnx_bytes": path.stat().st_size,
            "quantize_seconds": quantize_seconds.get(name),
            "sqnr_db_vs_float": sqnr_db(float_all, these) if name != "float" else None,
            "cosine_vs_float": cosine(float_all, these),
            "min_pooled_embedding_cosine_vs_float": min(pooled),
            "quiver_vs_ort_max_abs_diff": float(max(np.abs(a - b).max() for a, b in zip(ours, outputs))),
        }
    feeds = {"input_ids": held_out[0]}
    timed: dict[str, Any] = {}
    for name in paths:  # interleaved: this machine's speed drifts
        timed[f"quiver {name}"] = lambda g=graphs[name]: g.execute(feeds)
        timed[f"ort {name}"] = lambda s=sessions[name]: s.run(None, feeds)
    samples = alternating_medians(timed, rounds, iterations, warm_up=2)
    quiver_ms = {name: samples[f"quiver {name}"] for name in paths}
    ort_ms = {name: samples[f"ort {name}"] for name in paths}
    float_bytes = report["variants"]["float"]["context_bytes"]
    for name, entry in report["variants"].items():
        entry["context_over_float"] = entry["context_bytes"] / float_bytes
        entry["quiver_ms"] = statistics.median(quiver_ms[name])
        entry["ort_same_model_ms"] = statistics.median(ort_ms[name])
        entry["ratio_to_ort_same_model"] = statistics.median(q / o for q, o in zip(quiver_ms[name], ort_ms[name]))
    for runtime in contexts:
        runtime.close()
    return report

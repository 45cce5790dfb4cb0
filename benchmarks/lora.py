"""Adapter switching with binary sections on the benchmark transformer (rank-r LoRA on every linear layer)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

import quiver
from quiver.runtime.sections import load_section
from quiver.tools.family import BENCH, LORA_PREFIX, build_model, family_weights, sample_input_ids

_LINEARS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w1", "down": "w2"}


def _adapter(lora_names: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (0.02 * rng.standard_normal(shape)).astype(np.float32) for name, shape in lora_names.items()}


def _merged_weights(weights: dict[str, Any], adapter: dict[str, np.ndarray]) -> dict[str, Any]:
    """The base weights with each linear weight W replaced by W + A·B: what merging an adapter does."""
    merged = dict(weights)
    merged["layers"] = []
    for index, layer in enumerate(weights["layers"]):
        layer = dict(layer)
        for tag, key in _LINEARS.items():
            layer[key] = (
                layer[key] + adapter[f"{LORA_PREFIX}A_{index}_{tag}"] @ adapter[f"{LORA_PREFIX}B_{index}_{tag}"]
            )
        merged["layers"].append(layer)
    return merged


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def measure_lora(folder: Path, rank: int = 16, sequence: int = 128, switches: int = 200) -> dict[str, Any]:
    weights = family_weights(BENCH, seed=0)
    lora_model = build_model(BENCH, weights, "lora", lora_rank=rank)
    lora_names = {t.name: tuple(t.dims) for t in lora_model.graph.initializer if t.name.startswith(LORA_PREFIX)}
    context = quiver.Context.create("cpu", workdir=folder)
    context.add_graph("lora", lora_model, updateable=list(lora_names))
    context.add_graph("base", build_model(BENCH, weights, "base"))
    qctx = context.save(folder / "lora.qctx")
    context.close()

    adapters = {"one": _adapter(lora_names, 1), "two": _adapter(lora_names, 2)}
    maker = quiver.Context.from_binary(qctx, backend="reference")
    paths = {}
    for name, adapter in adapters.items():
        maker.graph("lora").update_tensors(adapter)
        maker.finalize()
        paths[name] = folder / f"{name}.qsec"
        paths[name].write_bytes(maker.get_binary_section("lora", metadata={"adapter": name}))
    maker.close()

    ids = sample_input_ids(BENCH, batch=1, seq=sequence)
    feeds = {"input_ids": ids}
    runtime = quiver.Context.from_binary(qctx, backend="cpu")
    graph, base_graph = runtime.graph("lora"), runtime.graph("base")
    graph.execute(feeds)
    base_graph.execute(feeds)
    runtime.wait_until_ready()
    sections = {name: load_section(path) for name, path in paths.items()}  # loaded and verified once

    # Correctness: the adapted graph equals ORT on the model with the adapter merged into its weights.
    merged_bytes = {}
    for name, adapter in adapters.items():
        runtime.apply_binary_section("lora", sections[name])
        merged_bytes[name] = build_model(BENCH, _merged_weights(weights, adapter), "merged").SerializeToString()
        theirs = ort.InferenceSession(merged_bytes[name]).run(None, feeds)[0]
        np.testing.assert_allclose(graph.execute(feeds)["last_hidden_state"], theirs, atol=1e-3, rtol=0)

    apply_times, switch_times = [], []
    order = ["one", "two"]
    for i in range(switches):
        start = time.perf_counter()
        runtime.apply_binary_section("lora", sections[order[i % 2]])
        apply_times.append(time.perf_counter() - start)
    for i in range(30):
        start = time.perf_counter()
        runtime.apply_binary_section("lora", sections[order[i % 2]])
        graph.execute(feeds)
        switch_times.append(time.perf_counter() - start)
    ort_switch = []
    for i in range(5):
        start = time.perf_counter()
        ort.InferenceSession(merged_bytes[order[i % 2]], providers=["CPUExecutionProvider"]).run(None, feeds)
        ort_switch.append(time.perf_counter() - start)

    lora_ms, base_ms = [], []
    for _ in range(7):  # interleaved rounds
        for samples, g in ((lora_ms, graph), (base_ms, base_graph)):
            times = []
            for _ in range(10):
                start = time.perf_counter()
                g.execute(feeds)
                times.append(time.perf_counter() - start)
            samples.append(statistics.median(times))
    runtime.close()

    super_context = quiver.Context.create("cpu", workdir=folder)
    super_context.add_graph(
        "prefill", lora_model, input_shapes={"input_ids": [1, sequence]}, updateable=list(lora_names)
    )
    super_context.add_graph("decode", lora_model, input_shapes={"input_ids": [1, 1]}, updateable=list(lora_names))
    super_context.finalize()
    super_context.update_context_tensors(adapters["one"])
    super_context.finalize()
    super_bytes = len(super_context.get_binary_section())
    per_graph_bytes = len(super_context.get_binary_section("prefill")) + len(super_context.get_binary_section("decode"))
    super_context.close()

    adapted_weight_bytes = sum(layer[key].nbytes for layer in weights["layers"] for key in _LINEARS.values())
    section_bytes = paths["one"].stat().st_size
    return {
        "rank": rank,
        "attach_points": len(lora_names) // 2,
        "input": [1, sequence],
        "apply_section_ms": _median_ms(apply_times),
        "apply_section_p90_ms": float(np.percentile(apply_times, 90) * 1e3),
        "switch_to_first_output_ms": _median_ms(switch_times),
        "ort_new_session_with_merged_weights_ms": _median_ms(ort_switch),
        "switch_ratio_to_ort": _median_ms(switch_times) / _median_ms(ort_switch),
        "lora_graph_latency_ms": _median_ms(lora_ms),
        "base_graph_latency_ms": _median_ms(base_ms),
        "lora_overhead": _median_ms(lora_ms) / _median_ms(base_ms),
        "section_bytes": section_bytes,
        "merged_adapted_weight_bytes": adapted_weight_bytes,
        "section_over_merged": section_bytes / adapted_weight_bytes,
        "super_section_bytes": super_bytes,
        "per_graph_sections_bytes": per_graph_bytes,
        "super_over_per_graph": super_bytes / per_graph_bytes,
    }

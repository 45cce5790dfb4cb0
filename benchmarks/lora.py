"""Adapter switching with binary sections: the LoRA flow (map, create, import) on the benchmark transformer.

Rank-r adapters on every linear layer, in PEFT's layout; the graph is the one `quiver lora prepare` makes.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

import quiver
from quiver.lora.attach import find_attach_points
from quiver.lora.create import ALPHA_INPUT, create_lora_graph, slot_ranks, use_case_values
from quiver.lora.peft import LoraConfig, LoraModule, PeftAdapter
from quiver.runtime.sections import load_section
from quiver.tools.family import BENCH, build_model, family_weights, sample_input_ids
from timing import median_ms

_LINEARS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w1", "down": "w2"}


def _adapter(name: str, weights: dict[str, Any], rank: int, seed: int) -> PeftAdapter:
    """A PEFT-layout adapter on every linear layer: A [r, in], B [out, r], scaling lora_alpha / r = 2."""
    rng = np.random.default_rng(seed)
    modules = {}
    for index, layer in enumerate(weights["layers"]):
        for tag, key in _LINEARS.items():
            fan_in, fan_out = layer[key].shape
            module = f"layers.{index}.{tag}"
            modules[module] = LoraModule(
                module,
                (0.02 * rng.standard_normal((rank, fan_in))).astype(np.float32),
                (0.02 * rng.standard_normal((fan_out, rank))).astype(np.float32),
                2.0,
            )
    config = LoraConfig(r=rank, lora_alpha=2.0 * rank, target_modules=list(_LINEARS))
    return PeftAdapter(name, config, modules)


def _merged_weights(weights: dict[str, Any], adapter: PeftAdapter) -> dict[str, Any]:
    """The base weights with each linear W ([in, out]) replaced by W + ΔWᵀ: what merging an adapter does."""
    merged = dict(weights)
    merged["layers"] = []
    for index, layer in enumerate(weights["layers"]):
        layer = dict(layer)
        for tag, key in _LINEARS.items():
            layer[key] = layer[key] + adapter.modules[f"layers.{index}.{tag}"].delta().T
        merged["layers"].append(layer)
    return merged


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def measure_lora(folder: Path, rank: int = 16, sequence: int = 128, switches: int = 200) -> dict[str, Any]:
    weights = family_weights(BENCH, seed=0)
    base_model = build_model(BENCH, weights, "base")
    adapters = {"one": _adapter("one", weights, rank, 1), "two": _adapter("two", weights, rank, 2)}
    use_cases = {"one": ["one"], "two": ["two"]}
    order = list(adapters)
    points, missing = find_attach_points(base_model, sorted(adapters["one"].modules))
    assert not missing, missing
    lora_model, slots = create_lora_graph(base_model, points, slot_ranks(adapters, use_cases), len(order))
    updateable = [t for s in slots for t in s.tensors]
    context = quiver.Context.create("cpu", workdir=folder)
    context.add_graph("lora", lora_model, updateable=updateable)
    context.add_graph("base", base_model)
    context.finalize()
    paths = {}
    for name, active in use_cases.items():
        context.graph("lora").update_tensors(use_case_values(slots, adapters, active, order))
        context.finalize()
        alphas = [1.0 if a in active else 0.0 for a in order]
        metadata = {"lora": {"use_case": name, "alpha_input": ALPHA_INPUT, "adapters": order, "alphas": alphas}}
        paths[name] = folder / f"{name}.qsec"
        paths[name].write_bytes(context.get_binary_section("lora", metadata))
    qctx = context.save(folder / "lora.qctx")
    context.close()

    feeds = {"input_ids": sample_input_ids(BENCH, batch=1, seq=sequence)}
    runtime = quiver.Context.from_binary(qctx, backend="cpu")
    graph, base_graph = runtime.graph("lora"), runtime.graph("base")
    sections = {name: load_section(path) for name, path in paths.items()}  # loaded and verified once
    runtime.apply_binary_section("lora", sections["one"])
    graph.execute(feeds)
    base_graph.execute(feeds)
    runtime.wait_until_ready()

    # Correctness: each use case equals ORT on the model with its adapter merged into the weights.
    merged_bytes = {}
    for name in order:
        runtime.apply_binary_section("lora", sections[name])
        merged_bytes[name] = build_model(BENCH, _merged_weights(weights, adapters[name]), "merged").SerializeToString()
        theirs = ort.InferenceSession(merged_bytes[name]).run(None, feeds)[0]
        np.testing.assert_allclose(graph.execute(feeds)["last_hidden_state"], theirs, atol=1e-3, rtol=0)

    apply_times, switch_times, ort_switch = [], [], []
    for i in range(switches):
        start = time.perf_counter()
        runtime.apply_binary_section("lora", sections[order[i % 2]])
        apply_times.append(time.perf_counter() - start)
    for i in range(30):
        start = time.perf_counter()
        runtime.apply_binary_section("lora", sections[order[i % 2]])
        graph.execute(feeds)
        switch_times.append(time.perf_counter() - start)
    for i in range(5):
        start = time.perf_counter()
        ort.InferenceSession(merged_bytes[order[i % 2]], providers=["CPUExecutionProvider"]).run(None, feeds)
        ort_switch.append(time.perf_counter() - start)
    lora_s, base_s = [], []
    for _ in range(15):  # interleaved rounds: this machine's speed drifts more than the difference measured
        lora_s.append(median_ms(lambda: graph.execute(feeds), 8, warm_up=2))
        base_s.append(median_ms(lambda: base_graph.execute(feeds), 8, warm_up=2))
    overheads = [lora / base for lora, base in zip(lora_s, base_s)]
    runtime.close()

    super_context = quiver.Context.create("cpu", workdir=folder)
    super_context.add_graph("prefill", lora_model, input_shapes={"input_ids": [1, sequence]}, updateable=updateable)
    super_context.add_graph("decode", lora_model, input_shapes={"input_ids": [1, 1]}, updateable=updateable)
    super_context.finalize()
    super_context.update_context_tensors(use_case_values(slots, adapters, ["one"], order))
    super_context.finalize()
    super_bytes = len(super_context.get_binary_section())
    per_graph_bytes = len(super_context.get_binary_section("prefill")) + len(super_context.get_binary_section("decode"))
    super_context.close()

    adapted_weight_bytes = sum(layer[key].nbytes for layer in weights["layers"] for key in _LINEARS.values())
    section_bytes = paths["one"].stat().st_size
    return {
        "rank": rank,
        "attach_points": len(slots),
        "input": [1, sequence],
        "apply_section_ms": _median_ms(apply_times),
        "apply_section_p90_ms": float(np.percentile(apply_times, 90) * 1e3),
        "switch_to_first_output_ms": _median_ms(switch_times),
        "ort_new_session_with_merged_weights_ms": _median_ms(ort_switch),
        "switch_ratio_to_ort": _median_ms(switch_times) / _median_ms(ort_switch),
        "lora_graph_latency_ms": statistics.median(lora_s),
        "base_graph_latency_ms": statistics.median(base_s),
        "lora_overhead": statistics.median(overheads),
        "lora_overhead_quartiles": [float(q) for q in np.percentile(overheads, [25, 75])],
        "section_bytes": section_bytes,
        "merged_adapted_weight_bytes": adapted_weight_bytes,
        "section_over_merged": section_bytes / adapted_weight_bytes,
        "super_section_bytes": super_bytes,
        "per_graph_sections_bytes": per_graph_bytes,
        "super_over_per_graph": super_bytes / per_graph_bytes,
    }

"""Adapter switching with binary sections: the LoRA flow (map, create, import) on the benchmark transformer.

Rank-r adapters on every linear layer, in PEFT's layout; the graph is the one `quiver lora prepare` makes.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

import quiver
from quiver.lora.attach import find_attach_points
from quiver.lora.create import ALPHA_INPUT, LoraSlot, create_lora_graph, slot_ranks, updateable_tensors, use_case_values
from quiver.lora.peft import LoraConfig, LoraModule, PeftAdapter
from quiver.runtime.sections import load_section
from quiver.testing.family import BENCH, TransformerShape, build_model, family_weights, sample_input_ids
from timing import median_ms

# The LoRA benchmark model: BERT-base widths (hidden 768, 12 heads, FFN 3072) in 4 layers, 140 MB.
# LoRA's share of the work grows with rank / hidden size, so the overhead is also measured on the
# narrower family model (BENCH, hidden 512), the harder case.
BERT_BASE_WIDTH = TransformerShape(vocab=8000, hidden=768, heads=12, ffn=3072, layers=4, max_positions=512)

_LINEARS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w1", "down": "w2"}
_USE_CASES = {"one": ["one"], "two": ["two"]}


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


def _overhead(
    graph: quiver.Graph, feeds: dict[str, np.ndarray], base_graph: quiver.Graph, base_feeds: dict[str, np.ndarray]
) -> dict[str, Any]:
    """LoRA graph latency over base graph latency: the median of 30 interleaved rounds' ratios.

    This machine's speed drifts more than the difference measured, so each round times both graphs
    (the order alternating) and the ratio is taken within the round.
    """
    lora_s: list[float] = []
    base_s: list[float] = []
    for round_ in range(30):
        timed = [(lora_s, graph, feeds), (base_s, base_graph, base_feeds)]
        for times, timed_graph, timed_feeds in timed if round_ % 2 else timed[::-1]:
            times.append(median_ms(functools.partial(timed_graph.execute, timed_feeds), 8, warm_up=3))
    overheads = [lora / base for lora, base in zip(lora_s, base_s)]
    return {
        "lora_graph_latency_ms": statistics.median(lora_s),
        "base_graph_latency_ms": statistics.median(base_s),
        "lora_overhead": statistics.median(overheads),
        "lora_overhead_quartiles": [float(q) for q in np.percentile(overheads, [25, 75])],
    }


def _lora_model(
    shape: TransformerShape, weights: dict[str, Any], rank: int
) -> tuple[onnx.ModelProto, onnx.ModelProto, dict[str, PeftAdapter], list[LoraSlot]]:
    """The base model, the LoRA graph the flow makes for two rank-r adapters on every linear, its slots."""
    base_model = build_model(shape, weights, "base")
    adapters = {"one": _adapter("one", weights, rank, 1), "two": _adapter("two", weights, rank, 2)}
    points, missing = find_attach_points(base_model, sorted(adapters["one"].modules))
    assert not missing, missing
    lora_model, slots = create_lora_graph(base_model, points, slot_ranks(adapters, _USE_CASES), len(adapters))
    return base_model, lora_model, adapters, slots


def _model_info(shape: TransformerShape, weights: dict[str, Any]) -> dict[str, Any]:
    layer_bytes = sum(a.nbytes for layer in weights["layers"] for a in layer.values())
    weight_bytes = layer_bytes + weights["tok"].nbytes + weights["pos"].nbytes
    return {"hidden": shape.hidden, "ffn": shape.ffn, "layers": shape.layers, "weight_bytes": weight_bytes}


def measure_overhead(folder: Path, shape: TransformerShape, rank: int = 16, sequence: int = 128) -> dict[str, Any]:
    """Only the per-inference overhead, for another model shape: adapter "one" applied, strength 1."""
    weights: dict[str, Any] = family_weights(shape, seed=0)
    base_model, lora_model, adapters, slots = _lora_model(shape, weights, rank)
    context = quiver.Context.create("cpu", workdir=folder)
    context.add_graph("lora", lora_model, updateable=updateable_tensors(slots))
    context.add_graph("base", base_model)
    context.finalize()
    context.graph("lora").update_tensors(use_case_values(slots, adapters, ["one"], list(adapters)))
    context.finalize()
    qctx = context.save(folder / f"overhead_{shape.hidden}.qctx")
    context.close()
    runtime = quiver.Context.from_binary(qctx, backend="cpu")
    feeds = {"input_ids": sample_input_ids(shape, batch=1, seq=sequence)}
    lora_feeds = {**feeds, ALPHA_INPUT: np.array([1.0, 0.0], np.float32)}
    graph, base_graph = runtime.graph("lora"), runtime.graph("base")
    graph.execute(lora_feeds)
    base_graph.execute(feeds)
    runtime.wait_until_ready()
    result = _model_info(shape, weights) | _overhead(graph, lora_feeds, base_graph, feeds)
    runtime.close()
    return result


def measure_lora(
    folder: Path, shape: TransformerShape = BERT_BASE_WIDTH, rank: int = 16, sequence: int = 128, switches: int = 200
) -> dict[str, Any]:
    weights: dict[str, Any] = family_weights(shape, seed=0)
    base_model, lora_model, adapters, slots = _lora_model(shape, weights, rank)
    order = list(adapters)
    updateable = updateable_tensors(slots)
    context = quiver.Context.create("cpu", workdir=folder)
    context.add_graph("lora", lora_model, updateable=updateable)
    context.add_graph("base", base_model)
    context.finalize()
    paths = {}
    for name, active in _USE_CASES.items():
        context.graph("lora").update_tensors(use_case_values(slots, adapters, active, order))
        context.finalize()
        alphas = [1.0 if a in active else 0.0 for a in order]
        metadata = {"lora": {"use_case": name, "alpha_input": ALPHA_INPUT, "adapters": order, "alphas": alphas}}
        paths[name] = folder / f"{name}.qsec"
        paths[name].write_bytes(context.get_binary_section("lora", metadata))
    qctx = context.save(folder / "lora.qctx")
    context.close()

    feeds = {"input_ids": sample_input_ids(shape, batch=1, seq=sequence)}
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
        merged_bytes[name] = build_model(shape, _merged_weights(weights, adapters[name]), "merged").SerializeToString()
        theirs = ort.InferenceSession(merged_bytes[name]).run(None, feeds)[0]
        np.testing.assert_allclose(graph.execute(feeds)["last_hidden_state"], theirs, atol=1e-3, rtol=0)

    apply_times, switch_times, ort_switch = [], [], []
    for i in range(switches):
        start = time.perf_counter()
        runtime.apply_binary_section("lora", sections[order[i % 2]])
        apply_times.append(time.perf_counter() - start)
    from_file, new_file = [], []
    for i in range(50):  # from a path applied before, unchanged: a stat, then bound
        start = time.perf_counter()
        runtime.apply_binary_section("lora", paths[order[i % 2]])
        from_file.append(time.perf_counter() - start)
    for i in range(20):  # from a file not seen before: read into memory, every checksum verified, bound
        fresh = folder / f"fresh_{i}.qsec"
        shutil.copyfile(paths[order[i % 2]], fresh)
        start = time.perf_counter()
        runtime.apply_binary_section("lora", fresh)
        new_file.append(time.perf_counter() - start)
        fresh.unlink()
    for i in range(30):
        start = time.perf_counter()
        runtime.apply_binary_section("lora", sections[order[i % 2]])
        graph.execute(feeds)
        switch_times.append(time.perf_counter() - start)
    for i in range(5):
        start = time.perf_counter()
        ort.InferenceSession(merged_bytes[order[i % 2]], providers=["CPUExecutionProvider"]).run(None, feeds)
        ort_switch.append(time.perf_counter() - start)
    overhead = _overhead(graph, feeds, base_graph, feeds)
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
        "model": _model_info(shape, weights),
        "rank": rank,
        "attach_points": len(slots),
        "input": [1, sequence],
        "apply_section_ms": _median_ms(apply_times),
        "apply_section_p90_ms": float(np.percentile(apply_times, 90) * 1e3),
        "apply_section_from_file_ms": _median_ms(from_file),
        "apply_section_from_new_file_ms": _median_ms(new_file),
        "switch_to_first_output_ms": _median_ms(switch_times),
        "ort_new_session_with_merged_weights_ms": _median_ms(ort_switch),
        "switch_ratio_to_ort": _median_ms(switch_times) / _median_ms(ort_switch),
        **overhead,
        "lora_overhead_family_model": measure_overhead(folder, BENCH, rank, sequence),
        "section_bytes": section_bytes,
        "merged_adapted_weight_bytes": adapted_weight_bytes,
        "section_over_merged": section_bytes / adapted_weight_bytes,
        "super_section_bytes": super_bytes,
        "per_graph_sections_bytes": per_graph_bytes,
        "super_over_per_graph": super_bytes / per_graph_bytes,
    }

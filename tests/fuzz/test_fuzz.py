"""Hostile input: a short structure-aware fuzz campaign, and each untyped failure seen before, pinned."""

from __future__ import annotations

import json
import os
import random
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import quiver
from quiver.lora.peft import LoraConfig
from quiver.ort.epcontext import MS_DOMAIN, SOURCE
from tests.fuzz import harness
from tests.support.cli import quiver as run_cli

CAMPAIGN = 600  # inputs here (a few seconds); `python -m tests.fuzz.harness --count 20000` for the long one


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> list[harness.Seed]:
    return harness.make_seeds(tmp_path_factory.mktemp("fuzz"))


def test_a_short_campaign_ends_every_input_in_a_typed_error_a_verify_failure_or_a_right_output(
    seeds: list[harness.Seed],
) -> None:
    results = harness.campaign(seeds, CAMPAIGN, jobs=os.cpu_count() or 1, first=0, base_seed=int(time.time()) % 1000)
    report = harness.summary(results)
    assert report["inputs"] == CAMPAIGN
    assert report["failures"] == 0, report["failure_examples"]
    # the mutations reach past the first checks: some inputs load and run (same), some fail verify
    assert report["outcomes"].get("same", 0) > 0 and report["outcomes"].get("verify", 0) > 0
    assert set(report["by_mutation"]) >= {"header_value", "skeleton", "lora_metadata", "truncate", "data_bytes"}


def test_a_layer_norm_whose_bias_is_named_empty_does_not_crash_onnx_runtime(seeds: list[harness.Seed]) -> None:
    # input 540 of campaign seed 851: a quantized graph's LayerNormalization with bias "" made ORT
    # 1.24-1.32 crash (SIGSEGV) while creating the session; the cpu backend now leaves the "" out
    (result,) = harness.campaign(seeds, 1, jobs=1, first=540, base_seed=851)
    assert result.mutations == ["skeleton"] and result.outcome in harness.ACCEPTED, result


def test_the_oracle_counts_an_untyped_error_and_a_crash_as_failures(seeds: list[harness.Seed]) -> None:
    seed = seeds[0]
    assert harness.oracle(seed, "context", seed.context) == "same"
    broken = harness.Seed(seed.name, seed.context, {}, seed.expected)  # no feeds: KeyError inside the oracle
    assert harness.oracle(broken, "context", seed.context).startswith("untyped:KeyError")
    assert harness.summary([harness.Result(0, "s", "context", [], "crash:SIGSEGV")])["failures"] == 1


def test_a_header_integer_python_cannot_read_is_a_typed_error(seeds: list[harness.Seed]) -> None:
    data = seeds[0].context
    _, pre, header = harness._split(data)
    text = json.dumps(header).replace('"offset": ' + str(header["weights"][0]["offset"]), '"offset": ' + "1" * 5000)
    with pytest.raises(quiver.InvalidHeaderError, match="JSON"):
        quiver.Context.from_binary(harness.reseal(data, text.encode()))


def test_a_graph_name_that_is_not_unicode_text_loads_runs_and_prints(seeds: list[harness.Seed], tmp_path: Path) -> None:
    data = seeds[0].context
    _, pre, header = harness._split(data)
    header["graphs"][0]["name"] = "model\ud800"  # JSON can say it; UTF-8 cannot encode it
    mutated = harness.reseal(data, json.dumps(header).encode())
    assert harness.oracle(seeds[0], "context", mutated) == "other"  # the same graph under another name
    (tmp_path / "odd.qctx").write_bytes(mutated)
    shown = run_cli("inspect", tmp_path / "odd.qctx")
    assert shown.returncode == 0 and "model\\ud800" in shown.stdout


@pytest.mark.parametrize(
    "config",
    [
        {"r": 8, "target_modules": "(a+)+$"},  # exponential backtracking: refused, not run for minutes
        {"r": 8, "target_modules": "(q|q)*x"},
        {"r": 8, "target_modules": "(["},
        {"r": 8, "rank_pattern": {"(": 2}},
        {"r": 1e999},
        {"r": 8, "lora_alpha": float("nan")},
        {"r": 8, "lora_alpha": "inf"},
        {"r": 8, "alpha_pattern": {"q_proj": float("inf")}},
        {"r": 8, "target_modules": [1, 2]},
        {"r": 8, "layers_to_transform": ["a"]},
        {"r": 8, "layers_pattern": 5},
        {"r": True},
        {"r": 8.5},
        {"r": [8]},
    ],
)
def test_peft_configs_that_cannot_be_applied_exactly_are_adapter_errors(config: dict) -> None:
    start = time.monotonic()
    with pytest.raises(quiver.AdapterError, match="adapter_config.json"):
        LoraConfig.from_json(config, "adapter_config.json").targets("model.layers.0.self_attn.q_proj" + "q" * 40)
    assert time.monotonic() - start < 1


def test_a_plain_peft_regex_still_works() -> None:
    config = LoraConfig.from_json({"r": 8, "target_modules": r".*\.(q_proj|v_proj)"}, "adapter_config.json")
    assert config.targets("model.layers.0.self_attn.q_proj") and not config.targets("model.layers.0.mlp.up_proj")


@pytest.mark.parametrize(
    "document",
    [
        {"x": [{"scale": 1e999, "zero_point": 0, "quant_type": "QUInt8"}]},
        {"x": [{"scale": 0.1, "zero_point": 1e999, "quant_type": "QUInt8"}]},
        {"x": [{"scale": 0.1, "zero_point": 10**30, "quant_type": "QUInt8"}]},
        {"version": "1.0.0", "activation_encodings": [{"name": "x", "bw": 1e999, "scale": [0.1], "offset": [0],
                                                        "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False}]},
        {"activation_encodings": {"x": [{"bitwidth": 8, "min": -1, "max": 1, "scale": 0.1, "offset": -1e999}]}},
    ],
)  # fmt: skip
def test_overrides_with_values_out_of_range_are_typed_errors(document: dict, tmp_path: Path) -> None:
    from quiver.commands.quantize import read_overrides

    (tmp_path / "o.json").write_text(json.dumps(document))
    with pytest.raises(quiver.QuiverError):
        read_overrides(tmp_path / "o.json")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(quiver.QuiverError):
        read_overrides(tmp_path / "deep.json")


def _ep_context_model(**attributes: object) -> onnx.ModelProto:
    node = helper.make_node("EPContext", ["x"], ["y"], domain=MS_DOMAIN, **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])


@pytest.mark.parametrize(
    "attributes",
    [
        {"source": 5, "ep_cache_context": "a.qctx"},
        {"source": SOURCE, "partition_name": 3, "ep_cache_context": "a.qctx"},
        {"source": SOURCE, "ep_cache_context": "a.qctx", "embed_mode": "one"},
        {"source": SOURCE, "ep_cache_context": b"\xff\xfe.qctx"},
        {"source": SOURCE, "ep_cache_context": "a.qctx"},  # as bytes: nothing to resolve the path against
    ],
)
def test_ep_context_attributes_of_the_wrong_type_are_ort_typed_errors(attributes: dict) -> None:
    model = _ep_context_model(**attributes)
    with pytest.raises(quiver.ort.InvalidGraph):
        quiver.ort.InferenceSession(model.SerializeToString())


def test_a_fallback_model_reads_external_data_beside_it_not_in_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = numpy_helper.from_array(np.full((2, 3), 2.0, np.float32), "w")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["xw"]),
        helper.make_node("Hardmax", ["xw"], ["y"]),
    ]  # Hardmax: ORT only
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [weights])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (tmp_path / "model").mkdir()
    onnx.save(model, str(tmp_path / "model" / "m.onnx"), save_as_external_data=True, location="w.bin",
              size_threshold=0)  # fmt: skip
    decoy = np.array([[1, -1, -1], [-1, 1, -1]], np.float32)  # a file of the same name where the process runs
    (tmp_path / "w.bin").write_bytes(decoy.tobytes())
    monkeypatch.chdir(tmp_path)
    session = quiver.ort.InferenceSession(str(tmp_path / "model" / "m.onnx"))
    x = np.array([[1, 3, 2], [5, 4, 0]], np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], [[0, 1, 0], [1, 0, 0]])


def test_inspect_shows_control_characters_in_names_escaped(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x\x1b[2J", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["x\x1b[2J"], ["y"])], "g", [x], [y])
    with quiver.Context.create("cpu") as context:
        context.add_graph("evil\x1b[31m\x07", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        context.save(tmp_path / "evil.qctx")
    shown = run_cli("inspect", tmp_path / "evil.qctx")
    assert shown.returncode == 0 and "\x1b[31m" not in shown.stdout and "\x07" not in shown.stdout
    assert "\\x1b[31m" in shown.stdout and "\\x1b[2J" in shown.stdout
    as_json = json.loads(run_cli("inspect", tmp_path / "evil.qctx", "--json").stdout)
    assert as_json["graphs"][0]["name"] == "evil\x1b[31m\x07"  # JSON keeps the real name, escaped by JSON


def test_an_adapter_config_python_cannot_parse_is_an_adapter_error(tmp_path: Path) -> None:
    from quiver.lora.peft import load_peft_adapter
    from tests.support.peft_models import write_adapter

    write_adapter(tmp_path / "a", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, seed=1,
                  modules={"model.layers.0.self_attn.q_proj": (16, 16)})  # fmt: skip
    config = tmp_path / "a" / "adapter_config.json"
    for text in ('{"r": 4, "layers_to_transform": ' + "1" * 5000 + "}", "[" * 100_000, "\xff"):
        config.write_text(text, encoding="latin-1")
        with pytest.raises(quiver.AdapterError, match="adapter_config.json"):
            load_peft_adapter(tmp_path / "a")


def test_encodings_of_a_damaged_quantized_skeleton_are_a_typed_error(seeds: list[harness.Seed]) -> None:
    quantized = next(seed for seed in seeds if seed.name == "quantized")
    with quiver.Context.from_binary(quantized.context) as seed_context:
        file = seed_context.file
        model = onnx.ModelProto.FromString(file.skeleton("base"))
        inline = {t.name: t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
        scales = [n.input[1] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[1] in inline]
        inline[scales[0]].dims.append(1 << 40)  # an inline scale whose data no longer fits its shape
        damaged = harness._relayout(file, {"base": model.SerializeToString()})
    with quiver.Context.from_binary(damaged) as context:
        with pytest.raises(quiver.EncodingsError, match="damaged"):
            context.graph("base").encodings()


# --- schema fuzz: cache records and dialog configs ---------------------------------------------------------------
def _random_json(rng: random.Random, depth: int = 0) -> object:
    """A JSON value of any type, edge values favoured (negative, huge, empty, nested, non-ASCII)."""
    choices: list[object] = [None, True, False, 0, -1, 1, 2, 10**6, -(10**18), 2**63, 1e308, -0.0, 0.5, "",
                             "ultra", "yes", "../../x", "é\u0000", [], {}]  # fmt: skip
    if depth < 3 and rng.random() < 0.3:
        if rng.random() < 0.5:
            return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["a", "config", "size"]): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return rng.choice(choices)


def _mutate(document: dict[str, Any], rng: random.Random) -> None:
    """Replaces (or drops) one value somewhere in `document`, in place."""
    node: Any = document
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            return
        key = rng.choice(keys)
        child = node[key]
        if isinstance(child, (dict, list)) and child and rng.random() < 0.6:
            node = child
            continue
        if isinstance(node, dict) and rng.random() < 0.15:
            del node[key]
        else:
            node[key] = _random_json(rng)
        return


def test_mutated_cache_records_are_accepted_or_tuning_errors(tmp_path: Path) -> None:
    from quiver.errors import TuningError
    from quiver.tuning import PerformanceCache

    fingerprint = {"backend": "cpu", "cpu": "Fuzz CPU", "cores": "2"}
    good = {"config": {"intra_op_num_threads": 1, "allow_spinning": False, "graph_optimization_level": "basic"},
            "changed": {"intra_op_num_threads": 1}, "default_ms": 2.0, "tuned_ms": 1.0}  # fmt: skip
    cache = PerformanceCache(tmp_path, fingerprint)
    rng = random.Random(5)
    outcomes: Counter[str] = Counter()
    for _ in range(2000):
        records = {"k": json.loads(json.dumps(good))}
        for _ in range(rng.randint(1, 3)):
            _mutate(records, rng)  # the records: a changed wrapper only makes the file another device's
        document = {"format": "quiver-performance-cache", "version": 1, "fingerprint": fingerprint, "records": records}
        cache.path.write_text(json.dumps(document))
        try:
            PerformanceCache(tmp_path, fingerprint)
            outcomes["accepted"] += 1
        except TuningError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 200 and outcomes["accepted"] > 20, outcomes  # both outcomes were reached


def test_mutated_dialog_configs_are_read_or_dialog_config_errors(tmp_path: Path) -> None:
    from quiver.errors import DialogConfigError
    from quiver.t2t.config import read_dialog_config

    for name in ("tokenizer.json", "model.qctx", "all.qsec"):
        (tmp_path / name).write_bytes(b"")  # the reader checks that named files exist, not what they hold
    good = {"dialog": {
        "context": {"size": 64, "n-vocab": 100, "bos-token": 0, "eos-token": [1, 2]},
        "sampler": {"seed": 1, "temp": 0.7, "top-k": 5, "top-p": 0.9, "greedy": False},
        "tokenizer": {"path": "tokenizer.json"},
        "engine": {"n-threads": 1, "backend": {"type": "cpu"}, "model": {"binary": {
            "ctx-bins": ["model.qctx"],
            "lora": {"alpha-tensor-name": "lora_alpha",
                     "adapters": [{"name": "all", "alphas": ["all"], "bin-sections": ["all.qsec"]}],
                     "groups": [{"name": "g", "members": ["all"]}]},
        }}},
    }}  # fmt: skip
    outcomes = _mutations_read(good, 6, lambda d: _written(tmp_path / "genie_config.json", json.dumps(d)),
                               read_dialog_config, DialogConfigError)  # fmt: skip
    assert outcomes["refused"] > 200 and outcomes["read"] > 20, outcomes  # both outcomes were reached


def test_mutated_lora_configs_are_read_or_adapter_errors(tmp_path: Path) -> None:
    import yaml

    from quiver.errors import AdapterError
    from quiver.lora.prepare import load_lora_config

    (tmp_path / "map.json").write_text(json.dumps({"q": "q_proj"}))
    (tmp_path / "base.onnx").write_bytes(b"")  # the reader checks that the base model exists, not what it holds
    good = {
        "adapter": [{"name": "chat", "lora_config": "chat"}, {"name": "sharp", "lora_config": "sharp"}],
        "use-case": [
            {"name": "base", "adapter_names": [], "model_name": "base.onnx"},
            {"name": "both", "adapter_names": ["chat", "sharp"], "adapter_alphas": [0.5, 1.0]},
        ],
        "attach_point_onnx_mapping": "map.json",
    }
    outcomes = _mutations_read(good, 7, lambda d: _written(tmp_path / "lora.yaml", yaml.safe_dump(d)),
                               load_lora_config, AdapterError)  # fmt: skip
    assert outcomes["refused"] > 200 and outcomes["read"] > 20, outcomes  # both outcomes were reached


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _mutations_read(
    good: dict[str, Any],
    seed: int,
    write: Callable[[dict[str, Any]], Path],
    read: Callable[[Path], object],
    refusal: type[Exception],
    count: int = 2000,
) -> Counter[str]:
    """Writes `count` mutations of `good` and reads each back: every one must be read or refused with
    `refusal` (anything else fails the test); how many of each."""
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    for _ in range(count):
        document = json.loads(json.dumps(good))
        for _ in range(rng.randint(1, 3)):
            _mutate(document, rng)
        path = write(document)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a QNN backend name or quant_overrides warns, and is read
                read(path)
            outcomes["read"] += 1
        except refusal:
            outcomes["refused"] += 1
    return outcomes

"""Tuning mode: knobs, the search and its accuracy gate, the performance cache, tuned contexts, the target server."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import socket
import struct
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import msgpack
import numpy as np
import pytest

import quiver
from quiver.backends.base import Knob, KnobValue
from quiver.backends.cpu import CpuBackend
from quiver.errors import BackendError, InvalidHeaderError, TargetServerError, TuningError
from quiver.formats.reader import ContextFile
from quiver.formats.tuned import TuningEntry
from quiver.formats.tuned_writer import write_tuned
from quiver.runtime.tuned import TuningWarning
from quiver.tuning import PerformanceCache, tier_name, tune_context
from quiver.tuning.client import RemoteProfiler, parse_target
from quiver.tuning.config import read_tuning_config
from quiver.tuning.profiler import LocalProfiler
from quiver.tuning.search import search
from quiver.tuning.server import TargetServer
from quiver.tuning.workload import workload_of
from tests.support.cli import assert_one_line_error
from tests.support.cli import quiver as run_quiver
from tests.support.helpers import executables

FINGERPRINT = {"backend": "cpu", "onnxruntime": "1.0", "cpu": "Test CPU 9000", "cores": "2"}


def _record(**config: object) -> dict[str, object]:
    """A cache record as `quiver tune` stores one."""
    return {"config": config, "changed": {}, "default_ms": 2.0, "tuned_ms": 1.5}


def _workload(context: quiver.Context, graph: str, input_ids: np.ndarray):  # type: ignore[no-untyped-def]
    return workload_of(context, graph, [{"input_ids": input_ids}])


# --- knobs and per-graph settings ---------------------------------------------------------------------
def test_the_cpu_backend_declares_its_knobs(family_context: Path) -> None:
    backend = CpuBackend()
    with quiver.Context.from_binary(family_context) as context:
        knobs = {k.name: k for k in backend.tunable_parameters(context.finalized_graph("base"))}
    for name in ("intra_op_num_threads", "allow_spinning", "dynamic_block_base", "graph_optimization_level", "prepack"):
        assert name in knobs and len(knobs[name].values) >= 2 or name == "intra_op_num_threads"
    assert "accuracy_level" not in knobs  # a float graph has no MatMulNBits: the knob would do nothing
    assert knobs["allow_spinning"].default is True and knobs["prepack"].default is True


def test_a_quantized_graph_may_turn_its_accuracy_level_and_the_exact_level_is_float(input_ids: np.ndarray) -> None:
    from quiver.passes.qdq import QuantizeOptions, quantize
    from quiver.testing.family import SMALL, make_family

    model = make_family(SMALL, count=1, seed=3)["base"]
    options = QuantizeOptions(weight_bits=4, block_size=32, activation_bits=16)
    quantized, _ = quantize(model, [{"input_ids": input_ids}], options)
    with quiver.Context.create("cpu") as context:
        context.add_graph("q", quantized)
        context.finalize()
        knobs = {k.name: k for k in CpuBackend().tunable_parameters(context.finalized_graph("q"))}
    assert knobs["accuracy_level"].default == 4 and knobs["accuracy_level"].exact == 0


def _tuned_copy(source: Path, destination: Path, graphs: Mapping[str, Mapping[str, KnobValue]], here: bool) -> Path:
    fingerprint = CpuBackend().device_fingerprint() if here else FINGERPRINT
    with ContextFile.open(source) as file:
        return write_tuned(file, destination, [TuningEntry(tier_name(fingerprint), fingerprint, graphs)])


def test_a_tuned_context_runs_each_graph_with_its_configuration(
    family_context: Path, tmp_path: Path, input_ids: np.ndarray
) -> None:
    tuned = _tuned_copy(
        family_context, tmp_path / "t.qctx", {"base": {"prepack": False, "intra_op_num_threads": 1}}, True
    )
    with quiver.Context.from_binary(tuned) as context, quiver.Context.from_binary(family_context) as plain:
        for name in ("base", "finetune_1"):
            (tuned_output,) = context.graph(name).execute({"input_ids": input_ids}).values()
            (plain_output,) = plain.graph(name).execute({"input_ids": input_ids}).values()
            np.testing.assert_allclose(tuned_output, plain_output, rtol=1e-5, atol=1e-6)
        live = executables(context)
        assert not live["base"].settings.prepack and live["base"].settings.intra_op_num_threads == 1
        assert live["finetune_1"].settings.prepack  # graphs without an entry keep the defaults


def test_settings_the_user_chose_win_over_the_tuned_ones(
    family_context: Path, tmp_path: Path, input_ids: np.ndarray
) -> None:
    tuned = _tuned_copy(
        family_context, tmp_path / "t.qctx", {"base": {"intra_op_num_threads": 1, "prepack": False}}, True
    )
    with quiver.Context.from_binary(tuned, backend=CpuBackend(intra_op_num_threads=2)) as context:
        context.graph("base").execute({"input_ids": input_ids})
        settings = executables(context)["base"].settings
    assert settings.intra_op_num_threads == 2 and not settings.prepack


def test_a_context_tuned_on_another_device_warns_once_and_runs_with_defaults(
    family_context: Path, tmp_path: Path, input_ids: np.ndarray
) -> None:
    tuned = _tuned_copy(family_context, tmp_path / "t.qctx", {"base": {"prepack": False}}, here=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiver.Context.from_binary(tuned) as context:
            context.graph("base").execute({"input_ids": input_ids})
            assert executables(context)["base"].settings.prepack
    tuning = [w for w in caught if issubclass(w.category, TuningWarning)]
    assert len(tuning) == 1
    assert "Test CPU 9000" in str(tuning[0].message) and "onnxruntime" in str(tuning[0].message)


def test_sections_made_for_a_context_apply_to_its_tuned_copy(tmp_path: Path) -> None:
    from tests.support.lora_branch import BRANCH_X as X
    from tests.support.lora_branch import branch_adapter as _adapter
    from tests.support.lora_branch import branch_expected as _expected
    from tests.support.lora_branch import lora_branch_model as _lora_model

    with quiver.Context.create("cpu") as maker:
        maker.add_graph("lora", _lora_model(), updateable=["lora_A", "lora_B"])
        source = maker.save(tmp_path / "lora.qctx")
        maker.graph("lora").update_tensors(_adapter(1))
        maker.graph("lora").finalize()
        section = tmp_path / "one.qsec"
        section.write_bytes(maker.get_binary_section("lora"))
    tuned = _tuned_copy(source, tmp_path / "t.qctx", {"lora": {"prepack": False}}, True)
    with ContextFile.open(source) as a, ContextFile.open(tuned) as b:
        assert a.identity == b.identity and a.header_sha256 != b.header_sha256
        assert b.verify() == []  # every region copied byte for byte
    with quiver.Context.from_binary(tuned) as context:
        context.apply_binary_section("lora", section)
        np.testing.assert_allclose(
            context.graph("lora").execute({"x": X})["y"], _expected(X, _adapter(1)), rtol=1e-4, atol=1e-4
        )
        # a section made from the tuned copy names the same context
        again = context.get_binary_section("lora")
    with quiver.Context.from_binary(source) as original:
        original.apply_binary_section("lora", again)


def test_a_tuning_the_reader_would_refuse_is_never_written(family_context: Path, tmp_path: Path) -> None:
    out = tmp_path / "tuned.qctx"
    shutil.copyfile(family_context, out)
    before = out.read_bytes()
    nested = TuningEntry("t", {"backend": "cpu"}, {"base": {"prepack": {"a": 1}}})  # type: ignore[dict-item]
    with ContextFile.open(family_context) as file, pytest.raises(InvalidHeaderError, match="tuning"):
        write_tuned(file, out, [nested])
    assert out.read_bytes() == before and list(tmp_path.iterdir()) == [out]  # untouched, no temporary left


@pytest.mark.parametrize(
    "tuning",
    [
        "nope",
        [{"fingerprint": "x", "graphs": {}}],
        [{"tier": "t", "fingerprint": {}, "graphs": {"no-such-graph": {"config": {}}}}],
        [{"tier": "t", "fingerprint": {}, "graphs": {"base": {"config": {"prepack": [1]}}}}],
    ],
)
def test_a_malformed_tuning_field_is_an_invalid_header(family_context: Path, tmp_path: Path, tuning: object) -> None:
    import hashlib

    from quiver.formats.layout import MAGIC, PREAMBLE_SIZE, Preamble

    with ContextFile.open(family_context) as file:
        header = json.loads(bytes(file.buffer[file.header_offset :]))
        header["tuning"] = tuning
        data = json.dumps(header).encode()
        body = bytes(file.buffer[PREAMBLE_SIZE : file.header_offset])
        offset = file.header_offset
    preamble = Preamble(1, 4, 0, offset, len(data), offset + len(data), hashlib.sha256(data).digest())
    path = tmp_path / "bad.qctx"
    path.write_bytes(preamble.pack(MAGIC) + body + data)
    with pytest.raises(InvalidHeaderError, match="tuning"):
        ContextFile.open(path)


# --- the search, on a profiler whose timings and outputs are made up ----------------------------------
class FakeProfiler:
    """Times are `base × factor(config) × noise`; outputs are 1.0 plus an error per config."""

    def __init__(
        self,
        factors: Mapping[tuple[str, KnobValue], float],
        errors: Mapping[tuple[str, KnobValue], float] = {},
        noise: float = 0.005,
    ) -> None:
        self.factors, self.errors, self.noise = factors, errors, noise
        self.random = random.Random(5)
        self.configs: dict[str, dict[str, KnobValue]] = {}
        self.prepared = 0

    def prepare(self, graph: str, config: Mapping[str, KnobValue]) -> str:
        self.prepared += 1
        handle = f"v{self.prepared}"
        self.configs[handle] = dict(config)
        return handle

    def _product(
        self, table: Mapping[tuple[str, KnobValue], float], config: Mapping[str, KnobValue], start: float, combine
    ) -> float:  # type: ignore[no-untyped-def]
        value = start
        for item in config.items():
            if item in table:
                value = combine(value, table[item])
        return value

    def time(self, variant: str, inputs: str, index: int, runs: int) -> list[float]:
        factor = self._product(self.factors, self.configs[variant], 1.0, lambda a, b: a * b)
        return [0.01 * factor * (1 + self.random.uniform(-self.noise, self.noise)) for _ in range(runs)]

    def outputs(self, variant: str, inputs: str) -> list[dict[str, np.ndarray]]:
        error = self._product(self.errors, self.configs[variant], 0.0, lambda a, b: a + b)
        return [{"y": np.linspace(1.0, 2.0, 64, dtype=np.float32) + np.float32(error)}]

    def release(self, variant: str) -> None:
        pass


KNOBS = (Knob("threads", (0, 1)), Knob("block", (0, 2, 4)), Knob("level", (4, 0), exact=0))


def _search(profiler: FakeProfiler, budget_s: float = 60.0):  # type: ignore[no-untyped-def]
    return search(profiler, "g", KNOBS, "i", time.monotonic() + budget_s)  # type: ignore[arg-type]


def test_the_search_takes_a_clearly_faster_value_and_reports_it() -> None:
    result = _search(FakeProfiler({("block", 4): 0.8}))
    assert result.config == {"threads": 0, "block": 4, "level": 4}
    assert result.tuned_ms < result.default_ms * 0.85
    verdicts = {(c.knob, c.value): c.verdict for c in result.candidates}
    assert verdicts[("block", 4)] == "faster" and verdicts[("threads", 1)] == "not faster"
    assert result.measured == 4


def test_the_search_keeps_the_defaults_when_no_gain_beats_the_noise() -> None:
    result = _search(FakeProfiler({("block", 2): 0.99, ("threads", 1): 1.5}, noise=0.03))
    assert result.config == {"threads": 0, "block": 0, "level": 4}
    assert result.noise > 0.01


def test_a_faster_value_that_loses_accuracy_is_refused() -> None:
    # level 0 is exact: the reference. The defaults (level 4) are off by 1e-3; threads=1 by 1e-1.
    profiler = FakeProfiler({("threads", 1): 0.5}, {("level", 4): 1e-3, ("threads", 1): 1e-1})
    result = _search(profiler)
    assert result.config["threads"] == 0
    verdict = next(c for c in result.candidates if c.knob == "threads")
    assert verdict.verdict == "less accurate"
    more_exact = next(c for c in result.candidates if c.knob == "level")
    assert more_exact.verdict != "less accurate"  # more accurate than the defaults passes the gate


def test_the_search_stops_measuring_when_the_budget_is_spent() -> None:
    result = _search(FakeProfiler({("block", 4): 0.5}), budget_s=0)
    assert result.out_of_budget and result.measured == 0 and result.config["block"] == 0
    assert all(c.verdict == "budget" for c in result.candidates)


# --- the performance cache ----------------------------------------------------------------------------
def test_each_device_fingerprint_gets_its_own_cache_file(tmp_path: Path) -> None:
    a = PerformanceCache(tmp_path, FINGERPRINT)
    b = PerformanceCache(tmp_path, {**FINGERPRINT, "onnxruntime": "2.0"})
    assert a.path != b.path and a.path.name.startswith("cpu-test-cpu-9000-2c-")
    a.store("k", _record(intra_op_num_threads=1))
    assert PerformanceCache(tmp_path, FINGERPRINT).lookup("k") == _record(intra_op_num_threads=1)
    assert b.lookup("k") is None


def test_a_cache_file_from_another_device_is_rebuilt_and_says_what_changed(tmp_path: Path) -> None:
    cache = PerformanceCache(tmp_path, FINGERPRINT)
    cache.store("k", _record())
    moved = tmp_path / "other"
    moved.mkdir()
    changed = {**FINGERPRINT, "cores": "8"}
    (moved / f"{tier_name(changed)}.json").write_text(cache.path.read_text())  # a copied (or colliding) file
    reopened = PerformanceCache(moved, changed)
    assert reopened.lookup("k") is None and len(reopened) == 0
    assert any("cores '2' -> '8'" in note for note in reopened.notes)


def test_invalidating_the_cache_empties_this_tier_only(tmp_path: Path) -> None:
    PerformanceCache(tmp_path, FINGERPRINT).store("k", _record())
    other = PerformanceCache(tmp_path, {**FINGERPRINT, "cpu": "Other"})
    other.store("k", _record())
    assert PerformanceCache(tmp_path, FINGERPRINT, invalidate=True).lookup("k") is None
    assert PerformanceCache(tmp_path, {**FINGERPRINT, "cpu": "Other"}).lookup("k") is not None


def test_a_damaged_cache_file_is_a_tuning_error_that_says_what_to_do(tmp_path: Path) -> None:
    cache = PerformanceCache(tmp_path, FINGERPRINT)
    cache.path.write_text("{not json")
    with pytest.raises(TuningError, match="invalidate-performance-cache"):
        PerformanceCache(tmp_path, FINGERPRINT)


@pytest.mark.parametrize(
    "record, field",
    [
        (_record(intra_op_num_threads=1_000_000), "intra_op_num_threads=1000000 is out of range"),
        (_record(intra_op_num_threads={"a": {"b": 1}}), "is not an int"),
        (_record(graph_optimization_level="ultra"), "graph_optimization_level='ultra'"),
        (_record(dynamic_block_base=-5), "dynamic_block_base=-5"),
        (_record(allow_spinning="yes"), "allow_spinning='yes'"),
        (_record(turbo=True), "'turbo' is not a knob"),
        ({**_record(), "default_ms": "fast"}, "'default_ms' must be a duration"),
        ({**_record(), "tuned_ms": [1]}, "'tuned_ms' must be a duration"),
        ({**_record(), "changed": [1, 2]}, "'changed' must be"),
        ({**_record(), "changed": {"prepack": False}}, "'changed' must be"),
        ([1], "not a JSON object"),
    ],
)
def test_a_bad_cache_record_is_an_error_naming_the_file_and_the_field(
    tmp_path: Path, record: object, field: str
) -> None:
    cache = PerformanceCache(tmp_path, FINGERPRINT)
    cache.store("good", _record())
    document = json.loads(cache.path.read_text())
    document["records"]["bad"] = record
    cache.path.write_text(json.dumps(document))
    with pytest.raises(TuningError) as raised:
        PerformanceCache(tmp_path, FINGERPRINT)
    assert str(cache.path) in str(raised.value) and field in str(raised.value), raised.value


def test_a_deeply_nested_or_non_regular_cache_file_is_a_tuning_error(tmp_path: Path) -> None:
    cache = PerformanceCache(tmp_path, FINGERPRINT)
    cache.path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TuningError, match="damaged"):
        PerformanceCache(tmp_path, FINGERPRINT)
    cache.path.unlink()
    os.mkfifo(cache.path)  # would block a reader forever
    with pytest.raises(TuningError, match="not a regular file"):
        PerformanceCache(tmp_path, FINGERPRINT)


def _store_many(folder: str, prefix: str) -> None:
    cache = PerformanceCache(folder, FINGERPRINT)
    for i in range(40):
        cache.store(f"{prefix}{i}", _record(dynamic_block_base=i % 3 * 2))


def test_two_tuners_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_store_many, args=(str(tmp_path), p)) for p in "ab"]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    cache = PerformanceCache(tmp_path, FINGERPRINT)
    assert len(cache) == 80 and cache.lookup("a39") == _record(dynamic_block_base=39 % 3 * 2)


# --- the tuning config file ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "document, message",
    [
        ({"performance_cache_dir": "c"}, "tuning_mode"),
        ({"tuning_mode": False, "invalidate_performance_cache": True}, "tuning_mode"),
        ({"tuning_mode": True, "invalidate_performance_cache": True}, "needs a performance_cache_dir"),
        ({"tuning_mode": "yes"}, "true or false"),
        ({"tuning_mode": True, "cache": "c"}, "unknown keys"),
        ({"tuning_mode": True, "budget_s": -1}, "budget_s"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_tuning_configs_are_refused(tmp_path: Path, document: object, message: str) -> None:
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(document))
    with pytest.raises(TuningError, match=message):
        read_tuning_config(path)


def test_a_tuning_config_resolves_its_cache_folder_next_to_itself(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"tuning_mode": True, "performance_cache_dir": "perf"}))
    config = read_tuning_config(path)
    assert config.tuning_mode and config.performance_cache_dir == tmp_path / "perf"


# --- tuning for real, on the cpu backend --------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four 1024-wide MatMul + Relu layers on 64 rows: heavy enough that threads and packing clearly
    matter (a few ms a run), so some choices are not ties."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, previous = [], [], "x"
    for layer in range(4):
        weight = (rng.standard_normal((1024, 1024)) / 32).astype(np.float32)
        weights.append(numpy_helper.from_array(weight, f"w{layer}"))
        nodes += [
            helper.make_node("MatMul", [previous, f"w{layer}"], [f"m{layer}"]),
            helper.make_node("Relu", [f"m{layer}"], [f"h{layer}"]),
        ]
        previous = f"h{layer}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 1024])],
        [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [64, 1024])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with quiver.Context.create("cpu") as context:
        context.add_graph("mlp", model)
        return context.save(tmp_path_factory.mktemp("mlp") / "mlp.qctx")


MLP_INPUT = np.random.default_rng(1).standard_normal((64, 1024)).astype(np.float32)


@pytest.fixture(scope="module")
def tuned_locally(mlp_context: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("tuned")
    with quiver.Context.from_binary(mlp_context) as context:
        workload = workload_of(context, "mlp", [{"x": MLP_INPUT}])
        result = tune_context(context, [workload], folder / "t.qctx", cache_dir=folder / "cache", budget_s=120)
    return result, workload


def test_tuning_on_the_cpu_backend_measures_every_candidate_and_stores_the_choice(tuned_locally) -> None:  # type: ignore[no-untyped-def]
    result, _ = tuned_locally
    graph = result.graphs["mlp"]
    assert graph.measured == len(graph.candidates) >= 6
    verdicts = {(c["knob"], c["value"]): c["verdict"] for c in graph.candidates}
    assert verdicts[("prepack", False)] in ("faster", "not faster")  # measured, and as accurate (rounding only)
    with ContextFile.open(result.output) as file:
        (entry,) = file.tuning
        assert entry.graphs["mlp"] == graph.config and entry.tier == result.tier
        assert dict(entry.fingerprint) == CpuBackend().device_fingerprint()


def test_a_warm_cache_measures_nothing(tuned_locally, mlp_context: Path) -> None:  # type: ignore[no-untyped-def]
    first, workload = tuned_locally
    with quiver.Context.from_binary(mlp_context) as context:
        start = time.perf_counter()
        again = tune_context(context, [workload], None, cache_dir=first.cache.parent)
        elapsed = time.perf_counter() - start
        assert again.graphs["mlp"].measured == 0 and again.graphs["mlp"].config == first.graphs["mlp"].config
        assert elapsed < 1.0
        fresh = tune_context(context, [workload], None, cache_dir=first.cache.parent, invalidate=True, budget_s=0)
    assert fresh.graphs["mlp"].measured == 0 and fresh.graphs["mlp"].out_of_budget  # measuring began again


def _with_set_timings(profiler_class: type) -> type:
    """A profiler that really prepares, runs and compares variants (here or on the server) but reports
    set times: dynamic block base 4 is 20 % faster, one thread 50 % slower. Whatever the machine's load,
    the search must then choose the same wherever the variants are prepared."""

    class SetTimings(profiler_class):  # type: ignore[misc,valid-type]
        configs: dict[str, dict[str, KnobValue]]

        def prepare(self, graph: str, config: Mapping[str, KnobValue]) -> str:
            variant = super().prepare(graph, config)
            self.configs = {**getattr(self, "configs", {}), variant: dict(config)}
            return variant

        def time(self, variant: str, inputs: str, index: int, runs: int) -> list[float]:
            super().time(variant, inputs, index, 1)  # the variant runs, wherever it lives
            config = self.configs[variant]
            factor = (0.8 if config["dynamic_block_base"] == 4 else 1.0) * (
                1.5 if config["intra_op_num_threads"] == 1 else 1.0
            )
            return [0.005 * factor] * runs

    return SetTimings


def test_tuning_through_a_target_server_chooses_what_local_tuning_chooses(
    tuned_locally,  # type: ignore[no-untyped-def]
    mlp_context: Path,
    family_context: Path,
) -> None:
    _, workload = tuned_locally
    with TargetServer(port=0, token="t0k3n").start() as server:
        with quiver.Context.from_binary(mlp_context) as context:
            local = tune_context(context, [workload], None, profiler=_with_set_timings(LocalProfiler)(), budget_s=120)
            remote = _with_set_timings(RemoteProfiler)(f"127.0.0.1:{server.port}", token="t0k3n")
            result = tune_context(context, [workload], None, profiler=remote, budget_s=120)
            first_bytes = remote.sent_bytes
            remote.close()
            weights = sum(a.nbytes for a in context.finalized_graph("mlp").weights.values())
        local_graph, remote_graph = local.graphs["mlp"], result.graphs["mlp"]
        assert remote_graph.config == local_graph.config and local_graph.changed == {"dynamic_block_base": 4}
        assert remote_graph.candidates == local_graph.candidates  # the same verdicts and accuracy, knob by knob
        assert result.fingerprint == local.fingerprint  # the server's device: here, this one
        assert weights + MLP_INPUT.nbytes == first_bytes  # the weights and the input, once
        context = quiver.Context.from_binary(family_context)
        # graphs of a family, from two tuners: only what the server lacks travels
        first = RemoteProfiler(f"127.0.0.1:{server.port}", token="t0k3n")
        first.load(context.finalized_graph("base"), {})
        assert first.sent_bytes == sum(a.nbytes for a in context.finalized_graph("base").weights.values())
        first.close()
        second = RemoteProfiler(f"127.0.0.1:{server.port}", token="t0k3n")
        second.load(context.finalized_graph("base"), {})
        assert second.sent_bytes == 0
        tuned_graph = context.finalized_graph("finetune_1")
        second.load(tuned_graph, {})
        shared = set(map(id, context.finalized_graph("base").weights.values()))
        own = sum(a.nbytes for a in tuned_graph.weights.values() if id(a) not in shared)
        assert second.sent_bytes == own > 0
        second.close()
        context.close()


# --- the target server against bad clients ------------------------------------------------------------
def _frame(message: object) -> bytes:
    data = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(data)) + data


def _exchange(port: int, payload: bytes, close_after: bool = False) -> object:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(payload)
        if close_after:
            sock.shutdown(socket.SHUT_WR)
        header = b""
        while len(header) < 4:
            chunk = sock.recv(4 - len(header))
            if not chunk:
                return None  # closed without a reply
            header += chunk
        (length,) = struct.unpack(">I", header)
        body = b""
        while len(body) < length:
            body += sock.recv(length - len(body))
        return msgpack.unpackb(body)


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    with TargetServer(
        port=0, token="secret", max_store_bytes=64 << 20, idle_timeout_s=2, auth_timeout_s=2, frame_timeout_s=2
    ).start() as running:
        yield running


def _hello() -> bytes:
    return _frame({"op": "hello", "token": "secret"})


@pytest.mark.parametrize(
    "payload, kind",
    [
        (struct.pack(">I", 0xFFFFFFF0), "too-large"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "bad-frame"),
        (_frame([1, 2, 3]), "unauthorized"),
        (_frame({"op": "prepare", "graph": "g1", "config": {}}), "unauthorized"),
        (_frame({"op": "hello", "token": "wrong"}), "unauthorized"),
        (_hello() + _frame({"op": "fly"}), "bad-request"),
        (_hello() + _frame({"op": "missing", "keys": ["float32/2/zz"]}), "bad-request"),
        (_hello() + _frame({"op": "missing", "keys": "x"}), "bad-request"),
        (_hello() + _frame({"op": "time", "variant": "v1", "inputs": "i1", "index": 0, "runs": 5}), "unknown-handle"),
        (_hello() + _frame({"op": "time", "variant": "v1", "inputs": "i1", "index": True, "runs": 5}), "bad-request"),
        (
            _hello() + _frame({"op": "put", "key": "float32/1x1000000000000/" + "0" * 64, "offset": 0, "data": b""}),
            "too-large",
        ),
        (_hello() + _frame({"op": "put", "key": "float32/4/" + "0" * 64, "offset": 0, "data": b"\0" * 16}), "checksum"),
        (_hello() + _frame({"op": "load_graph", "name": "g", "model": b"\xff\xff", "weights": {}}), "bad-request"),
        (_hello() + _frame({"op": "prepare", "graph": "g1", "config": {"a": [1]}}), "bad-request"),
    ],
)
def test_bad_messages_get_typed_errors_and_the_next_client_is_served(
    server: TargetServer, payload: bytes, kind: str
) -> None:
    replies = []
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)  # the server answers what it got, then sees the end
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    unpacker_offset = 0
    while unpacker_offset + 4 <= len(data):
        (length,) = struct.unpack(">I", data[unpacker_offset : unpacker_offset + 4])
        replies.append(msgpack.unpackb(data[unpacker_offset + 4 : unpacker_offset + 4 + length]))
        unpacker_offset += 4 + length
    assert replies and replies[-1]["ok"] is False and replies[-1]["error"] == kind, replies
    _assert_served(server)


def _assert_served(server: TargetServer) -> None:
    client = RemoteProfiler(f"127.0.0.1:{server.port}", token="secret", timeout_s=10)
    assert client.fingerprint()["backend"] == "cpu"
    client.close()


def test_random_and_truncated_frames_never_stop_the_server(server: TargetServer) -> None:
    generator = random.Random(11)
    for _ in range(30):
        junk = bytes(generator.getrandbits(8) for _ in range(generator.randint(1, 200)))
        try:
            _exchange(server.port, junk, close_after=True)
        except (TimeoutError, OSError):
            pass
    valid = _hello()
    for cut in (1, 3, 6, len(valid) - 1):
        assert _exchange(server.port, valid[:cut], close_after=True) is None
    _assert_served(server)


def test_a_silent_client_is_dropped_after_the_idle_timeout(server: TargetServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(struct.pack(">I", 100))  # a frame that never comes
        start = time.monotonic()
        assert sock.recv(10) == b""  # closed by the server
        assert time.monotonic() - start < 8
    _assert_served(server)


def test_a_frame_that_trickles_in_is_dropped(server: TargetServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(struct.pack(">I", 1000))
        start = time.monotonic()
        try:
            while time.monotonic() - start < 8:
                sock.sendall(b"\x00")  # a byte a second: never idle, never done
                time.sleep(1.0)
        except OSError:
            pass  # closed by the server
        assert time.monotonic() - start < 8
    _assert_served(server)


def test_client_errors_are_typed(server: TargetServer) -> None:
    with pytest.raises(TargetServerError) as wrong_token:
        RemoteProfiler(f"127.0.0.1:{server.port}", token="nope")
    assert wrong_token.value.kind == "unauthorized"
    with pytest.raises(TargetServerError, match="HOST:PORT"):
        parse_target("host:port")
    assert parse_target("example:1234") == ("example", 1234) and parse_target("h") == ("h", 22598)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(TargetServerError, match="cannot reach"):
        RemoteProfiler(f"127.0.0.1:{port}")


def test_a_backend_failure_on_the_server_is_a_backend_error_for_the_client(
    server: TargetServer, family_context: Path
) -> None:
    client = RemoteProfiler(f"127.0.0.1:{server.port}", token="secret")
    with quiver.Context.from_binary(family_context) as context:
        graph, _ = client.load(context.finalized_graph("base"), {})
    with pytest.raises(BackendError):
        client.prepare(graph, {"graph_optimization_level": "ultra"})
    client.close()


# --- the command line ---------------------------------------------------------------------------------
def _input_list(folder: Path, input_ids: np.ndarray) -> Path:
    np.save(folder / "ids.npy", input_ids)
    (folder / "list.txt").write_text(f"input_ids:={folder / 'ids.npy'}\n")
    return folder / "list.txt"


def test_quiver_tune_prints_json_and_a_warm_run_measures_nothing(
    family_context: Path, tmp_path: Path, input_ids: np.ndarray
) -> None:
    listing = _input_list(tmp_path, input_ids)
    out = tmp_path / "tuned" / "t.qctx"  # a folder not made yet
    args = ["tune", family_context, "--graph", "base", "--input-list", listing, "-o", out]
    config = tmp_path / "tuning.json"
    config.write_text(json.dumps({"tuning_mode": True, "performance_cache_dir": "perf"}))
    first = run_quiver(*args, "--config-file", config, "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    base = report["graphs"]["base"]
    assert set(report["graphs"]) == {"base"} and base["measured"] >= 6
    assert {"config", "default_ms", "tuned_ms", "measured"} <= set(base)
    assert Path(report["performance_cache"]).parent == tmp_path / "perf"
    second = run_quiver(*args, "--performance-cache-dir", tmp_path / "perf", "--json")
    assert json.loads(second.stdout)["graphs"]["base"]["measured"] == 0
    table = run_quiver(*args, "--performance-cache-dir", tmp_path / "perf")
    assert "0 (cache)" in table.stdout and "tuned for cpu-" in table.stdout
    inspected = json.loads(run_quiver("inspect", out, "--json").stdout)
    assert inspected["tuning"][0]["tier"] == report["tier"] and list(inspected["tuning"][0]["graphs"]) == ["base"]
    assert report["tier"] in run_quiver("inspect", out).stdout


def test_quiver_tune_errors_are_one_line(family_context: Path, tmp_path: Path, input_ids: np.ndarray) -> None:
    listing = _input_list(tmp_path, input_ids)
    out = tmp_path / "t.qctx"
    assert_one_line_error(run_quiver("tune", family_context, "-o", out), "--input-list")
    assert_one_line_error(
        run_quiver("tune", family_context, "--input-list", listing, "--graph", "nope", "-o", out), "nope"
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"performance_cache_dir": "x"}))
    assert_one_line_error(
        run_quiver("tune", family_context, "--input-list", listing, "-o", out, "--config-file", bad), "tuning_mode"
    )
    assert_one_line_error(
        run_quiver("tune", family_context, "--input-list", listing, "-o", out, "--target", "127.0.0.1:1"),
        "cannot reach",
    )
    cache = PerformanceCache(tmp_path / "perf", CpuBackend().device_fingerprint())
    cache.store("copied", _record(intra_op_num_threads=1_000_000))  # as a hand-edited or hostile file holds
    assert_one_line_error(
        run_quiver("tune", family_context, "--input-list", listing, "-o", out, "--performance-cache-dir",
                   tmp_path / "perf"),
        "intra_op_num_threads=1000000 is out of range",
    )  # fmt: skip
    assert not out.exists()


def test_a_tuned_value_this_machine_cannot_honour_leaves_the_default() -> None:
    from quiver.backends.cpu import SessionSettings

    tuned = {"intra_op_num_threads": 1_000_000, "dynamic_block_base": 2, "accuracy_level": 9, "prepack": "no"}
    assert SessionSettings().tuned(tuned) == SessionSettings(dynamic_block_base=2)


def test_quiver_build_with_a_tuning_config_tunes_the_context(
    family_files: dict[str, Path], tmp_path: Path, input_ids: np.ndarray
) -> None:
    listing = _input_list(tmp_path, input_ids)
    config = tmp_path / "tuning.json"
    config.write_text(json.dumps({"tuning_mode": True, "performance_cache_dir": "perf", "budget_s": 5}))
    out = tmp_path / "built.qctx"
    result = run_quiver("build", family_files["base"], "-o", out, "--config-file", config, "--input-list", listing)
    assert result.returncode == 0, result.stderr
    with ContextFile.open(out) as file:
        assert list(file.tuning[0].graphs) == ["base"]
    # without sample inputs: refused before anything is written (no untuned file left behind)
    untuned = tmp_path / "untuned.qctx"
    assert_one_line_error(run_quiver("build", family_files["base"], "-o", untuned, "--config-file", config),
                          "--input-list")  # fmt: skip
    assert not untuned.exists()


def test_quiver_target_server_serves_until_interrupted(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "quiver", "target-server", "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert f"127.0.0.1:{port}" in process.stdout.readline()
        client = RemoteProfiler(f"127.0.0.1:{port}")
        assert client.fingerprint() == CpuBackend().device_fingerprint()
        client.close()
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


def test_the_t2t_context_tunes_on_real_steps_without_changing_greedy_tokens(tmp_path: Path) -> None:
    from quiver.t2t.dialog import Dialog
    from quiver.t2t.export import ExportOptions, export
    from tests.support.tiny_llm import tiny_decoder

    tiny_decoder(tmp_path / "model", "LlamaForCausalLM")
    config = export(tmp_path / "model", tmp_path / "out", {}, options=ExportOptions(context_size=64)).path
    result = run_quiver(
        "t2t", "tune", "-c", config, "-o", tmp_path / "out" / "model.qctx", "--prompt-tokens", "20",
        "--performance-cache-dir", tmp_path / "perf", "--budget-s", "60", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["graphs"]) == {"prefill", "decode"}
    with ContextFile.open(tmp_path / "out" / "model.qctx") as file:
        assert set(file.tuning[0].graphs) == {"prefill", "decode"}
    with Dialog.from_config(config) as dialog:  # the tuned context, in place of the original
        assert len(dialog.query("the quick brown fox", max_new_tokens=5, greedy=True).new_ids) == 5


def test_a_local_profiler_needs_a_tunable_backend() -> None:
    from quiver.backends import get_backend

    with pytest.raises(TuningError, match="tunable"):
        LocalProfiler(get_backend("reference"))

"""Tunes a context's graphs on a profiler, through the performance cache, and writes the tuned context."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from quiver.backends.base import KnobValue
from quiver.formats.reader import ContextFile
from quiver.formats.tuned import TuningEntry
from quiver.formats.tuned_writer import write_tuned
from quiver.runtime.context import Context
from quiver.tuning import accuracy, search
from quiver.tuning.cache import PerformanceCache, tier_name
from quiver.tuning.profiler import LocalProfiler, Profiler
from quiver.tuning.workload import Workload

# Part of every cache key: raised when the search or its accuracy gate change what they would choose.
SEARCH_VERSION = 1


@dataclass
class GraphResult:
    config: dict[str, KnobValue]
    default_ms: float
    tuned_ms: float
    measured: int  # candidates profiled in this run (0 from the cache)
    changed: dict[str, KnobValue] = field(default_factory=dict)  # the config's values that are not defaults
    noise: float | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)
    out_of_budget: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "changed": self.changed,
            "default_ms": round(self.default_ms, 4),
            "tuned_ms": round(self.tuned_ms, 4),
            "measured": self.measured,
            **({"noise": round(self.noise, 4)} if self.noise is not None else {}),
            **({"candidates": self.candidates} if self.candidates else {}),
            **({"out_of_budget": True} if self.out_of_budget else {}),
        }


@dataclass
class TuneResult:
    graphs: dict[str, GraphResult]
    tier: str
    fingerprint: dict[str, str]
    output: Path | None = None
    cache: Path | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "graphs": {name: r.to_json() for name, r in self.graphs.items()},
            "tier": self.tier,
            "fingerprint": self.fingerprint,
            "output": None if self.output is None else str(self.output),
            "performance_cache": None if self.cache is None else str(self.cache),
            "notes": self.notes,
        }


def weight_keys(file: ContextFile, graph: str) -> dict[str, str]:
    """Each stored weight of the graph by content: dtype, shape, checksum (and encoding checksum)."""
    keys = {}
    for name, index in file.graphs[graph].weights.items():
        weight = file.weights[index]
        keys[name] = "/".join([weight.dtype, "x".join(map(str, weight.shape)), *weight.key[2:]]).rstrip("/")
    return keys


def cache_key(file: ContextFile, graph: str, workload: Workload, knob_space_version: int) -> str:
    """The graph's content (skeleton and weights), the shapes it runs on, and what the search would do."""
    shapes = [
        sorted((n, a.dtype.str, list(a.shape)) for n, a in {**s.feeds, **s.bound}.items()) for s in workload.feed_sets
    ]
    described = {
        "skeleton": file.graphs[graph].sha256,
        "weights": sorted(weight_keys(file, graph).items()),
        "updateable": sorted(file.graphs[graph].updateable),
        "shapes": shapes,
        "knob_space": knob_space_version,
        "search": [SEARCH_VERSION, search.ROUNDS, accuracy.SQNR_CAP_DB, accuracy.SQNR_SLACK_DB],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _candidate_json(candidate: search.Candidate) -> dict[str, Any]:
    """A candidate for JSON: no absent fields; an infinite SQNR (identical outputs) as the string "inf"."""
    fields = {k: v for k, v in dataclasses.asdict(candidate).items() if v is not None}
    if isinstance(fields.get("sqnr_db"), float) and not math.isfinite(fields["sqnr_db"]):
        fields["sqnr_db"] = "inf" if fields["sqnr_db"] > 0 else "-inf"
    return fields


def _report(on_progress: Callable[[str], object], graph: str, candidate: search.Candidate) -> None:
    on_progress(f"{graph}: {candidate.knob}={candidate.value!r}: {candidate.verdict}")


def tune_context(
    context: Context,
    workloads: Sequence[Workload],
    output: str | Path | None = None,
    profiler: Profiler | None = None,
    cache_dir: str | Path | None = None,
    invalidate: bool = False,
    budget_s: float = 600.0,
    on_progress: Callable[[str], object] = lambda _: None,
) -> TuneResult:
    """Tunes each workload's graph (or takes its configuration from the cache) and, with `output`, writes
    the context with the chosen configurations stored for this device tier (other tiers' are kept)."""
    profiler = profiler if profiler is not None else LocalProfiler()
    file = context.file
    fingerprint = profiler.fingerprint()
    version = profiler.knob_space_version()
    cache = PerformanceCache(cache_dir, fingerprint, invalidate) if cache_dir is not None else None
    result = TuneResult({}, tier_name(fingerprint), fingerprint, cache=None if cache is None else cache.path)
    if cache is not None:
        result.notes.extend(cache.notes)
    deadline = time.monotonic() + budget_s
    for workload in workloads:
        key = cache_key(file, workload.graph, workload, version)
        record = cache.lookup(key) if cache is not None else None
        if record is not None:  # checked when the cache was read
            on_progress(f"{workload.graph}: from the performance cache")
            result.graphs[workload.graph] = GraphResult(
                dict(record["config"]),
                float(record["default_ms"]),
                float(record["tuned_ms"]),
                0,
                dict(record.get("changed") or {}),
            )
            continue
        on_progress(f"{workload.graph}: measuring")
        graph = dataclasses.replace(context.finalized_graph(workload.graph), tuning={})  # from the defaults
        handle, knobs = profiler.load(graph, weight_keys(file, workload.graph))
        inputs = profiler.upload(workload.feed_sets)
        found = search.search(
            profiler,
            handle,
            knobs,
            inputs,
            deadline,
            partial(_report, on_progress, workload.graph),
        )
        graph_result = GraphResult(
            found.config,
            found.default_ms,
            found.tuned_ms,
            found.measured,
            {k: v for k, v in found.config.items() if v != found.defaults[k]},
            found.noise,
            [_candidate_json(c) for c in found.candidates],
            found.out_of_budget,
        )
        result.graphs[workload.graph] = graph_result
        if cache is not None and not found.out_of_budget:  # a search cut short is not a result to keep
            cache.store(key, {"graph": workload.graph, **graph_result.to_json()})
    if output is not None:
        entry = TuningEntry(result.tier, fingerprint, {n: r.config for n, r in result.graphs.items()})
        kept = [e for e in file.tuning if e.tier != result.tier and dict(e.fingerprint) != fingerprint]
        result.output = write_tuned(file, output, [*kept, entry])
    return result


__all__ = ["GraphResult", "TuneResult", "Workload", "tune_context"]

"""The search for one graph: one knob at a time, each value measured against the best so far."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from quiver.backends.base import Knob, KnobValue
from quiver.errors import BackendError
from quiver.tuning import accuracy
from quiver.tuning.measure import Comparison, compare, noise_of, runs_per_block
from quiver.tuning.profiler import Profiler

ROUNDS = 8


@dataclass(frozen=True)
class Candidate:
    knob: str
    value: KnobValue
    verdict: str  # "faster", "not faster", "less accurate", "failed: ...", "budget"
    ratio: float | None = None  # candidate time / best time, median of rounds
    sqnr_db: float | None = None


@dataclass
class SearchResult:
    config: dict[str, KnobValue]
    defaults: dict[str, KnobValue]
    default_ms: float
    tuned_ms: float
    noise: float
    measured: int = 0
    candidates: list[Candidate] = field(default_factory=list)
    out_of_budget: bool = False


def search(
    profiler: Profiler,
    graph: str,
    knobs: Sequence[Knob],
    inputs: str,
    deadline: float,
    on_candidate: Callable[[Candidate], object] = lambda _: None,
) -> SearchResult:
    """Coordinate descent from the defaults. Each candidate must first pass the accuracy gate (on every
    input set), then beat the best so far (timed on the first input set) by more than the noise measured
    between two identical variants of the defaults."""
    default = {k.name: k.default for k in knobs}
    exact = {**default, **{k.name: k.exact for k in knobs if k.exact is not None}}
    best = profiler.prepare(graph, default)
    variants = [best]
    try:
        twin = profiler.prepare(graph, default)
        variants.append(twin)
        runs = runs_per_block(statistics.median(profiler.time(best, inputs, 0, 3)))

        def timer(variant: str) -> Callable[[], list[float]]:
            return lambda: profiler.time(variant, inputs, 0, runs)

        same = compare(timer(best), timer(twin), ROUNDS)
        noise = noise_of(same)
        profiler.release(twin)
        default_outputs = profiler.outputs(best, inputs)
        reference_outputs = default_outputs
        if exact != default:
            reference = profiler.prepare(graph, exact)
            variants.append(reference)
            reference_outputs = profiler.outputs(reference, inputs)
            profiler.release(reference)
        result = SearchResult(dict(default), dict(default), same.best_s * 1e3, same.best_s * 1e3, noise)
        best_config = dict(default)
        last: Comparison | None = None
        for knob in knobs:
            for value in knob.values:
                if value == best_config[knob.name]:
                    continue
                if time.monotonic() > deadline:
                    result.out_of_budget = True
                    _note(result, Candidate(knob.name, value, "budget"), on_candidate)
                    continue
                config = {**best_config, knob.name: value}
                result.measured += 1
                try:
                    variant = profiler.prepare(graph, config)
                except BackendError as exc:
                    _note(result, Candidate(knob.name, value, f"failed: {exc}"), on_candidate)
                    continue
                variants.append(variant)
                outputs = profiler.outputs(variant, inputs)
                ok, sqnr = accuracy.passes(reference_outputs, default_outputs, outputs)
                if not ok:
                    _note(result, Candidate(knob.name, value, "less accurate", sqnr_db=sqnr), on_candidate)
                    profiler.release(variant)
                    continue
                comparison = compare(timer(best), timer(variant), ROUNDS)
                faster = comparison.beats(noise)
                verdict = "faster" if faster else "not faster"
                _note(result, Candidate(knob.name, value, verdict, comparison.ratio, sqnr), on_candidate)
                if faster:
                    if best != variants[0]:
                        profiler.release(best)
                    best, best_config, last = variant, config, comparison
                else:
                    profiler.release(variant)
        result.config = best_config
        if last is not None:  # the tuned against the defaults, measured side by side once more
            final = compare(timer(variants[0]), timer(best), ROUNDS)
            result.default_ms, result.tuned_ms = final.best_s * 1e3, final.candidate_s * 1e3
        return result
    finally:
        for variant in variants:
            profiler.release(variant)


def _note(result: SearchResult, candidate: Candidate, on_candidate: Callable[[Candidate], object]) -> None:
    result.candidates.append(candidate)
    on_candidate(candidate)

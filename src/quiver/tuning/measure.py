"""Timing that is honest on a noisy machine: blocks of runs, paired and interleaved, judged against noise."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Before each timed block: other sessions' threads spin for a while after their last run and would steal
# the cores (an interleaved comparison without the pause put every candidate far off).
SETTLE_S = 0.02
# A block lasts about this long (many runs of a fast graph, one of a slow one): shorter blocks let two
# identical variants differ by several times the noise this one leaves (docs/worklog.md).
BLOCK_S = 0.1
MIN_GAIN = 0.02  # below this, a gain is not worth a configuration however steady it is


def time_block(run: Callable[[], object], runs: int) -> list[float]:
    """Seconds per run for `runs` runs, after a pause and one untimed run."""
    time.sleep(SETTLE_S)
    run()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def runs_per_block(seconds_per_run: float) -> int:
    return max(1, min(200, math.ceil(BLOCK_S / max(seconds_per_run, 1e-6))))


@dataclass(frozen=True)
class Comparison:
    """A candidate against the current best: per round, the candidate's block median over the best's."""

    ratios: tuple[float, ...]
    best_s: float  # median over rounds of the best's block medians
    candidate_s: float

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def beats(self, noise: float) -> bool:
        """Faster by more than the noise (and `MIN_GAIN`), and faster in all rounds but at most one (a sign
        test: 7 of 8 has a 3.5 % chance of happening by luck)."""
        faster = sum(r < 1.0 for r in self.ratios)
        return self.ratio < 1.0 - max(noise, MIN_GAIN) and faster >= len(self.ratios) - 1


def compare(
    time_best: Callable[[], Sequence[float]], time_candidate: Callable[[], Sequence[float]], rounds: int
) -> Comparison:
    """Alternates blocks (best first in even rounds, candidate first in odd ones) and pairs them by round."""
    ratios, best, candidate = [], [], []
    for round_ in range(rounds):
        if round_ % 2 == 0:
            b, c = statistics.median(time_best()), statistics.median(time_candidate())
        else:
            c, b = statistics.median(time_candidate()), statistics.median(time_best())
        ratios.append(c / b)
        best.append(b)
        candidate.append(c)
    return Comparison(tuple(ratios), statistics.median(best), statistics.median(candidate))


def noise_of(same: Comparison) -> float:
    """The noise of this machine for this graph: how far two identical variants' ratios stray from 1 (the
    second largest deviation over the rounds: one outlier is forgiven, as in `Comparison.beats`)."""
    deviations = sorted(abs(r - 1.0) for r in same.ratios)
    return deviations[-2] if len(deviations) > 1 else deviations[-1]

"""Timing helpers for every benchmark: the median of timed calls, and rounds of them side by side."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from quiver.portable import huge_page_tunables


def median_ms(fn: Callable[[], Any], iterations: int, warm_up: int = 0) -> float:
    """Median wall time of `fn` in ms; warm-up calls first (another session's threads may hold the cores)."""
    for _ in range(warm_up):
        fn()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def alternating_medians(
    candidates: dict[str, Callable[[], Any]], rounds: int, iterations: int, warm_up: int = 0
) -> dict[str, list[float]]:
    """Per candidate, one `median_ms` per round; the order turns round by round. On this machine
    whichever session is timed second runs 5-15 % slower (ORT's profiler shows every op type slower
    there), so a fixed order would favour the one always timed first."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            samples[name].append(median_ms(candidates[name], iterations, warm_up))
    return samples


def alternating_runs(candidates: dict[str, Callable[[], Any]], rounds: int, tag: str) -> dict[str, list[Any]]:
    """Per candidate, what each call of it gives (a fresh process's measures), one a round, the order
    turning round by round (`alternating_medians`' reason); progress on stderr under `tag`."""
    runs: dict[str, list[Any]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            print(f"  {tag} round {round_ + 1}/{rounds}: {name}", file=sys.stderr)
            runs[name].append(candidates[name]())
    return runs


@contextlib.contextmanager
def peers_on_huge_pages() -> Iterator[str]:
    """Every process started meanwhile (Quiver's and its peers' alike) with glibc's malloc on huge pages, as
    `quiver serve` and `quiver t2t run` run themselves (`quiver.portable.huge_page_tunables`): the same
    environment on every side. Yields the GLIBC_TUNABLES they get ("" where this machine has nothing to ask)."""
    before = os.environ.get("GLIBC_TUNABLES")
    tunables = huge_page_tunables(os.environ)
    if tunables is not None:
        os.environ["GLIBC_TUNABLES"] = tunables
    try:
        yield os.environ.get("GLIBC_TUNABLES", "")
    finally:
        if before is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = before

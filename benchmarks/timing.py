"""One timing helper for every benchmark: the median of timed calls, after optional warm-up calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


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

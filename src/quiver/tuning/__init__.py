"""Tuning mode: per-graph backend settings measured on the device, a performance cache, tuned contexts.

`quiver tune` (cli/tune.py) drives `tune_context`; `quiver target-server` serves the measuring
half (`server.py`) to a host that searches (`client.py`).
"""

from quiver.tuning.cache import PerformanceCache, tier_name
from quiver.tuning.config import TuningConfig, read_tuning_config
from quiver.tuning.profiler import LocalProfiler, Profiler
from quiver.tuning.tuner import GraphResult, TuneResult, Workload, tune_context

__all__ = [
    "GraphResult",
    "LocalProfiler",
    "PerformanceCache",
    "Profiler",
    "TuneResult",
    "TuningConfig",
    "Workload",
    "read_tuning_config",
    "tier_name",
    "tune_context",
]

"""QNN's tuning config file (`--config-file tuning.json`): `tuning_mode`, `performance_cache_dir`,
`invalidate_performance_cache`, and Quiver's `budget_s`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quiver.errors import FileAccessError, TuningError
from quiver.formats.files import read_text

_KEYS = {"tuning_mode", "performance_cache_dir", "invalidate_performance_cache", "budget_s"}


@dataclass(frozen=True)
class TuningConfig:
    tuning_mode: bool = False
    performance_cache_dir: Path | None = None
    invalidate_performance_cache: bool = False
    budget_s: float | None = None


def read_tuning_config(path: str | Path) -> TuningConfig:
    """Reads and checks a tuning config: cache options without `"tuning_mode": true` are an error, as in QNN."""
    path = Path(path)
    try:
        data = json.loads(read_text(path, what="tuning config"))
    except ValueError as exc:
        raise TuningError(f"{path} is not JSON ({exc})") from None
    except FileAccessError as exc:
        raise TuningError(str(exc)) from None
    if not isinstance(data, dict):
        raise TuningError(f"{path} must hold a JSON object with keys among {sorted(_KEYS)}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise TuningError(f"{path}: unknown keys {unknown}; the keys are {sorted(_KEYS)}")
    mode, invalidate = data.get("tuning_mode", False), data.get("invalidate_performance_cache", False)
    folder, budget = data.get("performance_cache_dir"), data.get("budget_s")
    if not isinstance(mode, bool) or not isinstance(invalidate, bool):
        raise TuningError(f"{path}: tuning_mode and invalidate_performance_cache must be true or false")
    if folder is not None and (not isinstance(folder, str) or not folder):
        raise TuningError(f"{path}: performance_cache_dir must be a folder path")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise TuningError(f"{path}: budget_s must be a positive number of seconds")
    if not mode and (folder is not None or invalidate):
        raise TuningError(
            f'{path}: performance_cache_dir and invalidate_performance_cache apply only with "tuning_mode": true'
        )
    if invalidate and folder is None:
        raise TuningError(f"{path}: invalidate_performance_cache needs a performance_cache_dir")
    resolved = None if folder is None else (path.parent / Path(folder).expanduser())
    return TuningConfig(mode, resolved, invalidate, None if budget is None else float(budget))

"""Picks a context's tuned configuration for the device it is loaded on (or warns, once, and uses defaults)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from quiver.backends.base import Backend, KnobValue, is_tunable
from quiver.formats.tuned import TuningEntry


class TuningWarning(UserWarning):
    """A tuned context has no configuration for this device: its graphs run with the defaults."""


def differences(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """What changed between two device fingerprints, field by field ("onnxruntime 1.24.4 -> 1.32.0")."""
    return [
        f"{key} {expected.get(key, '(none)')!r} -> {actual.get(key, '(none)')!r}"
        for key in sorted({*expected, *actual})
        if expected.get(key) != actual.get(key)
    ]


def select_tuning(
    entries: Sequence[TuningEntry], backend: Backend, source: str
) -> Mapping[str, Mapping[str, KnobValue]]:
    """The configurations (per graph) of the entry made on this device; none, with one warning, if no entry
    matches. Contexts without tuning cost nothing here (no fingerprint is taken)."""
    if not entries:
        return {}
    if not is_tunable(backend):
        return {}
    here = backend.device_fingerprint()
    for entry in entries:
        if dict(entry.fingerprint) == here:
            return entry.graphs
    nearest = min(entries, key=lambda e: len(differences(e.fingerprint, here)))
    warnings.warn(
        TuningWarning(
            f"{source} was tuned for other devices ({', '.join(e.tier for e in entries)}); running with default "
            f"settings. Nearest: {nearest.tier}, which differs in {'; '.join(differences(nearest.fingerprint, here))}. "
            "Tune it here with `quiver tune`"
        ),
        stacklevel=4,
    )
    return {}

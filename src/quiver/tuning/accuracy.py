"""The accuracy gate: a candidate must be as accurate as the defaults against the most exact settings."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

SQNR_CAP_DB = 60.0  # beyond this, differences are float rounding (fused kernels sum in another order)
SQNR_SLACK_DB = 1.0


def sqnr_db(reference: np.ndarray, other: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of `other` against `reference` (inf when equal)."""
    ref = np.asarray(reference, np.float64)
    diff = ref - np.asarray(other, np.float64)
    noise = float(np.sum(diff * diff))
    if not math.isfinite(noise):
        return -math.inf
    if noise == 0.0:
        return math.inf
    signal = float(np.sum(ref * ref))
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


Outputs = Sequence[Mapping[str, np.ndarray]]  # per input set, by output name


def worst_sqnr(reference: Outputs, other: Outputs) -> float:
    """The lowest SQNR over every float output of every input set."""
    values = [
        sqnr_db(array, o[name])
        for r, o in zip(reference, other)
        for name, array in r.items()
        if np.issubdtype(array.dtype, np.floating)
    ]
    return min(values, default=math.inf)


def _greedy(outputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Argmax over the last axis of outputs named logits: the tokens greedy generation would pick."""
    return [np.argmax(o, axis=-1) for n, o in sorted(outputs.items()) if "logits" in n and o.ndim >= 1]


def passes(reference: Outputs, default: Outputs, candidate: Outputs) -> tuple[bool, float]:
    """Whether the candidate is as accurate as the defaults (its SQNR against the reference no more than
    `SQNR_SLACK_DB` below theirs, capped at `SQNR_CAP_DB`), and picks the same greedy tokens wherever the
    defaults pick the reference's. Returns the verdict and the candidate's SQNR."""
    floor = min(worst_sqnr(reference, default), SQNR_CAP_DB) - SQNR_SLACK_DB
    measured = worst_sqnr(reference, candidate)
    if measured < floor:
        return False, measured
    for ref, dflt, cand in zip(reference, default, candidate):
        for r, d, c in zip(_greedy(ref), _greedy(dflt), _greedy(cand)):
            if np.any((d == r) & (c != r)):
                return False, measured
    return True, measured

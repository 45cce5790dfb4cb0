"""Choosing the next token: logit bias (OpenAI's), repetition penalty (transformers', over the whole
conversation), presence and frequency penalties (OpenAI's, over the reply's tokens) → temperature →
top-k → top-p → min-p."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from quiver.errors import GenerationError


@dataclass(frozen=True)
class Sampling:
    """One query's sampling settings; `greedy` (or temperature 0) takes the most likely token."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_p: float = 0.0  # tokens less likely than min_p x the likeliest are dropped (0: none)
    presence_penalty: float = 0.0  # subtracted from a token's logit once it is in the reply
    frequency_penalty: float = 0.0  # subtracted from a token's logit per time it is in the reply
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs: OpenAI's, -100 to 100

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, f"temperature {self.temperature} must be >= 0"),
            (self.top_k >= 0, f"top-k {self.top_k} must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, f"top-p {self.top_p} must be in (0, 1]"),
            (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                f"repetition penalty {self.repetition_penalty} must be > 0",
            ),
            (self.seed is None or 0 <= self.seed < 2**64, f"seed {self.seed} must be 0 to 2^64 - 1"),
            (0 <= self.min_p <= 1, f"min-p {self.min_p} must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, f"presence penalty {self.presence_penalty} must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, f"frequency penalty {self.frequency_penalty} must be in [-2, 2]"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "a logit bias must be in [-100, 100]"),
            (all(i >= 0 for i, _ in self.logit_bias), "a logit bias's token id must be >= 0"),
        ]
        for holds, message in checks:
            if not holds:
                raise GenerationError(f"sampling: {message}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


class Sampler:
    """Picks tokens for one query; a seeded generator makes sampling repeatable."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self._random = np.random.default_rng(sampling.seed)

    def next_token(self, logits: np.ndarray, seen: Sequence[int], reply: Sequence[int] = ()) -> int:
        """The next token from `logits`; `seen`: the conversation's tokens (the repetition penalty's),
        `reply`: this reply's tokens so far (the presence and frequency penalties')."""
        s = self.sampling
        penalized = s.presence_penalty != 0 or s.frequency_penalty != 0
        if s.is_greedy and s.repetition_penalty == 1.0 and not penalized and not s.logit_bias:
            # the common case, once per generated token: as little as can be run between two decode steps
            return int(logits.argmax())
        scores = np.asarray(logits, np.float32).reshape(-1)
        if s.logit_bias:
            scores = scores.copy()
            biased = np.asarray([i for i, _ in s.logit_bias], np.int64)
            scores[biased] += np.asarray([b for _, b in s.logit_bias], np.float32)
        if s.repetition_penalty != 1.0 and len(seen):
            scores = scores.copy()
            ids = np.unique(np.asarray(seen, np.int64))
            chosen = scores[ids]
            scores[ids] = np.where(chosen < 0, chosen * s.repetition_penalty, chosen / s.repetition_penalty)
        if penalized and len(reply):
            scores = scores.copy()
            ids, counts = np.unique(np.asarray(reply, np.int64), return_counts=True)
            scores[ids] -= np.float32(s.presence_penalty) + np.float32(s.frequency_penalty) * counts.astype(np.float32)
        if s.is_greedy:
            return int(np.argmax(scores))
        # in float64, kept finite: a tiny temperature must not overflow the scores (inf - inf is NaN)
        scores = np.clip(scores.astype(np.float64) / s.temperature, -1e300, 1e300)
        if 0 < s.top_k < scores.size:
            kth = np.partition(scores, -s.top_k)[-s.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        if s.top_p < 1.0:
            order = np.argsort(scores)  # ascending, as transformers' TopPLogitsWarper
            probabilities = _softmax(scores[order])
            removed = np.cumsum(probabilities) <= 1 - s.top_p
            removed[-1] = False  # the most likely token always stays
            scores = scores.copy()
            scores[order[removed]] = -np.inf
        probabilities = _softmax(scores)
        if s.min_p > 0:
            probabilities = np.where(probabilities < s.min_p * probabilities.max(), 0, probabilities)
            probabilities /= probabilities.sum()
        return int(self._random.choice(probabilities.size, p=probabilities))


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp((scores - scores.max()).astype(np.float64))
    return shifted / shifted.sum()


def log_probabilities(logits: np.ndarray) -> np.ndarray:
    """The log-softmax of one position's logits, [vocab] (float32; computed in float64 for the sum)."""
    scores = np.asarray(logits, np.float64).reshape(-1)
    shifted = scores - scores.max()
    return (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)

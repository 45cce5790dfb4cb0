"""Arrays made when they are stored: a weight's dtype and shape known while a graph is built, its values
read, converted and quantized only when the context writes it, one tensor at a time.

A streaming export builds its graphs over these (placeholders in the skeleton, `Deferred` values beside
it), so its memory is bounded by the largest tensor, not by the model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

Shape = tuple[int, ...]


class Deferred:
    """An array of a known dtype and shape, made by `compute()` each time it is asked for (nothing kept)."""

    __slots__ = ("shape", "dtype", "_make", "_items")

    def __init__(self, shape: Sequence[int], dtype: np.dtype | type, make: Callable[[], np.ndarray]) -> None:
        self.shape: Shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._make = make
        self._items: Sequence[Deferred] | None = None  # what a stack along axis 0 was made of

    @classmethod
    def of(cls, array: np.ndarray) -> Deferred:
        """An array at hand, as a deferred one (it is kept)."""
        return cls(array.shape, array.dtype, lambda: array)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def compute(self) -> np.ndarray:
        array = np.asarray(self._make())
        if array.shape != self.shape or array.dtype != self.dtype:  # a recipe's mistake, never the user's
            made, expected = f"{array.dtype}{list(array.shape)}", f"{self.dtype}{list(self.shape)}"
            raise ValueError(f"a deferred array made {made}, not {expected}")
        return array

    def map(self, function: Callable[[np.ndarray], np.ndarray]) -> Deferred:
        """`function` applied elementwise (same dtype and shape)."""
        return Deferred(self.shape, self.dtype, lambda: np.asarray(function(self.compute()), self.dtype))

    @property
    def T(self) -> Deferred:  # noqa: N802 (numpy's name)
        return Deferred(self.shape[::-1], self.dtype, lambda: self.compute().T)

    def take(self, order: np.ndarray, axis: int) -> Deferred:
        shape = list(self.shape)
        shape[axis] = len(order)
        return Deferred(shape, self.dtype, lambda: np.take(self.compute(), order, axis=axis))

    def item(self, index: int) -> Deferred:
        """The array at `index` along the first axis: a stack's own part (made alone: one expert of many,
        never the whole stack), else sliced from the whole."""
        if self._items is not None:
            return self._items[index]
        return Deferred(self.shape[1:], self.dtype, lambda: self.compute()[index])

    def reshape(self, *shape: int) -> Deferred:
        return Deferred(shape, self.dtype, lambda: self.compute().reshape(shape))

    @staticmethod
    def concat(parts: Sequence[Deferred], axis: int = 0) -> Deferred:
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        return Deferred(shape, parts[0].dtype, lambda: np.concatenate([p.compute() for p in parts], axis=axis))

    @staticmethod
    def stack(parts: Sequence[Deferred], axis: int = 0) -> Deferred:
        shape = list(parts[0].shape)
        shape.insert(axis if axis >= 0 else len(shape) + 1 + axis, len(parts))
        stacked = Deferred(shape, parts[0].dtype, lambda: np.stack([p.compute() for p in parts], axis=axis))
        if axis == 0:
            stacked._items = tuple(parts)
        return stacked


def made_together(
    parts: Sequence[tuple[Shape, np.dtype | type]], make: Callable[[], Sequence[np.ndarray]]
) -> list[Deferred]:
    """Deferred arrays one computation makes at once (a quantizer's integers, scales and zero points): made
    once and kept until each part has been taken, then let go (asked again, made again)."""
    lock = threading.Lock()
    made: list[np.ndarray | None] = [None] * len(parts)

    def part(index: int) -> np.ndarray:
        with lock:
            value = made[index]
            if value is None:
                arrays = list(make())
                if not any(m is not None for m in made):  # the first taker: keep the others for their takers
                    made[:] = arrays
                value = arrays[index]
            made[index] = None
            return value

    return [Deferred(shape, dtype, partial(part, i)) for i, (shape, dtype) in enumerate(parts)]

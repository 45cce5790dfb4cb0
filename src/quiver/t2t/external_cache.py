"""The KV cache of a decoder exported elsewhere (`quiver.t2t.onnx_decoder`): positions given by an
attention mask (and position ids where the graph takes them), the cache either one buffer of the whole
context that past and present share ("shared": GroupQueryAttention writes each step's entries in place)
or the step's present fed back as the next past ("growing")."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from quiver.errors import GenerationError
from quiver.runtime.graph import Graph
from quiver.t2t.graph import PAST, PRESENT
from quiver.t2t.onnx_decoder import ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS


def _dims(shape: tuple[int | str | None, ...] | None) -> tuple[int | None, ...]:
    """A shape's dimensions, symbolic ones as None."""
    return tuple(d if isinstance(d, int) else None for d in shape or ())


class ExternalCache:
    """Runs steps of an imported decoder: the dialog gives the tokens and how many are cached already."""

    def __init__(self, graph: Graph, kv_cache: str, context_size: int) -> None:
        inputs = {i.name: i for i in graph.inputs}
        past = {name: info.shape for name, info in inputs.items() if name.startswith(PAST)}
        self.shared = kv_cache == "shared"
        self.position_ids = POSITION_IDS in inputs
        if not past or ATTENTION_MASK not in inputs:
            raise GenerationError(f"graph {graph.name!r} takes no attention mask and KV cache: re-import the decoder")
        shapes = {name: _dims(shape) for name, shape in past.items()}
        if any(len(s) != 4 or s[0] not in (1, None) or None in (s[1], s[3]) for s in shapes.values()):
            raise GenerationError(f"graph {graph.name!r}: a KV cache input is [1, heads, positions, dim]")
        if self.shared:
            if any(s[2] is None for s in shapes.values()):
                raise GenerationError(f"graph {graph.name!r}: a shared KV buffer has a fixed number of positions")
            self.capacity = min(int(next(iter(shapes.values()))[2] or 0), context_size)
            self.cache: dict[str, np.ndarray] = {
                name: np.zeros([1, *(int(d or 0) for d in s[1:])], np.float32) for name, s in shapes.items()
            }
        else:
            self.capacity = context_size
            self.cache = {
                name: np.zeros((1, int(s[1] or 0), 0, int(s[3] or 0)), np.float32) for name, s in shapes.items()
            }
        # the present outputs written into the past buffers themselves (shared) or read back (growing)
        self._present = {PRESENT + name[len(PAST) :]: name for name in self.cache}
        self._out = {present: self.cache[name] for present, name in self._present.items()} if self.shared else {}
        self._mask = np.ones((1, self.capacity), np.int64)
        self._positions = np.arange(self.capacity, dtype=np.int64).reshape(1, -1)

    def step(self, graph: Graph, ids: list[int], cached: int, logits: np.ndarray) -> None:
        """Feeds `ids` after `cached` tokens: their keys and values join the cache, the last one's logits
        land in `logits`."""
        total = cached + len(ids)
        if not self.shared and any(array.shape[2] != cached for array in self.cache.values()):
            # the dialog forgot tokens (a reset, a new conversation): the past is its first `cached` positions
            self.cache = {name: np.ascontiguousarray(array[:, :, :cached]) for name, array in self.cache.items()}
        feeds: dict[str, np.ndarray] = {
            INPUT_IDS: np.array([ids], np.int64),
            ATTENTION_MASK: self._mask[:, :total],
            **self.cache,
        }
        if self.position_ids:
            feeds[POSITION_IDS] = np.ascontiguousarray(self._positions[:, cached:total])
        results = graph.execute(feeds, out=self._out or None)
        if not self.shared:
            self.cache = {name: results[present] for present, name in self._present.items()}
        logits.reshape(-1)[:] = results[LOGITS].reshape(-1, logits.size)[-1]

    def keep(self, cache: Mapping[str, np.ndarray], used: int) -> None:
        """Puts a saved cache of `used` positions back."""
        for name, array in cache.items():
            if self.shared:
                self.cache[name][:, :, :used] = array
            else:
                self.cache[name] = array.copy()

"""What a graph and its bindings ask of the context that holds them (`quiver.Context` provides it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from quiver.formats.encodings import EncodingSet
    from quiver.runtime.state import GraphState


class GraphOwner(Protocol):
    """What a graph asks of the context that holds it (`Context`): its state, runs, and changes to them."""

    def _state(self, name: str) -> GraphState: ...

    def _run(
        self,
        name: str,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray] | None = None,
        release_scratch: bool = False,
    ) -> list[np.ndarray]: ...

    def _repeating(
        self,
        name: str,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
    ) -> AbstractContextManager[Callable[[], None]]: ...

    def _set_lora_strength(self, graph: str, adapter: str, value: float) -> None: ...

    def _encodings(self, name: str) -> EncodingSet: ...

    def _stage(self, updates: Mapping[str, Mapping[str, object]]) -> None: ...

    def _apply_staged(self, graphs: Sequence[str]) -> None: ...

"""A graph of a context: its tensors, feed validation and `execute`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from quiver.ir.tensors import LORA_ALPHA_INPUT, TensorInfo
from quiver.runtime.bound_run import BoundRun
from quiver.runtime.feeds import validate_feeds, validate_outputs
from quiver.runtime.owner import GraphOwner

if TYPE_CHECKING:
    from quiver.formats.encodings import EncodingSet
    from quiver.runtime.state import GraphState


class Graph:
    """One graph of a context (QNN graph handle): describes its tensors and executes on the context's backend."""

    def __init__(
        self,
        context: GraphOwner,
        name: str,
        inputs: tuple[TensorInfo, ...],
        outputs: tuple[TensorInfo, ...],
        static: tuple[TensorInfo, ...],
    ) -> None:
        self._context = context
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        self.static_tensors = static
        # feeds and output buffers checked before (a generation feeds the same KV cache every step)
        self._checked_feeds: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}
        self._checked_out: tuple[tuple[object, ...], Mapping[str, np.ndarray]] | None = None
        # Without a section, a LoRA graph runs as its base: strength 0 for every adapter (QNN's default
        # adapter; the context's own LoRA weights are zero too).
        self._zero_adapter: tuple[str, np.ndarray] | None = None
        alpha = next((i for i in inputs if i.name == LORA_ALPHA_INPUT and i.dtype == "float32"), None)
        if alpha is not None and alpha.shape is not None and len(alpha.shape) == 1 and isinstance(alpha.shape[0], int):
            self._zero_adapter = (alpha.name, np.zeros(alpha.shape[0], np.float32))
        # inputs a run may leave out: the graph supplies them (the LoRA strengths, from the state)
        self.inputs_with_defaults = frozenset({self._zero_adapter[0]} if self._zero_adapter else ())

    def execute(
        self, feeds: Mapping[str, object], out: Mapping[str, np.ndarray] | None = None, release_scratch: bool = False
    ) -> dict[str, np.ndarray]:
        """Runs the graph (QnnGraph_execute); prepares it on first use. The run sees the tensors and
        strengths in use when it starts, whatever is applied meanwhile.

        `out` maps output names to arrays of yours that receive them (QNN's client-allocated output
        buffers): no new arrays, and one may be a feed too, such as a KV cache the graph appends to in
        place (the cpu backend hands ORT one buffer for both).

        `release_scratch`: the memory the run's intermediate values took goes back to the system after it,
        where the backend would keep it for later runs (ORT's arena): a long prompt's, before the single
        tokens that follow it need far less (ORT's `memory.enable_memory_arena_shrinkage`).
        """
        return self.execute_with(feeds, self._context._state(self.name), out, release_scratch)

    def execute_with(
        self,
        feeds: Mapping[str, object],
        state: GraphState,
        out: Mapping[str, np.ndarray] | None = None,
        release_scratch: bool = False,
    ) -> dict[str, np.ndarray]:
        """Runs the graph on a given state (`Context.state_with_sections`): per-run adapters."""
        if out:
            key = (id(out), *((id(a), a.shape) for a in out.values()))
            if self._checked_out is None or self._checked_out[0] != key or self._checked_out[1] is not out:
                validate_outputs(self.name, self.outputs, out)
                self._checked_out = (key, out)
        arrays, bound = self.backend_feeds(feeds, state)
        results = self._context._run(self.name, arrays, bound, out, release_scratch)
        return {info.name: result for info, result in zip(self.outputs, results)}

    def bind(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> BoundRun:
        """Binds feeds and output buffers once (ORT's IOBinding): `run()` on what it returns executes on
        the feeds as they are then (write new values into the same arrays between runs), writes the
        outputs named in `out` into their buffers and returns the others."""

        return BoundRun(self, feeds, out)

    def backend_feeds(
        self, feeds: Mapping[str, object], state: GraphState | None = None
    ) -> tuple[dict[str, np.ndarray], Mapping[str, np.ndarray]]:
        """What a run hands the backend for these feeds: the validated feeds, and the bound tensors
        (updateable tensors and LoRA strengths in use). Tuning measures runs with exactly these."""
        state = self._context._state(self.name) if state is None else state
        lora = state.lora
        # the strengths a caller does not feed: the state's, or the zero adapter's
        strengths = (lora.alpha_input, lora.alphas) if lora is not None else self._zero_adapter
        if strengths is not None and strengths[0] in feeds:
            strengths = None
        if strengths is not None:
            feeds = {**feeds, strengths[0]: strengths[1]}
        arrays = validate_feeds(self.name, self.inputs, feeds, self._checked_feeds)
        # The same arrays run after run, in the same dict until an update replaces it (never mutated),
        # so a backend can reuse what it built for them.
        bound: Mapping[str, np.ndarray] = state.values
        if strengths is not None:
            bound = {**bound, strengths[0]: arrays.pop(strengths[0])}
        return arrays, bound

    def set_lora_strength(self, adapter: str, value: float) -> None:
        """Sets one adapter's strength (Genie's setLoraStrength) after a LoRA section was applied."""
        self._context._set_lora_strength(self.name, adapter, value)

    def encodings(self) -> EncodingSet:
        """Encodings of the graph's quantized tensors as they are now: applying a section updates them.

        (QNN updates a graph's I/O encodings after applyBinarySection; here every Q/DQ encoding is read
        from the tensors in use, so a quantized LoRA section's scales show up as soon as it is applied.)
        """
        return self._context._encodings(self.name)

    @property
    def lora_strengths(self) -> dict[str, float]:
        """Strength per adapter from the applied section (and set_lora_strength); empty without one."""
        lora = self._context._state(self.name).lora
        return {} if lora is None else {a: float(v) for a, v in zip(lora.adapters, lora.alphas)}

    @property
    def lora_active(self) -> tuple[str, ...]:
        """The adapters the applied section holds weights for (its use case), in its order; empty without one."""
        lora = self._context._state(self.name).lora
        return () if lora is None else tuple(lora.active)

    def update_tensors(self, values: Mapping[str, object]) -> None:
        """Stages new values for updateable tensors (QnnTensor_updateGraphTensors); `finalize()` applies them."""
        self._context._stage({self.name: values})

    def finalize(self) -> Graph:
        """Applies the staged updates: from now on executions use them (QnnGraph_finalize)."""
        self._context._apply_staged([self.name])
        return self

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, inputs={[i.name for i in self.inputs]}, outputs={[o.name for o in self.outputs]})"

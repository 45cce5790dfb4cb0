"""ORT sessions made through the C API (`capi`), sharing one prepacked-weights container per context."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from quiver.backends.cpu.capi import LOG_FATAL, Tensor, api, to_numpy
from quiver.backends.cpu.native_ops import register_c

_BOUND_WRAPPERS = 8192
_P = ctypes.c_void_p


class PrepackedWeights:
    """One container per context: the packed copies of shared weights, made once for all its graphs."""

    def __init__(self) -> None:
        self._api = api()
        self.handle = self._api.handle_from(self._api.CreatePrepackedWeightsContainer)

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._api.ReleasePrepackedWeightsContainer(self.handle)
            self.handle = 0


@dataclasses.dataclass(frozen=True)
class _RunPlan:
    """The C arrays of one kind of run: names, the handles of everything but the fresh feeds, outputs."""

    out: Mapping[str, np.ndarray]  # the output buffers it was made for (kept alive: ids stay theirs)
    out_names: tuple[str, ...]
    out_ids: tuple[int, ...]
    output_key: tuple[str, ...]
    feed_names: tuple[str, ...]
    in_place: list[tuple[int, int]]  # (position among the feeds, id of the output buffer fed there)
    listed: tuple[Mapping[str, np.ndarray], list[bytes], list[Tensor]]  # the bound values listed
    keep: list[Tensor]  # the output buffers' OrtValues, alive while the plan is
    count: int
    names: Any
    inputs: Any
    fresh: list[str]  # feeds that are not output buffers, at these positions of `inputs`
    fresh_positions: list[int]
    wrapped: list[Tensor | None]  # the last OrtValue made for each of them
    output_names: Any
    outputs: Any
    results: list[np.ndarray] | None  # a run's results when every output has a buffer: those buffers


class Session:
    """An ORT session made through the C API, its shared weights bound by AddInitializer and packed once."""

    def __init__(
        self,
        model: bytes,
        weights: Mapping[str, np.ndarray],
        readable: Mapping[str, np.ndarray],
        container: PrepackedWeights,
        config: Mapping[str, str],
        intra_op_num_threads: int,
        optimization_level: int,
        per_session_threads: bool = True,
        log_severity: int = LOG_FATAL,
    ) -> None:
        self._api = capi = api()
        self._container = container  # must outlive the session
        self._weights = {name: Tensor(array) for name, array in weights.items()}  # must outlive the session
        # OrtValues of bound arrays by identity (each wrapper keeps its array alive, so an id is never
        # reused while listed): switching back to a section applied before wraps nothing again
        self._bound: OrderedDict[int, Tensor] = OrderedDict()
        self._bound_lock = threading.Lock()  # runs on several threads share the cache
        self._outputs: dict[str, Tensor] = {}
        self._plan: _RunPlan | None = None
        # (feeds, bound, out, output names, plan) of the last run: a bound run (`runtime.bound_run`)
        # passes the very same dicts every time, never changed, and finds its plan without comparing
        # a KV cache's sixty-odd names and ids per step
        self._last_run: tuple[object, object, object, object, _RunPlan] | None = None
        # (the bound dict last run, its encoded names, its wrappers): a caller that passes the same dict
        # again (strength folding does, until something changes) skips re-listing dozens of inputs. The
        # wrappers, not bare handles: a run in flight keeps them alive while another run replaces them.
        self._bound_list: tuple[Mapping[str, np.ndarray], list[bytes], list[Tensor]] | None = None
        options = capi.handle_from(capi.CreateSessionOptions)
        try:
            capi.check(capi.SetIntraOpNumThreads(options, intra_op_num_threads))
            if not per_session_threads:  # the process's global pools (which the env must have)
                capi.check(capi.DisablePerSessionThreads(options))
            capi.check(capi.SetGraphOptimizationLevel(options, optimization_level))
            # fatal by default: a failing run raises with ORT's message; ORT need not also print it
            capi.check(capi.SetSessionLogSeverityLevel(options, log_severity))
            entries = {**config, "session.use_env_allocators": "1"} if capi.shared_arena() else config
            for key, value in entries.items():
                capi.check(capi.AddSessionConfigEntry(options, key.encode(), value.encode()))
            for name, tensor in self._weights.items():
                capi.check(capi.AddInitializer(options, name.encode(), tensor.handle))
            # weights with no file to be read from: placed in the graph before it optimizes (ORT copies them)
            self._readable = {name: Tensor(array) for name, array in readable.items()}  # must outlive the session
            if self._readable:
                capi.check(
                    capi.AddExternalInitializers(
                        options,
                        (ctypes.c_char_p * len(self._readable))(*(n.encode() for n in self._readable)),
                        (_P * len(self._readable))(*(t.handle for t in self._readable.values())),
                        len(self._readable),
                    )
                )
            capi.check(register_c(options, capi.api_base, model))
            self.handle = capi.handle_from(
                capi.CreateSessionFromArrayWithContainer, capi.env, model, len(model), options, container.handle
            )
        finally:
            capi.ReleaseSessionOptions(options)

    def _bound_tensor(self, array: np.ndarray) -> Tensor:
        """The OrtValue made for this very array object before, or a new one (which is kept).

        Wrapping costs a few ctypes calls per tensor: with hundreds of LoRA tensors, a noticeable part
        of the first run after a switch. The oldest wrappers go once there are many more than one
        run's worth (a few sections' tensors stay wrapped).
        """
        with self._bound_lock:
            tensor = self._bound.get(id(array))
            if tensor is not None and tensor.array is array:
                self._bound.move_to_end(id(array))
                return tensor
        tensor = Tensor(array)
        with self._bound_lock:
            self._bound[id(array)] = tensor
            while len(self._bound) > _BOUND_WRAPPERS:
                self._bound.popitem(last=False)
        return tensor

    def run(
        self,
        output_names: Sequence[str],
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
        shrink_arena: bool = False,
    ) -> list[np.ndarray]:
        """`shrink_arena`: ORT's arena gives back afterwards what this run's intermediate values took."""
        capi = self._api
        last = self._last_run
        if last is not None and last[0] is feeds and last[1] is bound and last[2] is out and last[3] is output_names:
            plan = last[4]
        else:
            plan = self._plan_for(tuple(output_names), feeds, bound, out)
            self._last_run = (feeds, bound, out, output_names, plan)
        # per run: copies of the planned arrays (runs on several threads share the plan), with the
        # handles of feeds that are not output buffers filled in; such a feed given as the same array
        # object as last run (a caller's persistent token buffer) keeps its OrtValue: it wraps the
        # array's memory, not a copy of its values
        inputs = (_P * plan.count)()
        ctypes.memmove(inputs, plan.inputs, ctypes.sizeof(inputs))
        fed = []
        for slot, (name, position) in enumerate(zip(plan.fresh, plan.fresh_positions)):
            array = feeds[name]
            tensor = plan.wrapped[slot]
            if tensor is None or tensor.array is not array or tensor.shape != array.shape:
                tensor = plan.wrapped[slot] = Tensor(np.asarray(array))
            fed.append(tensor)
            inputs[position] = tensor.handle
        outputs = (_P * len(output_names))()
        ctypes.memmove(outputs, plan.outputs, ctypes.sizeof(outputs))
        capi.check(
            capi.Run(
                self.handle,
                capi.shrinking_run if shrink_arena else None,
                plan.names,
                inputs,
                plan.count,
                plan.output_names,
                len(outputs),
                outputs,
            )
        )
        if plan.results is not None:
            return list(plan.results)
        results = []
        for name, value in zip(output_names, outputs):
            if name in out:
                results.append(out[name])
            else:
                try:
                    results.append(to_numpy(int(value or 0)))
                finally:
                    if value:
                        capi.ReleaseValue(value)
        return results

    def repeater(
        self,
        output_names: Sequence[str],
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
    ) -> Callable[[], None] | None:
        """`run` of these very arrays again and again, their values rewritten in place between runs (a
        generation's decode steps): the C arrays are built once, private to the caller, who runs it from
        one thread at a time while the session lives. None where an output has no buffer.

        A decode step's Python between two runs costs more than it seems: the run evicts it from the
        caches, so each line comes back slowly (by hand: `run`'s cost ~4 % of a 4-bit SmolLM2 step).
        """
        plan = self._plan_for(tuple(output_names), feeds, bound, out)
        if plan.results is None:
            return None
        inputs = (_P * plan.count)()
        ctypes.memmove(inputs, plan.inputs, ctypes.sizeof(inputs))
        fed = [Tensor(np.asarray(feeds[name])) for name in plan.fresh]  # alive as long as the closure
        for tensor, position in zip(fed, plan.fresh_positions):
            inputs[position] = tensor.handle
        outputs = (_P * len(output_names))()
        ctypes.memmove(outputs, plan.outputs, ctypes.sizeof(outputs))
        capi, handle, names, count, output_keys = self._api, self.handle, plan.names, plan.count, plan.output_names
        n = len(outputs)

        # the session, its plan's wrappers and the fed arrays' live as long as the function
        def run(_keep: object = (self, plan, fed)) -> None:
            capi.check(capi.Run(handle, None, names, inputs, count, output_keys, n, outputs))

        return run

    def _plan_for(
        self,
        output_names: tuple[str, ...],
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
    ) -> _RunPlan:
        """The C arrays of a run, built once for the same feed names, bound values and output buffers
        (every step of a generation): per step only the small fresh feeds are wrapped."""
        listed = self._bound_list
        if listed is None or listed[0] is not bound:
            tensors = [self._bound_tensor(v) for v in bound.values()]
            listed = self._bound_list = (bound, [n.encode() for n in bound], tensors)
        plan = self._plan
        if (
            plan is not None
            and plan.listed is listed
            and plan.out_ids == tuple(map(id, out.values()))
            and plan.out_names == tuple(out)
            and plan.output_key == output_names
            and plan.feed_names == tuple(feeds)
        ):
            ids = tuple(map(id, feeds.values()))
            if all(ids[i] == expected for i, expected in plan.in_place):
                return plan
        buffers = {id(array) for array in out.values()}
        given = {name: self._out_tensor(name, array) for name, array in out.items()}
        by_id = {id(t.array): t for t in given.values()}
        in_place = [(i, id(array)) for i, array in enumerate(feeds.values()) if id(array) in buffers]
        names = [*listed[1], *(n.encode() for n in feeds)]
        handles: list[int | None] = [t.handle for t in listed[2]]
        fresh, positions = [], []
        for position, array in enumerate(feeds.values(), start=len(handles)):
            tensor = by_id.get(id(array))
            handles.append(tensor.handle if tensor is not None else None)
            if tensor is None:
                fresh.append(names[position].decode())
                positions.append(position)
        plan = self._plan = _RunPlan(
            out=dict(out),
            out_names=tuple(out),
            out_ids=tuple(map(id, out.values())),
            output_key=output_names,
            feed_names=tuple(feeds),
            in_place=in_place,
            listed=listed,
            keep=list(given.values()),
            count=len(names),
            names=(ctypes.c_char_p * len(names))(*names),
            inputs=(_P * len(handles))(*handles),
            fresh=fresh,
            fresh_positions=positions,
            wrapped=[None] * len(fresh),
            output_names=(ctypes.c_char_p * len(output_names))(*(n.encode() for n in output_names)),
            outputs=(_P * len(output_names))(*(given[n].handle if n in given else None for n in output_names)),
            results=[out[n] for n in output_names] if all(n in out for n in output_names) else None,
        )
        return plan

    def _out_tensor(self, name: str, array: np.ndarray) -> Tensor:
        """The OrtValue over a caller's output buffer, kept while the same array object comes back."""
        tensor = self._outputs.get(name)
        if tensor is None or tensor.array is not array:
            tensor = self._outputs[name] = Tensor(array)
        return tensor

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._api.ReleaseSession(self.handle)
            self.handle = 0

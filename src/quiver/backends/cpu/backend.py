"""The cpu backend: ONNX Runtime's CPU execution provider over the context's mapped weights, without copies.

Each weight reaches ORT as external data that names its place in the mapped context file (`weights`):
ORT's graph optimizers read it there, and ORT maps the file itself where kernels use a weight as it is,
so it is in memory once (a context held in memory hands its weights over in memory: ORT copies those).
The weights ORT packs (MatMul/Gemm) also go in as shared initializers (`AddInitializer`), views of the
mapping: ORT's prepacked-weights container takes only those, and all sessions of a context share one
(ORT keys it by content), so a weight shared by several graphs is packed once. Packing costs time at
session creation, so a graph first runs on a session without packing and is upgraded to a packed
session in the background after its first output ("lazy prepacking", `executable`).

Graphs of one context that differ only in their fixed input sizes (a text generator's prefill graph, any
number of tokens, and its decode graph, one) run on one executable: ORT packs a session's weights
whatever the container holds (it keys the container by the packed bytes), so each session made costs the
packing again (0.6 s of a 1B int4 model's open).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from pathlib import Path

from quiver.backends.base import AheadOfTimeForm, FinalizedGraph, Knob, WeightFile
from quiver.backends.cpu import prepared
from quiver.backends.cpu.capi_session import PrepackedWeights
from quiver.backends.cpu.executable import CpuExecutable
from quiver.backends.cpu.session_model import has_integer_matmuls, packable_weights, session_model
from quiver.backends.cpu.settings import (
    DEFAULT_ACCURACY_LEVEL,
    KNOB_SPACE_VERSION,
    OPTIMIZATION_LEVELS,
    SessionSettings,
    device_fingerprint,
    knobs,
)
from quiver.errors import BackendError
from quiver.ir import proto
from quiver.ir.tensors import TensorInfo
from quiver.ort_package import onnxruntime as ort
from quiver.ort_process import ort_log_severity


class CpuBackend:
    """ONNX Runtime CPU EP over mapped weights.

    `prepack=True` (default): ORT repacks MatMul/Gemm weights for speed, once per distinct weight per
    context (a shared container). `lazy_prepack=True` (default): the first output comes from an
    unpacked session; the packed one is made in the background after it. `prepack=False`: weights stay
    only in the mapping (smallest memory), at a latency cost. `packed_weights`: a folder where each graph's
    packed weights are kept in a file (`packed_file`), made once and mapped by every process that
    opens the graph on this machine (a server's replicas), instead of packed privately by each; for graphs
    that share weights within one process (a dialog's prefill and decode), the container is the better way.
    `spin_between_runs=False`: worker threads stop spinning when a run returns, for graphs that take turns.
    """

    name = "cpu"

    def __init__(
        self,
        intra_op_num_threads: int = 0,
        prepack: bool = True,
        lazy_prepack: bool = True,
        graph_optimization_level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        allow_spinning: bool = True,
        profile_prefix: str | None = None,
        accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
        dynamic_block_base: int = 0,
        packed_weights: str | Path | None = None,
        spin_between_runs: bool = True,
    ) -> None:
        level = next((n for n in OPTIMIZATION_LEVELS if OPTIMIZATION_LEVELS[n] == graph_optimization_level), "all")
        self.settings = SessionSettings(
            intra_op_num_threads, allow_spinning, dynamic_block_base, level, prepack, accuracy_level, spin_between_runs
        )
        # A tuned context's configuration applies to the settings left at their defaults: the user's win.
        defaults = SessionSettings()
        self.chosen = frozenset(
            f.name for f in dataclasses.fields(defaults) if getattr(self.settings, f.name) != getattr(defaults, f.name)
        )
        # Per-node profiles (ORT's JSON) of every session, written when a graph is released; profiling
        # sessions come from the Python API, packed eagerly (one session per graph).
        self.profile_prefix = profile_prefix
        self.profiles: list[str] = []
        if profile_prefix is not None:
            lazy_prepack = False
        self.lazy_prepack = lazy_prepack
        self.packed_weights = Path(packed_weights) if packed_weights is not None else None
        self._container: PrepackedWeights | None = None
        self._lock = threading.Lock()
        # live executables by their graph's body (`_body_key`), with the inputs their sessions accept
        self._bodies: dict[str, list[tuple[weakref.ref[CpuExecutable], tuple[TensorInfo, ...]]]] = {}

    # the settings of sessions made without a tuned configuration
    intra_op_num_threads = property(lambda self: self.settings.intra_op_num_threads)
    allow_spinning = property(lambda self: self.settings.allow_spinning)
    prepack = property(lambda self: self.settings.prepack)
    accuracy_level = property(lambda self: self.settings.accuracy_level)

    def settings_for(self, graph: FinalizedGraph) -> SessionSettings:
        return self.settings.tuned(graph.tuning, keep=self.chosen) if graph.tuning else self.settings

    # --- tuning (see quiver.tuning) ---------------------------------------------------------------------
    knob_space_version = KNOB_SPACE_VERSION

    def tunable_parameters(self, graph: FinalizedGraph) -> tuple[Knob, ...]:
        """The knobs tuning may turn for this graph (accuracy level only where MatMulNBits may run)."""
        return knobs(has_integer_matmuls(graph.model), prepacks=bool(packable_weights(graph)))

    def device_fingerprint(self) -> dict[str, str]:
        return device_fingerprint()

    def container(self) -> PrepackedWeights:
        """The prepacked-weights container shared by every graph prepared by this backend (one context)."""
        with self._lock:
            if self._container is None:
                self._container = PrepackedWeights()
            return self._container

    def after_fork_in_child(self) -> None:
        """A forked child packs into a container of its own: the parent's may be locked by a thread the
        child does not have. The old one is kept (destroying it could wait on that lock)."""
        from quiver.fork import keep_forever

        self._lock = threading.Lock()
        self._bodies = {}  # the parent's executables are not this process's
        if self._container is not None:
            keep_forever(self._container)
            self._container = None

    def prepare_ahead(self, graph: FinalizedGraph, stored: WeightFile) -> AheadOfTimeForm | None:
        """ORT's optimized form of the graph, to store in the context (see `prepared`)."""
        settings = self.settings_for(graph)
        model, _ = session_model(graph, settings)
        source = prepared.source_digest(model.SerializeToString(), settings.accuracy_level)
        return prepared.prepare(model, stored, source, settings.config(prepack=False), ort_log_severity())

    def prepare(self, graph: FinalizedGraph) -> CpuExecutable:
        for tensor in graph.model.graph.initializer:
            if tensor.data_location == proto.TensorProto.EXTERNAL and tensor.name not in graph.weights:
                raise BackendError(f"graph {graph.name!r}: no weight supplied for initializer {tensor.name!r}")
        key = _body_key(graph, self.settings_for(graph))
        with self._lock:
            entries = self._bodies.setdefault(key, [])
            entries[:] = [(ref, inputs) for ref, inputs in entries if ref() is not None]
            for ref, inputs in entries:
                executable = ref()
                shared = executable.share() if executable is not None and _accepts(inputs, graph.inputs) else None
                if shared is not None:
                    return shared
        executable = CpuExecutable(graph, self)
        with self._lock:
            self._bodies.setdefault(key, []).append((weakref.ref(executable), graph.inputs))
        return executable


def _body_key(graph: FinalizedGraph, settings: SessionSettings) -> str:
    """What a session depends on but its graph's edge sizes: the model without the shapes of its inputs,
    outputs and values, the arrays its weights are (the same views of one context), the settings."""
    model = proto.ModelProto()
    model.CopyFrom(graph.model)
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]
    digest = hashlib.sha256(model.SerializeToString(deterministic=True))
    for name in sorted(graph.weights):
        array = graph.weights[name]
        digest.update(f"{name}\0{array.__array_interface__['data'][0]}\0{array.nbytes}\0".encode())
    prepared = [(form.runtime, form.source) for form in graph.prepared]
    digest.update(repr((settings, prepared, graph.file_backed)).encode())
    return digest.hexdigest()


def _accepts(session_inputs: tuple[TensorInfo, ...], inputs: tuple[TensorInfo, ...]) -> bool:
    """Whether a session made for `session_inputs` takes every input of another graph: the same names and
    types, each size either left open there or the same."""
    given = {i.name: i for i in session_inputs}
    for wanted in inputs:
        have = given.get(wanted.name)
        if have is None or have.dtype != wanted.dtype:
            return False
        if have.shape is None:
            continue
        if wanted.shape is None or len(have.shape) != len(wanted.shape):
            return False
        if any(isinstance(h, int) and h != w for h, w in zip(have.shape, wanted.shape)):
            return False
    return len(given) == len(inputs)

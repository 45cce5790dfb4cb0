"""The one small interface every backend implements, and the registry that names them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

from quiver.errors import UnknownBackendError

if TYPE_CHECKING:  # the interface module stays light: importing it must not load ONNX
    import numpy as np
    import onnx

    from quiver.ir.tensors import TensorInfo


KnobValue = bool | int | str


@dataclass(frozen=True)
class Knob:
    """One parameter a backend lets tuning choose per graph: its values, the first being the default.

    A knob that `exact` is set for changes results (not only their rounding): `exact` is its value that
    computes most exactly, which tuning uses as the accuracy reference.
    """

    name: str
    values: tuple[KnobValue, ...]
    help: str = ""
    exact: KnobValue | None = None

    @property
    def default(self) -> KnobValue:
        return self.values[0]


@dataclass(frozen=True)
class PreparedGraph:
    """A backend's own form of a graph, made when the context was built (ONNX Runtime's optimized skeleton).

    A backend uses it only where it was made by the same `runtime` from the same model (`source`, a
    digest the backend defines); anywhere else the portable skeleton is prepared as usual.
    """

    runtime: str  # what made it, and the only runtime that may use it ("onnxruntime 1.32.0")
    source: str  # SHA-256 (hex) of what it was made from, as the backend computes it
    model: Callable[[], onnx.ModelProto]  # read, parsed and checked when asked for
    weights: Mapping[str, np.ndarray]  # its placeholders' values: the context's weights


@dataclass(frozen=True)
class StoredWeight:
    """Where one weight's bytes lie in the file being written, and their SHA-256 (the content key)."""

    offset: int
    length: int
    sha256: str


@dataclass(frozen=True)
class WeightFile:
    """The weights of a graph as the context being written holds them, for `prepare_ahead` only: a runtime
    that reads external data itself (ONNX Runtime) reads them from there, as it would from any model."""

    path: Path
    weights: Mapping[str, StoredWeight]  # by the graph's initializer names


@dataclass(frozen=True)
class AheadOfTimeForm:
    """What `prepare_ahead` makes; the context stores it as a prepared form of the graph (format 1.6)."""

    runtime: str  # as in PreparedGraph
    source: str
    model: onnx.ModelProto  # large initializers are data-less placeholders, each in `reused` or `added`
    reused: Mapping[str, str]  # placeholder -> the graph's initializer holding the same bytes
    added: Mapping[str, np.ndarray]  # placeholder -> a tensor the preparation made (a folded constant)


@dataclass(frozen=True)
class MappedFile:
    """The file a graph's weights are mapped from, for a runtime that reads weights from files itself.

    ONNX Runtime's graph optimizers read weights while they prepare a graph; given the weights' place
    in this file as external data, ORT maps them from it (no copy) and every pass sees every byte.
    """

    path: str  # the file's real path when it was opened
    address: int  # where this process maps it
    size: int
    is_current: Callable[[], bool]  # whether `path` still names the very file mapped (files are replaced)
    identity: str = ""  # names the file's contents (a context's header digest, which covers every checksum)

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where the array's bytes lie in the file, or None when it does not view the mapping."""
        start = int(array.__array_interface__["data"][0]) - self.address
        return start if 0 <= start and start + array.nbytes <= self.size else None


@dataclass(frozen=True)
class FinalizedGraph:
    """What a backend gets: the graph's structure, read-only views of its weights and, when they view a
    mapped file, where that file is (`mapping`)."""

    name: str
    model: onnx.ModelProto  # large initializers are data-less placeholders named in `weights`
    weights: Mapping[str, np.ndarray]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    # True when the weights view a read-only file mapping: their pages may be dropped and are read back
    # from the file on use. Never true for weights in private memory (dropping would lose them).
    file_backed: bool = False
    # A tuned configuration (knob name -> value) chosen for this device; knobs not named keep defaults.
    tuning: Mapping[str, KnobValue] = field(default_factory=lambda: MappingProxyType({}))
    # Forms of the graph prepared ahead for a runtime, stored in the context (format 1.6).
    prepared: tuple[PreparedGraph, ...] = ()
    # The mapped file the weights view, when they view one (file_backed).
    mapping: MappedFile | None = None


@runtime_checkable
class Repeatable(Protocol):
    """An executable that can run the same arrays many times over cheaply (a generation's decode steps)."""

    def repeater(
        self, feeds: Mapping[str, np.ndarray], bound: Mapping[str, np.ndarray] | None, out: Mapping[str, np.ndarray]
    ) -> Callable[[], None]:
        """A function that runs as `run(feeds, bound, out)` does, for as long as only the feeds' values
        change (rewritten in place) and the executable is in use."""
        ...


class Executable(Protocol):
    """A graph prepared by a backend."""

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        bound: Mapping[str, np.ndarray] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        release_scratch: bool = False,
    ) -> list[np.ndarray]:
        """Outputs in the graph's output order; feeds were validated by the runtime.

        `bound` holds inputs that stay the same array objects from run to run (updateable tensors, LoRA
        strengths): a backend may keep what it wraps them in until a different object arrives.
        `out` holds caller-owned arrays (checked: writable, C-contiguous, the output's dtype and shape)
        that receive those outputs; they are returned in place of new arrays. An output array may be an
        input array too (a KV cache updated in place): backends that can, write into it directly.
        `release_scratch`: the memory this run's intermediate values took goes back to the system after it,
        where the backend keeps such memory between runs (a prompt's, before many single-token steps).
        """
        ...

    @property
    def private_bytes(self) -> int:
        """Estimated memory this executable holds beyond the shared weights."""
        ...

    def release(self) -> None: ...

    def wait_until_ready(self) -> None:
        """Blocks until background preparation (if the backend does any) is done."""
        ...


class Backend(Protocol):
    name: str

    def prepare(self, graph: FinalizedGraph) -> Executable: ...


@runtime_checkable
class AheadOfTimeBackend(Backend, Protocol):
    """A backend that does part of its preparation when a context is built and stores the result in it."""

    def prepare_ahead(self, graph: FinalizedGraph, stored: WeightFile) -> AheadOfTimeForm | None:
        """The graph in this backend's own form, or None where that would gain nothing or cost bytes.
        `graph` has no weight views here: they are in `stored`, the file being written."""
        ...


class TunableBackend(Backend, Protocol):
    """A backend tuning can work with (the contract a gpu backend fills with its kernels' parameters)."""

    def tunable_parameters(self, graph: FinalizedGraph) -> tuple[Knob, ...]:
        """The knobs that may move this graph's latency here; `graph.tuning` is honoured by `prepare`."""
        ...

    def device_fingerprint(self) -> dict[str, str]:
        """What measured speed depends on (backend, runtime build, processor): equal fingerprints, one tier."""
        ...

    @property
    def knob_space_version(self) -> int:
        """Changes whenever the knobs' meaning does: cached results for another version are measured again."""
        ...


def is_tunable(backend: Backend) -> TypeGuard[TunableBackend]:
    """Whether tuning can work with this backend (it declares knobs, a fingerprint and their version)."""
    return all(hasattr(backend, n) for n in ("tunable_parameters", "device_fingerprint", "knob_space_version"))


_REGISTRY: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"a backend named {name!r} is already registered")
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(backend: str | Backend) -> Backend:
    """A backend instance from its name (or the instance itself)."""
    if not isinstance(backend, str):
        if not callable(getattr(backend, "prepare", None)) or not isinstance(getattr(backend, "name", None), str):
            raise UnknownBackendError(
                f"backend must be a backend's name ({', '.join(available_backends())}) or a backend object, "
                f"not {type(backend).__name__}"
            )
        return backend
    try:
        return _REGISTRY[backend]()
    except KeyError:
        raise UnknownBackendError(
            f"no backend named {backend!r}; available: {', '.join(available_backends())}"
        ) from None

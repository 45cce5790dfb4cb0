"""What a `quiver.ort` session reports about itself, in ORT's shapes: node args, model metadata, the
engine that runs it, and the nodes each provider was assigned."""

from __future__ import annotations

from dataclasses import dataclass

from quiver.ir import dtypes, proto
from quiver.ir.tensors import TensorInfo


@dataclass(frozen=True)
class ExecutionPath:
    """Which engine runs a session's model: Quiver's own (`"quiver"`: a context, weights shared and mapped,
    adapters applied) or plain ONNX Runtime (`"onnxruntime"`: the model could not be split from its
    weights), and why."""

    engine: str
    reason: str | None = None

    @property
    def on_quiver(self) -> bool:
        return self.engine == "quiver"


@dataclass(frozen=True)
class NodeArg:
    """`onnxruntime.NodeArg`: name, shape (ints, symbolic names or None) and type (`tensor(float)`)."""

    name: str
    shape: list[int | str | None]
    type: str


def node_arg(info: TensorInfo) -> NodeArg:
    elem = dtypes.onnx_of(info.dtype)
    type_name = dtypes.type_name(elem).lower()
    return NodeArg(info.name, list(info.shape) if info.shape is not None else [], f"tensor({type_name})")


@dataclass(frozen=True)
class EpAssignedNode:
    """`onnxruntime.OrtEpAssignedNode`: a node of the model as given."""

    name: str
    domain: str
    op_type: str


@dataclass(frozen=True)
class EpAssignedSubgraph:
    """`onnxruntime.OrtEpAssignedSubgraph`: nodes one execution provider runs."""

    ep_name: str
    nodes: tuple[EpAssignedNode, ...]

    def get_nodes(self) -> list[EpAssignedNode]:
        return list(self.nodes)


class ModelMetadata:
    """`onnxruntime.ModelMetadata`'s fields."""

    def __init__(self, model: proto.ModelProto) -> None:
        self.producer_name = model.producer_name
        self.graph_name = model.graph.name
        self.domain = model.domain
        self.description = model.doc_string
        self.graph_description = model.graph.doc_string
        # ORT reports an unset model_version as the largest int64 (its "unknown"), not as 0
        self.version = model.model_version if model.HasField("model_version") else 2**63 - 1
        self.custom_metadata_map = {p.key: p.value for p in model.metadata_props}

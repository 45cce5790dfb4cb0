"""How a cpu-backend session gets a graph's weights: named by their place in the mapped context file,
so every one of ORT's passes can read them, and shared where ORT packs them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from quiver.backends.base import FinalizedGraph, MappedFile
from quiver.ir import proto
from quiver.ir.edit import iter_nodes
from quiver.ir.quiver_ops import MATMUL_4BITS, QUIVER_DOMAIN

# ORT insists that an external-data initializer's file exists even when `AddInitializer` supplies the
# data, so placeholders name this empty file; nothing reads it (see `SessionWeights`).
PLACEHOLDER_FOLDER = str(Path(__file__).with_name("_ort_folder"))

# (op, input) slots whose weights a session takes as shared initializers (`AddInitializer`): what ORT
# packs, so that graphs sharing a weight share its packed form (ORT's container takes shared ones only).
# A shared initializer overrides whatever ORT's passes did to a weight of that name, so only weights no
# pass rewrites in place under their own name go that way: the packed inputs of the packing operators,
# which passes fuse around (MatMul + Add -> Gemm, DQ + MatMul -> MatMulNBits) but never rewrite.
_SHAREABLE_SLOTS = {
    ("", "MatMul"): {1},
    ("", "Gemm"): {1},
    ("com.microsoft", "FusedMatMul"): {1},
    ("com.microsoft", "MatMulNBits"): {1, 2, 3},
    # Quiver's kernel packs nothing, it reads its blocks where they lie: shared, every session of a context
    # (a quantized dialog's prefill and decode step are two) reads the one mapping of them, where ORT would
    # map the file again for each session (two mappings of the same pages, each counted in the RSS)
    (QUIVER_DOMAIN, MATMUL_4BITS): {1, 2, 3, 4},
}
# Slots that read a weight as it is, which no pass rewrites either: a packed weight also read there stays
# shareable. A tied LM head is the token table a Gather reads: without this, each graph of a dialog (prefill,
# decode) packed its own copy of the head (108 MB for SmolLM2).
_READ_AS_IS_SLOTS = {("", "Gather"): {0}}


def shareable_weights(model: proto.ModelProto) -> set[str]:
    """The initializers that nodes use in a packed slot (`_SHAREABLE_SLOTS`) and otherwise only read as
    they are (`_READ_AS_IS_SLOTS`), subgraphs included."""
    slots: dict[str, bool] = {}
    packed_somewhere: set[str] = set()
    for node in iter_nodes(model.graph):
        op = (node.domain.replace("ai.onnx", ""), node.op_type)
        packed, as_is = _SHAREABLE_SLOTS.get(op, set()), _READ_AS_IS_SLOTS.get(op, set())
        for index, name in enumerate(node.input):
            slots[name] = slots.get(name, True) and (index in packed or index in as_is)
            if index in packed:
                packed_somewhere.add(name)
    return {t.name for t in model.graph.initializer if slots.get(t.name, False) and t.name in packed_somewhere}


@dataclasses.dataclass(frozen=True)
class SessionWeights:
    """How a session gets the graph's weights, none of them copied, every one readable by ORT's passes.

    Each placeholder names the weight's place in the mapped context file as external data: ORT's graph
    optimizers (constant folding, Conv + BatchNormalization fusion, NCHWc filter reordering, and what
    later releases add) read it there, and ORT maps the file itself where kernels use a weight as it is.
    A tensor a pass makes from a weight is the session's own memory, as with ORT alone. Weights ORT packs
    (`shareable_weights`) go in as shared initializers too, views of the context's mapping: the packed form
    is then made once per context. A weight not in a file (a context held in memory) goes in as an
    in-memory external initializer, which ORT copies.
    """

    model: bytes  # the skeleton, its placeholders naming where each weight lies
    shared: dict[str, np.ndarray]
    readable: dict[str, np.ndarray]  # in memory: weights with no file to be read from
    folder: str  # where the placeholders' files are
    mapping: MappedFile | None  # the file named, when one is

    @classmethod
    def of(
        cls, graph: FinalizedGraph, model: proto.ModelProto, optimized: bool = True, files: bool = True
    ) -> SessionWeights:
        """`model`: the session model (its placeholders name `graph.weights`); `optimized`: ORT's graph
        optimizers run (no level "disabled"); `files`: weights may be read from the mapped file."""
        if not optimized:  # nothing reads a weight before the kernels: all shared, placeholders as they are
            return cls(model.SerializeToString(), dict(graph.weights), {}, PLACEHOLDER_FOLDER, None)
        shareable = shareable_weights(model)
        shared = {name: array for name, array in graph.weights.items() if name in shareable}
        mapping = graph.mapping if files and graph.mapping is not None and graph.mapping.is_current() else None
        offsets = {name: mapping.offset_of(array) for name, array in graph.weights.items()} if mapping else {}
        readable = {name: array for name, array in graph.weights.items() if offsets.get(name) is None}
        if not offsets or len(readable) == len(graph.weights):
            return cls(model.SerializeToString(), shared, dict(graph.weights), PLACEHOLDER_FOLDER, None)
        assert mapping is not None
        located = proto.ModelProto()
        located.CopyFrom(model)
        file_name = os.path.basename(mapping.path)
        for tensor in located.graph.initializer:
            offset = offsets.get(tensor.name)
            if offset is not None:
                length = graph.weights[tensor.name].nbytes
                del tensor.external_data[:]
                for key, value in (("location", file_name), ("offset", str(offset)), ("length", str(length))):
                    tensor.external_data.add(key=key, value=value)
        return cls(located.SerializeToString(), shared, readable, os.path.dirname(mapping.path), mapping)

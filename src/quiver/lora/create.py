"""One max-rank LoRA graph for every use case (QNN's model creator), and each use case's tensor values.

At each attach point y = x·W the graph adds ((x·Aᵀ) ⊙ lora_alpha[idx])·(s·B)ᵀ, where Aᵀ [in, R] and
(s·B)ᵀ [R, out] hold the ranks of the use case's adapters side by side (PEFT's "cat"), zero-padded to
R, the largest total rank any use case needs there; idx [R] says which entry of the `lora_alpha`
input scales each rank column. ΔW = Σᵢ αᵢ·sᵢ·Bᵢ·Aᵢ, as PEFT computes with several adapters active.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quiver.errors import AdapterError
from quiver.lora.attach import AttachPoint
from quiver.lora.peft import PeftAdapter

ALPHA_INPUT = "lora_alpha"


@dataclass(frozen=True)
class LoraSlot:
    """The updateable tensors of one attach point."""

    attach: AttachPoint
    rank: int  # R: the widest use case here
    a_name: str
    b_name: str
    index_name: str

    @property
    def tensors(self) -> tuple[str, str, str]:
        return self.a_name, self.b_name, self.index_name


def slot_ranks(adapters: Mapping[str, PeftAdapter], use_cases: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Per adapted module, the largest sum of ranks over the use cases (the concatenated width)."""
    ranks: dict[str, int] = {}
    for names in use_cases.values():
        for module in {m for name in names for m in adapters[name].modules}:
            total = sum(adapters[name].modules[module].rank for name in names if module in adapters[name].modules)
            ranks[module] = max(ranks.get(module, 0), total)
    return ranks


def create_lora_graph(
    model: onnx.ModelProto, attach_points: Mapping[str, AttachPoint], ranks: Mapping[str, int], adapter_count: int
) -> tuple[onnx.ModelProto, list[LoraSlot]]:
    """The base model with a zero LoRA branch at each attach point and a `lora_alpha` input."""
    if ALPHA_INPUT in {i.name for i in model.graph.input}:
        raise AdapterError(f"the model already has an input named {ALPHA_INPUT!r}; it already has LoRA branches")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    by_name = {node.name or f"node_{i}": node for i, node in enumerate(graph.node)}
    slots = []
    new_nodes: dict[str, list[onnx.NodeProto]] = {}
    for index, (module, point) in enumerate(sorted(attach_points.items())):
        node, rank = by_name[point.node], ranks[module]
        tag = f"lora.{index}.{module}"
        slot = LoraSlot(point, rank, f"{tag}.A", f"{tag}.B", f"{tag}.adapter_index")
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.zeros((point.in_features, rank), np.float32), slot.a_name),
                numpy_helper.from_array(np.zeros((rank, point.out_features), np.float32), slot.b_name),
                numpy_helper.from_array(np.zeros(rank, np.int64), slot.index_name),
            ]
        )
        base_out, final_out = f"{tag}.base", node.output[0]
        node.output[0] = base_out
        new_nodes[point.node] = [
            helper.make_node("MatMul", [node.input[0], slot.a_name], [f"{tag}.xa"], name=f"{tag}.down"),
            helper.make_node("Gather", [ALPHA_INPUT, slot.index_name], [f"{tag}.alpha"], name=f"{tag}.alpha"),
            helper.make_node("Mul", [f"{tag}.xa", f"{tag}.alpha"], [f"{tag}.scaled"], name=f"{tag}.scale"),
            helper.make_node("MatMul", [f"{tag}.scaled", slot.b_name], [f"{tag}.delta"], name=f"{tag}.up"),
            helper.make_node("Add", [base_out, f"{tag}.delta"], [final_out], name=f"{tag}.add"),
        ]
        slots.append(slot)
    ordered = []
    for i, node in enumerate(graph.node):  # each branch right after its attach node: stays topological
        ordered.append(node)
        ordered.extend(new_nodes.get(node.name or f"node_{i}", []))
    del graph.node[:]
    graph.node.extend(ordered)
    graph.input.append(helper.make_tensor_value_info(ALPHA_INPUT, TensorProto.FLOAT, [adapter_count]))
    return result, slots


def use_case_values(
    slots: Sequence[LoraSlot], adapters: Mapping[str, PeftAdapter], active: Sequence[str], adapter_order: Sequence[str]
) -> dict[str, np.ndarray]:
    """The updateable tensors of one use case: its adapters' A and s·B side by side, zero-padded."""
    values: dict[str, np.ndarray] = {}
    for slot in slots:
        point = slot.attach
        a_t = np.zeros((point.in_features, slot.rank), np.float32)
        b_t = np.zeros((slot.rank, point.out_features), np.float32)
        index = np.zeros(slot.rank, np.int64)
        column = 0
        for name in active:
            module = adapters[name].modules.get(point.module)
            if module is None:
                continue
            a, b = module.lora_a, module.lora_b  # [r, in], [out, r]
            if a.shape[1] != point.in_features or b.shape[0] != point.out_features:
                raise AdapterError(
                    f"adapter {name!r} module {point.module!r} is [{b.shape[0]} x {a.shape[1]}], but its attach "
                    f"point {point.node!r} is [{point.out_features} x {point.in_features}]: wrong base model?"
                )
            end = column + module.rank
            a_t[:, column:end] = a.T
            b_t[column:end, :] = module.scaling * b.T
            index[column:end] = adapter_order.index(name)
            column = end
        values.update({slot.a_name: a_t, slot.b_name: b_t, slot.index_name: index})
    return values

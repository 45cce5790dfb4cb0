"""One max-rank LoRA graph for every use case (QNN's model creator), and each use case's tensor values.

At each attach point y = x·W the graph adds ((x·Aᵀ) ⊙ lora_alpha[idx])·(s·B)ᵀ, where Aᵀ [in, R] and
(s·B)ᵀ [R, out] hold the ranks of the use case's adapters side by side (PEFT's "cat"), zero-padded to
R, the largest total rank any use case needs there; idx [R] says which entry of the `lora_alpha`
input scales each rank column. ΔW = Σᵢ αᵢ·sᵢ·Bᵢ·Aᵢ, as PEFT computes with several adapters active.
A Conv attach point gets Conv(x, A) (the base conv's geometry) -> ⊙ alpha per channel -> 1x1 Conv(·, s·B).

Per-row tables (`per_row=True`: the batched graph `quiver serve` decodes with, every row of a step on
its own adapter, BGMV's job): A and B are graph inputs, Aᵀ [T, R, in] and B [T, R, out] (B carries the
strengths already): T = 1, one adapter for every row (R = 0: none), or T = the batch, row i's own adapter
in entry i. The branch is x·Aᵀ·B: one product for all rows, or batched products of one row each, which
read each row's tables once and compute its own rank alone (no other adapter's columns computed and
masked away). No down-projection is shared in this form (nor in the graph whose tables the sections
fill: their tensors must match by name).

Linear attach points that read the same input (q/k/v, gate/up) share one down-projection: one MatMul
by their A's side by side, then a Split. A small MatMul costs ORT about as much to launch as to
compute, so three become one (about 1 % of a run of the benchmark transformer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quiver.errors import AdapterError
from quiver.ir.ops import MS_DOMAIN, use_microsoft_domain
from quiver.ir.tensors import LORA_ALPHA_INPUT
from quiver.lora.attach import AttachPoint
from quiver.lora.peft import PeftAdapter

ALPHA_INPUT = LORA_ALPHA_INPUT
TABLE_ROWS = "lora_rows"  # a per-row graph's tables' leading axis: 1 (one adapter for all rows) or the batch
_B_SUFFIX, _INDEX_SUFFIX = ".B", ".adapter_index"  # a branch's B and the adapter of each of its ranks


@dataclass(frozen=True)
class LoraSlot:
    """The updateable tensors of one attach point."""

    attach: AttachPoint
    rank: int  # R: the widest use case here
    a_name: str
    b_name: str
    index_name: str
    # A down-projection shared with other attach points on the same input: this slot's columns of
    # A are [a_offset, a_offset + rank) of a_width.
    a_offset: int
    a_width: int

    @property
    def tensors(self) -> tuple[str, str, str]:
        return self.a_name, self.b_name, self.index_name


def updateable_tensors(slots: Sequence[LoraSlot]) -> list[str]:
    """The graph's updateable tensors: every slot's A, B and adapter index, a shared A once."""
    return list(dict.fromkeys(name for slot in slots for name in slot.tensors))


def slot_ranks(adapters: Mapping[str, PeftAdapter], use_cases: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Per adapted module, the largest sum of ranks over the use cases (the concatenated width)."""
    ranks: dict[str, int] = {}
    for names in use_cases.values():
        for module in {m for name in names for m in adapters[name].modules}:
            total = sum(adapters[name].modules[module].rank for name in names if module in adapters[name].modules)
            ranks[module] = max(ranks.get(module, 0), total)
    return ranks


def _branch_shapes(slot: LoraSlot) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the branch's A and B: [in, width] and [R, out], or for a conv [R, in, kh, kw] and [out, R, 1, 1]."""
    point, rank = slot.attach, slot.rank
    if point.op_type == "Conv":
        return (rank, point.in_features, *point.kernel), (point.out_features, rank, 1, 1)
    return (point.in_features, slot.a_width), (rank, point.out_features)


def _shared_inputs(
    points: Sequence[tuple[str, AttachPoint]], by_name: Mapping[str, onnx.NodeProto], model: onnx.ModelProto
) -> dict[str, list[str]]:
    """Input -> the linear attach points (modules) that read it, where two or more do and Split takes sizes."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:  # before opset 13, Split's sizes are an attribute; keep one down-projection each
        return {}
    readers: dict[str, list[str]] = {}
    for module, point in points:
        if point.op_type != "Conv":
            readers.setdefault(by_name[point.node].input[0], []).append(module)
    return {x: modules for x, modules in readers.items() if len(modules) > 1}


def _splice_point(
    name: str,
    node: onnx.NodeProto,
    users: Mapping[str, list[tuple[str, onnx.NodeProto]]],
    constants: set[str],
    outputs: set[str],
) -> tuple[str, onnx.NodeProto]:
    """The node whose output gets the LoRA delta: the attach node, or its bias Add when that is its only user."""
    consumers = users.get(node.output[0], [])
    if len(consumers) == 1 and node.output[0] not in outputs:
        user_name, user = consumers[0]
        if user.op_type == "Add" and len(user.input) == 2 and any(i in constants for i in user.input):
            return user_name, user
    return name, node


def create_lora_graph(
    model: onnx.ModelProto,
    attach_points: Mapping[str, AttachPoint],
    ranks: Mapping[str, int],
    adapter_count: int,
    per_row: bool = False,
    share_down_projections: bool = True,
) -> tuple[onnx.ModelProto, list[LoraSlot]]:
    """The base model with a zero LoRA branch at each attach point and a `lora_alpha` input, or with
    `per_row`, branches over per-row adapter tables (the module docstring).
    `share_down_projections` False gives every attach point its own A (a per-row graph never shares)."""
    inputs = [i.name for i in model.graph.input]
    if (ALPHA_INPUT in inputs) if not per_row else any(name.startswith("lora.") for name in inputs):
        raise AdapterError("the model already has LoRA inputs (`lora_alpha` or `lora.*`); it has LoRA branches already")
    if per_row and any(p.op_type == "Conv" for p in attach_points.values()):
        raise AdapterError("per-row adapter slots are made for linear layers (a decoder); this model adapts a Conv")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    by_name = {node.name or f"node_{i}": node for i, node in enumerate(graph.node)}
    users: dict[str, list[tuple[str, onnx.NodeProto]]] = {}
    for name, candidate in by_name.items():
        for value in dict.fromkeys(candidate.input):
            users.setdefault(value, []).append((name, candidate))
    constants = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    points = sorted(attach_points.items())
    shared = _shared_inputs(points, by_name, result) if share_down_projections and not per_row else {}
    group_of = {module: group for group, modules in enumerate(shared.values()) for module in modules}
    widths = {x: sum(ranks[m] for m in modules) for x, modules in shared.items()}
    offsets: dict[str, int] = {}
    projected: dict[str, str] = {}  # module -> its branch's x·Aᵀ, which a shared down-projection's Split makes
    slots = []
    new_nodes: dict[str, list[onnx.NodeProto]] = {}
    before: dict[str, list[onnx.NodeProto]] = {}  # a shared down-projection goes before its first reader
    for index, (module, point) in enumerate(points):
        node, rank = by_name[point.node], ranks[module]
        tag = f"lora.{index}.{module}"
        x, alpha = node.input[0], f"{tag}.alpha"
        projected[module] = f"{tag}.xa"
        if module in group_of:  # columns handed out in `points` order, as the Split below lists them
            a_name, offset, width = f"lora.shared{group_of[module]}.A", offsets.get(x, 0), widths[x]
            offsets[x] = offset + rank
        else:
            a_name, offset, width = f"{tag}.A", 0, rank
        slot = LoraSlot(point, rank, a_name, tag + _B_SUFFIX, tag + _INDEX_SUFFIX, offset, width)
        a_shape, b_shape = _branch_shapes(slot)
        if per_row:  # tables the caller owns and feeds: Aᵀ [T, R, in], B [T, R, out]
            graph.input.extend(
                helper.make_tensor_value_info(name, TensorProto.FLOAT, [TABLE_ROWS, f"{tag}.rank", size])
                for name, size in ((slot.a_name, point.in_features), (slot.b_name, point.out_features))
            )
        else:
            if offset == 0:
                graph.initializer.append(numpy_helper.from_array(np.zeros(a_shape, np.float32), slot.a_name))
            graph.initializer.extend(
                [
                    numpy_helper.from_array(np.zeros(b_shape, np.float32), slot.b_name),
                    numpy_helper.from_array(np.zeros(rank, np.int64), slot.index_name),
                ]
            )
        # Add the delta after a following bias Add, if there is one: MatMul + bias stays fusable for ORT.
        splice_name, splice = _splice_point(point.node, node, users, constants, outputs)
        base_out, final_out = f"{tag}.base", splice.output[0]
        splice.output[0] = base_out
        if per_row:  # x·Aᵀ·B: every row by one adapter's tables, or batched, each row by its own
            branch = [
                helper.make_node(
                    "FusedMatMul", [x, slot.a_name], [f"{tag}.xa"], name=f"{tag}.down", domain=MS_DOMAIN, transB=1
                ),
                helper.make_node("MatMul", [f"{tag}.xa", slot.b_name], [f"{tag}.delta"], name=f"{tag}.up"),
            ]
        elif point.op_type == "Conv":  # QNN's Conv -> Mul -> Conv: A keeps the base conv's geometry, B is 1x1
            per_channel = f"{tag}.per_channel"
            graph.initializer.append(numpy_helper.from_array(np.array([1, -1, 1, 1], np.int64), per_channel))
            branch = [
                helper.make_node("Gather", [ALPHA_INPUT, slot.index_name], [alpha], name=f"{tag}.alpha"),
                helper.make_node("Conv", [x, slot.a_name], [f"{tag}.xa"], name=f"{tag}.down", **dict(point.conv)),
                helper.make_node("Reshape", [alpha, per_channel], [f"{tag}.alpha4"], name=f"{tag}.alpha4"),
                helper.make_node("Mul", [f"{tag}.xa", f"{tag}.alpha4"], [f"{tag}.scaled"], name=f"{tag}.scale"),
                helper.make_node("Conv", [f"{tag}.scaled", slot.b_name], [f"{tag}.delta"], name=f"{tag}.up"),
            ]
        else:
            branch = [helper.make_node("Gather", [ALPHA_INPUT, slot.index_name], [alpha], name=f"{tag}.alpha")]
            if module not in group_of:
                branch.append(helper.make_node("MatMul", [x, slot.a_name], [f"{tag}.xa"], name=f"{tag}.down"))
            branch += [
                helper.make_node("Mul", [f"{tag}.xa", alpha], [f"{tag}.scaled"], name=f"{tag}.scale"),
                helper.make_node("MatMul", [f"{tag}.scaled", slot.b_name], [f"{tag}.delta"], name=f"{tag}.up"),
            ]
        branch.append(helper.make_node("Add", [base_out, f"{tag}.delta"], [final_out], name=f"{tag}.add"))
        new_nodes[splice_name] = branch
        slots.append(slot)
    positions = {name: i for i, name in enumerate(by_name)}
    for group, (x, modules) in enumerate(shared.items()):
        members = [slot for slot in slots if slot.attach.module in modules]
        a_name, down = members[0].a_name, f"lora.shared{group}"
        sizes = f"{down}.split"
        graph.initializer.append(numpy_helper.from_array(np.array([m.rank for m in members], np.int64), sizes))
        first = min((m.attach.node for m in members), key=positions.__getitem__)
        parts = [projected[m.attach.module] for m in members]
        before[first] = [
            helper.make_node("MatMul", [x, a_name], [f"{down}.xa"], name=f"{down}.down"),
            helper.make_node("Split", [f"{down}.xa", sizes], parts, axis=-1, name=sizes),
        ]
    ordered: list[onnx.NodeProto] = []
    for i, node in enumerate(graph.node):  # each branch right after its attach node: stays topological
        ordered.extend(before.get(node.name or f"node_{i}", []))
        ordered.append(node)
        ordered.extend(new_nodes.get(node.name or f"node_{i}", []))
    del graph.node[:]
    graph.node.extend(ordered)
    if per_row:
        use_microsoft_domain(result)
    else:
        graph.input.append(helper.make_tensor_value_info(ALPHA_INPUT, TensorProto.FLOAT, [adapter_count]))
    return result, slots


def use_case_values(
    slots: Sequence[LoraSlot], adapters: Mapping[str, PeftAdapter], active: Sequence[str], adapter_order: Sequence[str]
) -> dict[str, np.ndarray]:
    """The updateable tensors of one use case: its adapters' A and s·B side by side, zero-padded."""
    values: dict[str, np.ndarray] = {}
    for slot in slots:
        point = slot.attach
        a_shape, b_shape = _branch_shapes(slot)
        a_t = values.setdefault(slot.a_name, np.zeros(a_shape, np.float32))  # a shared A: filled slot by slot
        b_t = np.zeros(b_shape, np.float32)
        index = np.zeros(slot.rank, np.int64)
        column = 0
        for name in active:
            module = adapters[name].modules.get(point.module)
            if module is None:
                continue
            a, b = module.lora_a, module.lora_b  # [r, in] and [out, r], or [r, in, kh, kw] and [out, r, 1, 1]
            fits = (
                a.shape[1] == point.in_features
                and b.shape[0] == point.out_features
                and module.is_conv == (point.op_type == "Conv")
                and tuple(a.shape[2:]) == point.kernel
            )
            if not fits:
                raise AdapterError(
                    f"adapter {name!r} module {point.module!r} has A {list(a.shape)} and B {list(b.shape)}, but its "
                    f"attach point {point.node!r} is a {point.op_type} of [{point.out_features} x {point.in_features}"
                    f"{' x ' + 'x'.join(map(str, point.kernel)) if point.kernel else ''}]: wrong base model?"
                )
            end = column + module.rank
            if module.is_conv:
                a_t[column:end] = a
                b_t[:, column:end] = module.scaling * b
            else:
                a_t[:, slot.a_offset + column : slot.a_offset + end] = a.T
                b_t[column:end, :] = module.scaling * b.T
            index[column:end] = adapter_order.index(name)
            column = end
        values.update({slot.b_name: b_t, slot.index_name: index})
    return values


def table_module(name: str) -> tuple[str, str] | None:
    """The adapted module (as PEFT names it) and the side ("A" or "B") of a per-row graph's table, from its
    name (`lora.<index>.<module>.A`), or None for another input."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "lora" or not parts[1].isdigit() or parts[-1] not in ("A", "B"):
        return None
    return ".".join(parts[2:-1]), parts[-1]


def fill_slot(rows: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray], alphas: np.ndarray) -> None:
    """Writes one per-row slot: `rows` maps each table (the per-row graph's A and B inputs) to the slot's
    rows of it, filled from a use case's updateable tensors (a section's) and its strengths: Aᵀ [R, in],
    and B [R, out] with each rank row times the strength of the adapter it belongs to (`adapter_index`).
    In place: one pass over the adapter's bytes."""
    for name, target in rows.items():
        value = values[name]
        if name.endswith(_B_SUFFIX):
            index = np.asarray(values[name[: -len(_B_SUFFIX)] + _INDEX_SUFFIX], np.int64)
            np.multiply(value, alphas[index][:, None], out=target)
        else:
            np.copyto(target, value.T)


@dataclass(frozen=True)
class LoraGraph:
    """The created graph (QNN's model creator output) and what import needs to fill it."""

    model: onnx.ModelProto
    slots: list[LoraSlot]
    adapter_order: list[str]
    name: str  # the graph's name in the context: the base model's file stem

    @property
    def updateable(self) -> list[str]:
        return updateable_tensors(self.slots)

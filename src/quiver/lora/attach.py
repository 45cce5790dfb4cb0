"""Finds where each adapted module lives in an ONNX graph: the MatMul/Gemm that applies its weight."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import onnx

from quiver.errors import AdapterError

NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # the dynamo exporter's module path of each node


@dataclass(frozen=True)
class AttachPoint:
    """A layer with a weight: y = x·W (MatMul, W [in, out]), Gemm (W [out, in] with transB=1), or Conv
    (W [out, in, kh, kw], one group; `conv` holds its strides, pads and dilations for the branch)."""

    module: str
    node: str
    op_type: str
    weight: str
    in_features: int
    out_features: int
    found_by: str  # "name_scopes", "weight_name" or "explicit"
    kernel: tuple[int, ...] = ()  # Conv: (kh, kw); empty for MatMul/Gemm
    conv: tuple[tuple[str, Any], ...] = ()  # Conv: the attributes the branch's first conv copies


def scopes_of(node: onnx.NodeProto) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES:
            try:
                value = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return []
            return [v for v in value if isinstance(v, str) and v] if isinstance(value, list) else []
    return []


def _matches(module: str, path: str) -> bool:
    """Module paths match when one ends the other at a dot boundary (exports may wrap the model)."""
    return module == path or module.endswith(f".{path}") or path.endswith(f".{module}")


_CONV_ATTRIBUTES = ("strides", "pads", "dilations", "auto_pad")

_Linear = tuple[str, int, int, tuple[int, ...], tuple[tuple[str, Any], ...]]


def _conv(node: onnx.NodeProto, dims: list[int]) -> _Linear | None:
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if len(dims) != 4 or attributes.get("group", 1) != 1:
        return None  # 2-D convs of one group only; grouped and depthwise convs are not attach points here
    conv = tuple((k, attributes[k]) for k in _CONV_ATTRIBUTES if k in attributes)
    return node.input[1], dims[1], dims[0], tuple(dims[2:]), conv


def _linear(node: onnx.NodeProto, initializers: Mapping[str, onnx.TensorProto]) -> _Linear | None:
    """(weight name, in, out, kernel, conv attributes) when the node applies an initializer weight, else None."""
    if node.op_type not in ("MatMul", "Gemm", "Conv") or len(node.input) < 2 or node.input[1] not in initializers:
        return None
    dims = list(initializers[node.input[1]].dims)
    if node.op_type == "Conv":
        return _conv(node, dims)
    if len(dims) != 2:
        return None
    trans_b = any(a.name == "transB" and a.i for a in node.attribute) if node.op_type == "Gemm" else False
    out_features, in_features = dims if trans_b else dims[::-1]
    return node.input[1], in_features, out_features, (), ()


def find_attach_points(
    model: onnx.ModelProto,
    modules: Iterable[str],
    explicit: Mapping[str, str] | None = None,
    part: bool = False,
) -> tuple[dict[str, AttachPoint], list[str]]:
    """The attach point of each module, and the modules that found none.

    `explicit` maps module paths to node names (QNN's pytorch2onnx map); otherwise the dynamo
    exporter's name scopes, then weight names (`<module>.weight`, as the TorchScript exporter keeps).
    `part`: the model is one part of a split model, so a mapped node it lacks is another part's.
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes = {node.name or f"node_{i}": node for i, node in enumerate(graph.node)}
    linears = {name: (node, info) for name, node in nodes.items() if (info := _linear(node, initializers))}
    scopes = {name: scopes_of(node)[-2:] for name, (node, _) in linears.items()}  # parsed once, not per module
    found: dict[str, AttachPoint] = {}
    missing = []
    for module in modules:
        candidates: list[tuple[str, str]] = []
        if explicit and module in explicit:
            if explicit[module] not in linears and part and explicit[module] not in nodes:
                missing.append(module)
                continue
            if explicit[module] not in linears:
                raise AdapterError(
                    f"the map sends {module!r} to {explicit[module]!r}, which is not a MatMul/Gemm/Conv "
                    "with a weight in this graph"
                )
            candidates = [(explicit[module], "explicit")]
        else:
            candidates = [(n, "name_scopes") for n in linears if any(_matches(module, s) for s in scopes[n])]
            if not candidates:
                candidates = [
                    (n, "weight_name") for n, (_, info) in linears.items() if _matches(f"{module}.weight", info[0])
                ]
        if not candidates:
            missing.append(module)
            continue
        if len(candidates) > 1:
            raise AdapterError(
                f"module {module!r} matches several linear nodes {[c[0] for c in candidates]}; "
                "give an explicit map (module -> node name)"
            )
        name, how = candidates[0]
        weight, in_features, out_features, kernel, conv = linears[name][1]
        node = linears[name][0]
        found[module] = AttachPoint(module, name, node.op_type, weight, in_features, out_features, how, kernel, conv)
    return found, missing

"""Finds where each adapted module lives in an ONNX graph: the MatMul/Gemm that applies its weight."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import onnx

from quiver.errors import AdapterError

NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # the dynamo exporter's module path of each node


@dataclass(frozen=True)
class AttachPoint:
    """A linear layer in the graph: y = x·W (MatMul, W [in, out]) or Gemm (W [out, in] with transB=1)."""

    module: str
    node: str
    op_type: str
    weight: str
    in_features: int
    out_features: int
    found_by: str  # "name_scopes", "weight_name" or "explicit"


def _scopes(node: onnx.NodeProto) -> list[str]:
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


def _linear(node: onnx.NodeProto, initializers: Mapping[str, onnx.TensorProto]) -> tuple[str, int, int] | None:
    """(weight name, in, out) when the node multiplies by a 2-D initializer, else None."""
    if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in initializers:
        return None
    dims = list(initializers[node.input[1]].dims)
    if len(dims) != 2:
        return None
    trans_b = any(a.name == "transB" and a.i for a in node.attribute) if node.op_type == "Gemm" else False
    out_features, in_features = dims if trans_b else dims[::-1]
    return node.input[1], in_features, out_features


def find_attach_points(
    model: onnx.ModelProto, modules: Iterable[str], explicit: Mapping[str, str] | None = None
) -> tuple[dict[str, AttachPoint], list[str]]:
    """The attach point of each module, and the modules that found none.

    `explicit` maps module paths to node names (QNN's pytorch2onnx map); otherwise the dynamo
    exporter's name scopes, then weight names (`<module>.weight`, as the TorchScript exporter keeps).
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes = {node.name or f"node_{i}": node for i, node in enumerate(graph.node)}
    linears = {name: (node, info) for name, node in nodes.items() if (info := _linear(node, initializers))}
    found: dict[str, AttachPoint] = {}
    missing = []
    for module in modules:
        candidates: list[tuple[str, str]] = []
        if explicit and module in explicit:
            if explicit[module] not in linears:
                raise AdapterError(
                    f"the map sends {module!r} to {explicit[module]!r}, which is not a MatMul/Gemm "
                    "with a 2-D weight in this graph"
                )
            candidates = [(explicit[module], "explicit")]
        else:
            candidates = [
                (n, "name_scopes")
                for n, (node, _) in linears.items()
                if any(_matches(module, scope) for scope in _scopes(node)[-2:])
            ]
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
        weight, in_features, out_features = linears[name][1]
        found[module] = AttachPoint(module, name, linears[name][0].op_type, weight, in_features, out_features, how)
    return found, missing

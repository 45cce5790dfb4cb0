"""EPContext models: a one-node ONNX model that stands for a graph of a Quiver context binary.

The node follows ORT's EPContext contract (domain `com.microsoft`; attributes `main_context`,
`ep_cache_context`, `embed_mode`, `source`, `partition_name`, `ep_sdk_version`) and has the graph's
inputs and outputs, so code that opens the `_ctx.onnx` sees the same I/O as the source model.
`embed_mode=0`: `ep_cache_context` is the `.qctx` path relative to the model's folder (it may not
leave that folder); `embed_mode=1`: it holds the `.qctx` bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from quiver.formats.writer import copy_atomically, write_atomically
from quiver.ir import dtypes, proto
from quiver.ir.tensors import TensorInfo
from quiver.ort.errors import InvalidGraph, NoSuchFile
from quiver.runtime.context import Context
from quiver.version import __version__

MS_DOMAIN = "com.microsoft"
SOURCE = "Quiver"


def _value_info(info: TensorInfo) -> proto.ValueInfoProto:
    from onnx import helper  # writing EPContext models is building: the onnx package is fine here

    shape = None if info.shape is None else list(info.shape)
    return helper.make_tensor_value_info(info.name, dtypes.onnx_of(info.dtype), shape)


def ep_context_model(
    graph: str,
    inputs: Sequence[TensorInfo],
    outputs: Sequence[TensorInfo],
    cache: str | bytes,
    main_context: bool = True,
) -> proto.ModelProto:
    """The EPContext model of one graph; `cache` is a relative path (embed_mode 0) or the `.qctx` bytes (1)."""
    embedded = isinstance(cache, bytes)
    cache_bytes = cache if isinstance(cache, bytes) else cache.encode()
    from onnx import helper

    node = helper.make_node(
        "EPContext",
        [i.name for i in inputs],
        [o.name for o in outputs],
        name=f"{graph}_EPContext",
        domain=MS_DOMAIN,
        main_context=int(main_context),
        ep_cache_context=cache_bytes,
        embed_mode=int(embedded),
        source=SOURCE,
        partition_name=graph,
        ep_sdk_version=__version__,
    )
    model_graph = helper.make_graph([node], graph, [_value_info(i) for i in inputs], [_value_info(o) for o in outputs])
    return helper.make_model(
        model_graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)],
        producer_name="quiver",
        producer_version=__version__,
    )


def save_ep_context_model(model: proto.ModelProto, path: Path) -> Path:
    write_atomically(path, model.SerializeToString())
    return path


@dataclass(frozen=True)
class EpContext:
    graph: str
    cache: Path | bytes  # the .qctx file, or its bytes when embedded
    main_context: bool


def _attribute_value(attribute: proto.AttributeProto) -> object:
    """A string or integer attribute's value (onnx.helper.get_attribute_value without importing onnx);
    other kinds come back as the attribute itself, which every check below refuses by type."""
    if attribute.type == proto.AttributeProto.STRING:
        return attribute.s
    if attribute.type == proto.AttributeProto.INT:
        return attribute.i
    return attribute


def is_ep_context_model(model: proto.ModelProto) -> bool:
    return any(n.op_type == "EPContext" and n.domain == MS_DOMAIN for n in model.graph.node)


def read_ep_context(model: proto.ModelProto, folder: Path | None) -> EpContext:
    """Where the context of an EPContext model is; a path may not leave the model's folder."""
    nodes = [n for n in model.graph.node if n.op_type == "EPContext" and n.domain == MS_DOMAIN]
    if len(nodes) != 1 or len(model.graph.node) != 1:
        raise InvalidGraph("an EPContext model for Quiver holds exactly one EPContext node and nothing else")
    attributes = {a.name: _attribute_value(a) for a in nodes[0].attribute}

    def text(name: str) -> str:
        value = attributes.get(name, b"")
        if not isinstance(value, bytes):
            raise InvalidGraph(f"the EPContext attribute {name!r} must be a string, not {type(value).__name__}")
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidGraph(f"the EPContext attribute {name!r} is not UTF-8") from None

    def number(name: str, default: int) -> int:
        value = attributes.get(name, default)
        if not isinstance(value, int):
            raise InvalidGraph(f"the EPContext attribute {name!r} must be an integer, not {type(value).__name__}")
        return value

    source = text("source")
    if source != SOURCE:
        raise InvalidGraph(f"this EPContext node was made by {source!r}, not by {SOURCE}")
    graph = text("partition_name") or model.graph.name
    cache = attributes.get("ep_cache_context")
    if not isinstance(cache, bytes) or not cache:
        raise InvalidGraph("the EPContext node has no ep_cache_context")
    main = bool(number("main_context", 1))
    if number("embed_mode", 0) == 1:
        return EpContext(graph, cache, main)
    if folder is None:  # bytes: no folder to resolve the path against (never the working directory)
        raise InvalidGraph(
            "an EPContext model given as bytes must embed its context (embed_mode=1); open it by its path instead"
        )
    base = folder.resolve()
    try:
        relative = Path(cache.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidGraph("the EPContext attribute 'ep_cache_context' is not a UTF-8 path") from None
    target = (base / relative).resolve()
    if relative.is_absolute() or not target.is_relative_to(base):
        raise InvalidGraph(
            f"ep_cache_context {relative} leaves the model's folder {base}; keep the .qctx beside the _ctx.onnx"
        )
    if not target.is_file():
        raise NoSuchFile(f"the context binary {target} named by the EPContext model does not exist")
    return EpContext(graph, target, main)


def wrap_context(qctx: Path, out_dir: Path) -> list[Path]:
    """`quiver ort-wrap`: one `<graph>_ctx.onnx` per graph of `qctx`, all naming one `.qctx` in `out_dir`.

    Like ORT's `gen_qnn_ctx_onnx_model.py`. The `.qctx` is copied into `out_dir` unless it is there already
    (an EPContext path may not leave the model's folder).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    local = out_dir / qctx.name
    if not local.exists() or local.resolve() != qctx.resolve():
        copy_atomically(qctx, local)
    written = []
    with Context.from_binary(local, backend="reference") as context:
        for index, name in enumerate(context.graph_names):
            graph = context.graph(name)
            model = ep_context_model(name, graph.inputs, graph.outputs, local.name, main_context=index == 0)
            written.append(save_ep_context_model(model, out_dir / f"{name}_ctx.onnx"))
    return written

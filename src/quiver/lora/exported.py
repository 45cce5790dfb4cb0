"""Adapter weights read from a use case's exported graph (QNN's LoRA v3 flow exports the base model with
its adapters attached, one graph per concurrency), for adapters given by their config alone.

A branch is found by what its layers are named: the module path `<module>.lora_A[.<adapter>]` in the
weight's own name (the TorchScript exporter keeps parameter names) or in the node's
`pkg.torch.onnx.name_scopes` (the dynamo exporter renames weights). Its MatMul/Gemm/Conv weights are
turned back into PEFT's layout (A [r, in], B [out, r], or a conv's [r, in, kh, kw] and [out, r, 1, 1]);
the scaling comes from the adapter's config, as PEFT computes it, whatever constant the graph holds.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from quiver.errors import AdapterError
from quiver.lora.attach import scopes_of
from quiver.lora.peft import PEFT_PREFIX, PeftAdapter, adapter_of, config_path_of, read_lora_config

_BRANCH = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$")


def adapter_from_export(source: str | Path, name: str, export: Path) -> PeftAdapter:
    """The adapter `name` (its config at `source`) with its A and B weights from `export`."""
    config = read_lora_config(config_path_of(source))
    try:
        model = onnx.load(str(export))
    except Exception as exc:
        raise AdapterError(f"{export}: not a readable ONNX model ({str(exc)[:200]})") from None
    initializers = {t.name: t for t in model.graph.initializer}
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm", "Conv") or len(node.input) < 2 or node.input[1] not in initializers:
            continue
        weight = node.input[1]
        found = _BRANCH.match(weight) or next((m for s in reversed(scopes_of(node)) if (m := _BRANCH.match(s))), None)
        if found is None or found.group("adapter") not in (None, name):
            continue
        module = found.group("module").removeprefix(PEFT_PREFIX)
        which = found.group("which")
        array = numpy_helper.to_array(initializers[weight]).astype(np.float32)
        pairs.setdefault(module, {})[which] = _peft_layout(node, array, which, export)
    if not pairs:
        raise AdapterError(
            f"adapter {name!r}: {source} has no weights beside it and {export} holds no LoRA branch of it "
            "(layers named <module>.lora_A / lora_B, by weight name or name scope); give its PEFT folder"
        )
    return adapter_of(name, config, pairs, str(export))


def _peft_layout(node: onnx.NodeProto, array: np.ndarray, which: str, export: Path) -> np.ndarray:
    """A branch layer's weight in PEFT's layout: a MatMul's [in, out] transposed, a Gemm's as its transB
    says, a conv's as it is."""
    if node.op_type == "Conv":
        return array
    if array.ndim != 2:
        raise AdapterError(f"{export}: LoRA layer {node.name!r} has a weight of shape {list(array.shape)}, not 2-D")
    trans_b = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
    return array if trans_b else np.ascontiguousarray(array.T)

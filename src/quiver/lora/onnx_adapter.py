"""ONNX Runtime's LoRA adapter files (`.onnx_adapter`, its flatbuffer format): read with ORT, and turned
into a Quiver binary section for a context whose updateable tensors they name."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from quiver.errors import AdapterError
from quiver.formats.writer import write_atomically


def read_onnx_adapter(path: str | Path) -> dict[str, np.ndarray]:
    """The parameters of an `.onnx_adapter` file, as numpy arrays (read by ORT's own `AdapterFormat`)."""
    from quiver.ort_package import onnxruntime

    try:
        adapter = onnxruntime.AdapterFormat.read_adapter(str(path))
    except RuntimeError:
        raise AdapterError(
            f"{path} is not a LoRA adapter: neither a Quiver section (.qsec) nor ONNX Runtime's .onnx_adapter"
        ) from None
    return {name: np.array(value.numpy()) for name, value in adapter.get_parameters().items()}


def section_from_onnx_adapter(
    adapter: str | Path, context: str | Path, output: str | Path, graphs: Sequence[str] = ()
) -> Path:
    """Writes a `.qsec` holding the adapter's parameters as new values of the context's updateable tensors
    of the same names: for `graphs`, or every graph that has all of them (a super section)."""
    from quiver.runtime.context import Context

    parameters = read_onnx_adapter(adapter)
    if not parameters:
        raise AdapterError(f"{adapter} holds no parameters")
    with Context.from_binary(context) as loaded:
        candidates = list(graphs) or loaded.updateable_graphs()
        targets = []
        for name in candidates:
            updateable = set(loaded.file.graphs[name].updateable) if name in loaded.graph_names else set()
            if set(parameters) <= updateable:
                targets.append(name)
            elif graphs:
                missing = sorted(set(parameters) - updateable)
                raise AdapterError(
                    f"graph {name!r} of {context} has no updateable tensors named {missing}; an .onnx_adapter's "
                    "parameter names must be the LoRA tensors the context was built with (quiver lora prepare)"
                )
        if not targets:
            raise AdapterError(
                f"no graph of {context} has updateable tensors named {sorted(parameters)[:4]}...; build the "
                "context with those tensors updateable, or feed the adapter through quiver.ort.LoraAdapter"
            )
        for name in targets:
            graph = loaded.graph(name)
            graph.update_tensors(parameters)
            graph.finalize()
        data = loaded.get_binary_section(
            targets[0] if len(targets) == 1 else None, {"adapter": Path(adapter).stem, "source": "onnx_adapter"}
        )
    destination = Path(output)
    write_atomically(destination, data)
    return destination

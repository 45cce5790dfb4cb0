"""The context binary generator's `--adapter_weight_config` step: a section per use case of an import
folder (`quiver lora import`: `use_cases.json`, `<use case>.safetensors`, `<use case>.encodings`),
written against a context built from the LoRA graph (`quiver lora create` + `quiver build --updateable`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quiver.errors import AdapterError
from quiver.formats.encodings import load_encodings, to_document
from quiver.formats.files import read_regular, read_text
from quiver.formats.writer import write_atomically
from quiver.lora.create import ALPHA_INPUT
from quiver.runtime.context import Context

_SUMMARY = "use_cases.json"
_SAFETENSORS_LIMIT = 16 << 30  # a use case's tensors: adapters of an 8B model fit many times over


def write_sections(
    context_path: Path,
    import_dir: Path,
    output: Path,
    graphs: Sequence[str] = (),
    on_step: Callable[[str], object] = lambda _: None,
) -> dict[str, list[str]]:
    """One `.qsec` per use case in `output`: its tensors set in `graphs` (default: every graph with
    updateable tensors), one section covering them, with the use case's strengths (and encodings) as
    metadata, as `quiver lora prepare` writes them. Returns {use case: [section files]}."""
    cases = _read_summary(import_dir)
    written: dict[str, list[str]] = {}
    with Context.from_binary(context_path) as context:
        targets = list(graphs) or context.updateable_graphs()
        if not targets:
            raise AdapterError(
                f"{context_path}: no graph has updateable tensors; build it with `quiver build --updateable @FILE`"
                " from the tensor-name list `quiver lora create` writes"
            )
        for name, case in cases.items():
            on_step(f"writing the section of use case {name}")
            values = _tensors(import_dir, case["tensors"], name)
            for graph in targets:  # every name, shape and type checked against the graph's updateable tensors
                context.graph(graph).update_tensors(values)
            context.finalize()
            metadata: dict[str, Any] = {
                "lora": {
                    "use_case": name,
                    "alpha_input": ALPHA_INPUT,
                    "adapters": case["adapters"],
                    "alphas": case["alphas"],
                    "active": case.get("active", [a for a, s in zip(case["adapters"], case["alphas"]) if s]),
                }
            }
            if "encodings" in case:
                metadata["encodings"] = to_document(load_encodings(_inside(import_dir, case["encodings"], name)))
            file = f"{name}.qsec"
            covers = targets[0] if len(targets) == 1 else None  # several graphs: one super section
            write_atomically(output / file, context.get_binary_section(covers, metadata))
            written[name] = [file]
    return written


def _read_summary(folder: Path) -> dict[str, dict[str, Any]]:
    """`use_cases.json`, every field checked before it is used."""
    source = folder / _SUMMARY
    try:
        raw = json.loads(read_text(source, limit=16 << 20, what="the import summary"))
    except (ValueError, RecursionError):
        raise AdapterError(f"{source}: not valid JSON; write it again with `quiver lora import`") from None
    if not isinstance(raw, dict) or not raw:
        raise AdapterError(f"{source}: must map each use case to its tensors, adapters and alphas")
    for name, case in raw.items():
        where = f"{source}: use case {name!r}"
        if not isinstance(case, dict) or not isinstance(case.get("tensors"), str):
            raise AdapterError(f'{where} must name its tensors file ("tensors": "<use case>.safetensors")')
        adapters, alphas = case.get("adapters"), case.get("alphas")
        if not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters):
            raise AdapterError(f'{where}: "adapters" must be a list of adapter names')
        if (
            not isinstance(alphas, list)
            or len(alphas) != len(adapters)
            or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in alphas)
        ):
            raise AdapterError(f'{where}: "alphas" must be one finite number per adapter')
        if "encodings" in case and not isinstance(case["encodings"], str):
            raise AdapterError(f'{where}: "encodings" must name an encodings file')
    return raw


def _inside(folder: Path, name: str, use_case: str) -> Path:
    """A file the summary names: in the import folder itself, never elsewhere."""
    path = folder / name
    if Path(name).name != name or name in ("", ".", ".."):
        raise AdapterError(f"use case {use_case!r}: {name!r} must be a file name in {folder}")
    return path


def _tensors(folder: Path, name: str, use_case: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError  # type: ignore[attr-defined,unused-ignore]  # untyped before 0.5
    from safetensors.numpy import load

    data = read_regular(_inside(folder, name, use_case), _SAFETENSORS_LIMIT, "a use case's tensors")
    try:
        return load(data)
    except (SafetensorError, ValueError) as exc:
        raise AdapterError(
            f"{folder / name}: not a valid safetensors file ({exc}); import the use case again"
        ) from None

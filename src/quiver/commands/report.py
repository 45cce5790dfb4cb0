"""What a context holds: graphs, their tensors, which weights they share, bytes stored vs. referenced."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from quiver.formats.layout import MAJOR
from quiver.formats.reader import ContextFile
from quiver.formats.section import SectionFile
from quiver.runtime.context import Context


def encoding_conflicts(file: ContextFile) -> list[dict[str, Any]]:
    """Tensors stored more than once because the same bytes are read with different encodings."""
    names: dict[int, list[str]] = defaultdict(list)
    for graph, entry in file.graphs.items():
        for tensor, index in entry.weights.items():
            names[index].append(f"{graph}:{tensor}")
    groups: dict[tuple[str, tuple[int, ...], str], list[int]] = defaultdict(list)
    for w in file.weights:
        groups[(w.dtype, w.shape, w.sha256)].append(w.index)
    return [
        {
            "bytes": file.weights[indices[0]].length,
            "copies": [{"tensors": sorted(names[i]), "encoding": file.weights[i].encoding} for i in sorted(indices)],
        }
        for indices in groups.values()
        if len(indices) > 1
    ]


def describe_context(context: Context, source: str | None = None) -> dict[str, Any]:
    """The `quiver inspect --json` document (qnn-context-binary-utility's role)."""
    file = context.file
    users: dict[int, list[str]] = defaultdict(list)
    for name, entry in file.graphs.items():
        for index in entry.weight_indices:
            users[index].append(name)
    stats = context.weight_stats()
    graphs = []
    for name in context.graph_names:
        graph = context.graph(name)
        indices = file.graphs[name].weight_indices
        shared_with: dict[str, int] = defaultdict(int)
        for index in indices:
            for other in users[index]:
                if other != name:
                    shared_with[other] += file.weights[index].length
        graphs.append(
            {
                "name": name,
                "inputs": [t.to_json() for t in graph.inputs],
                "outputs": [t.to_json() for t in graph.outputs],
                "weights": {
                    "count": len(indices),
                    "bytes": sum(file.weights[i].length for i in indices),
                    "own_bytes": sum(file.weights[i].length for i in indices if len(users[i]) == 1),
                    "shared_bytes": sum(file.weights[i].length for i in indices if len(users[i]) > 1),
                },
                "shared_with": dict(sorted(shared_with.items())),
                "updateable": list(file.graphs[name].updateable),
                "prepared_for": [form.runtime for form in file.graphs[name].prepared],  # format 1.6
            }
        )
    return {
        "path": source or file.source,
        "format_version": f"{MAJOR}.{file.minor_version}",
        "producer": file.producer,
        "size_bytes": file.size,
        "weights": {
            "unique_bytes": stats.unique_bytes,
            "referenced_bytes": stats.referenced_bytes,
            "unique_count": stats.unique_count,
            "referenced_count": stats.referenced_count,
            "saved_bytes": stats.referenced_bytes - stats.unique_bytes,
        },
        "graphs": graphs,
        "identity": file.identity,
        "tuning": [entry.to_json() for entry in file.tuning],  # tuned configurations per device tier
        "encoding_conflicts": encoding_conflicts(file),
        "tensors": [
            {
                "index": w.index,
                "dtype": w.dtype,
                "shape": list(w.shape),
                "bytes": w.length,
                "offset": w.offset,
                "graphs": sorted(users[w.index]),
            }
            for w in file.weights
        ],
    }


def describe_section(section: SectionFile, source: str) -> dict[str, Any]:
    """The metadata of a binary section (`.qsec`) as one JSON-ready dict: its context, graphs and tensors."""
    return {
        "path": source,
        "kind": "binary section",
        "format_version": f"{MAJOR}.{section.minor_version}",
        "producer": section.producer,
        "context": section.context_id,
        "metadata": section.metadata,
        "bytes": sum(w.length for w in section.weights),
        "graphs": {
            name: [
                {
                    "tensor": tensor,
                    "dtype": section.weights[index].dtype,
                    "shape": list(section.weights[index].shape),
                    "bytes": section.weights[index].length,
                }
                for tensor, index in sorted(graph.tensors.items())
            ]
            for name, graph in section.graphs.items()
        },
    }


_UNSAFE_IN_FILE_NAMES = re.compile(r"[^A-Za-z0-9._-]+")


def _raw_file_name(tensor: str, index: int, used: set[str]) -> str:
    """`<tensor>.raw` after the tensor that reads the weight (as qnn-context-binary-utility names them),
    made safe for any file system; the weight's index is added where the name alone would not do (no
    name, characters replaced, cut short, or taken by another weight)."""
    stem = _UNSAFE_IN_FILE_NAMES.sub("_", tensor).strip("._")[:120]
    if not stem or stem != tensor or stem.lower() in used:
        stem = f"{stem or 'weight'}.{index:05d}"
    used.add(stem.lower())  # case-insensitive file systems (macOS, Windows): no two names that differ by case
    return f"{stem}.raw"


def export_weights(file: ContextFile, folder: Path) -> dict[str, Any]:
    """Every stored weight of a context as a raw file in `folder` (its bytes as stored: little-endian, 4-bit
    values two to a byte), and `weights.json` indexing them: file, dtype, shape, bytes, encoding, and the
    graphs and tensor names that read it (a weight shared by graphs is written once). Returns the index."""
    from quiver.formats.writer import write_atomically  # the writer loads when weights are exported

    folder.mkdir(parents=True, exist_ok=True)
    names: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for graph, entry in file.graphs.items():
        for tensor, index in entry.weights.items():
            names[index][graph].append(tensor)
    tensors = []
    used: set[str] = set()
    for weight in file.weights:
        readers = sorted(t for tensor_names in names[weight.index].values() for t in tensor_names)
        raw = _raw_file_name(readers[0] if readers else "", weight.index, used)
        write_atomically(folder / raw, file.buffer[weight.offset : weight.offset + weight.length])
        tensors.append({
            "file": raw, "index": weight.index, "dtype": weight.dtype, "shape": list(weight.shape),
            "bytes": weight.length, "encoding": weight.encoding,
            "graphs": {graph: sorted(tensor_names) for graph, tensor_names in sorted(names[weight.index].items())},
        })  # fmt: skip
    document = {"format_version": f"{MAJOR}.{file.minor_version}", "tensors": tensors}
    write_atomically(folder / "weights.json", json.dumps(document, indent=1).encode())
    return document

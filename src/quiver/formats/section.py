"""The `.qsec` binary section: new values of a context's updateable tensors (docs/FORMAT.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiver.errors import DuplicateGraphError
from quiver.formats._layout import SECTION_MAGIC
from quiver.formats.reader import TensorFile, _fail, _int, _sha, _str
from quiver.formats.writer import TensorFileWriter, _State


@dataclass(frozen=True)
class SectionGraph:
    name: str
    tensors: dict[str, int]  # updateable tensor name -> index into the section's weights


class SectionFile(TensorFile):
    """A validated `.qsec`: the context it was made for, and per graph the tensors it replaces."""

    MAGIC = SECTION_MAGIC
    FORMAT = "qsec"
    WHAT = "binary section"
    REMEDY = "make it again with get_binary_section() or `quiver lora prepare`"

    def _parse_rest(self, header: dict[str, Any], graphs_raw: list[Any], limit: int) -> list[tuple[int, int, str]]:
        self.context_id = _sha(header.get("context"), "header.context")
        metadata = header.get("metadata", {})
        if not isinstance(metadata, dict):
            raise _fail("header.metadata must be an object")
        self.metadata: dict[str, Any] = metadata
        if not graphs_raw:
            raise _fail("a section must cover at least one graph")
        self.graphs: dict[str, SectionGraph] = {}
        for raw in graphs_raw:
            if not isinstance(raw, dict) or not isinstance(raw.get("weights"), dict):
                raise _fail("each section graph must be an object with a weights map")
            name = _str(raw.get("name"), "graph name")
            if not name or name in self.graphs:
                raise _fail(f"graph name {name!r} is empty or appears twice")
            tensors = {}
            for tensor, index in raw["weights"].items():
                if _int(index, f"graph {name!r} tensor {tensor!r}") >= len(self.weights):
                    raise _fail(f"graph {name!r} maps {tensor!r} to tensor {index}, but there are {len(self.weights)}")
                tensors[tensor] = index
            self.graphs[name] = SectionGraph(name, tensors)
        return []  # a section's only regions are its tensors


class SectionWriter(TensorFileWriter):
    """Writes a `.qsec` for the context whose identity (header SHA-256) is `context_id`."""

    MAGIC = SECTION_MAGIC
    FORMAT = "qsec"

    def __init__(
        self, context_id: str, metadata: Mapping[str, Any] | None = None, directory: str | Path | None = None
    ) -> None:
        super().__init__(directory)
        self._context_id = context_id
        self._metadata = dict(metadata or {})
        self._graphs: dict[str, dict[str, int]] = {}

    def add_graph(self, name: str, tensors: Mapping[str, int]) -> None:
        self._require(_State.WEIGHTS)
        if name in self._graphs:
            raise DuplicateGraphError(f"graph {name!r} is already in the section")
        self._check_indices(name, tensors)
        self._graphs[name] = dict(sorted(tensors.items()))

    def _header_fields(self) -> dict[str, Any]:
        return {"context": self._context_id, "metadata": self._metadata}

    def _write_graphs(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        return [{"name": name, "weights": tensors} for name, tensors in self._graphs.items()], offset

"""The `.qsec` binary section's validating reader (docs/FORMAT.md); `formats.writer.SectionWriter` writes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quiver.formats.layout import SECTION_MAGIC
from quiver.formats.reader import TensorFile, _fail, _int, _sha, _str


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

"""The optional `tuning` field of a context header (format 1.4): tuned configurations per device tier.

A tuned context is its source with a new header: the weight and graph regions are copied byte for
byte, and the header gains `tuning` plus `identity`, the source's identity, so sections made for the
source still apply (tuning changes how graphs run, never what they hold).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quiver.errors import InvalidHeaderError

TunedValue = bool | int | str
_SHA = re.compile(r"[0-9a-f]{64}")
_MAX_ENTRIES = 256
_MAX_TEXT = 4096


@dataclass(frozen=True)
class TuningEntry:
    """The configurations chosen on one device tier: per graph, knob name -> value."""

    tier: str
    fingerprint: Mapping[str, str]
    graphs: Mapping[str, Mapping[str, TunedValue]]

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "fingerprint": dict(self.fingerprint),
            "graphs": {name: {"config": dict(config)} for name, config in self.graphs.items()},
        }


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise InvalidHeaderError(f"header.tuning: {what} must be a string of at most {_MAX_TEXT} characters")
    return value


def _config(raw: Any, what: str) -> dict[str, TunedValue]:
    if not isinstance(raw, dict) or not isinstance(raw.get("config"), dict):
        raise InvalidHeaderError(f'header.tuning: {what} must be an object with a "config" object')
    config: dict[str, TunedValue] = {}
    for knob, value in raw["config"].items():
        if not isinstance(value, (bool, int, str)) or (isinstance(value, str) and len(value) > _MAX_TEXT):
            raise InvalidHeaderError(f"header.tuning: {what} knob {knob!r} must be a boolean, integer or string")
        config[_text(knob, f"{what} knob name")] = value
    return config


def parse_tuning(raw: Any, graph_names: Sequence[str]) -> tuple[TuningEntry, ...]:
    """The header's `tuning` list, checked (graphs it names must be the context's)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > _MAX_ENTRIES:
        raise InvalidHeaderError(f"header.tuning must be a list of at most {_MAX_ENTRIES} entries")
    entries = []
    for index, item in enumerate(raw):
        what = f"entry {index}"
        if not isinstance(item, dict) or not isinstance(item.get("fingerprint"), dict):
            raise InvalidHeaderError(f'header.tuning: {what} must be an object with a "fingerprint" object')
        label = f"{what} fingerprint"
        fingerprint = {_text(k, label): _text(v, label) for k, v in item["fingerprint"].items()}
        graphs_raw = item.get("graphs")
        if not isinstance(graphs_raw, dict):
            raise InvalidHeaderError(f'header.tuning: {what} must have a "graphs" object')
        unknown = sorted(set(graphs_raw) - set(graph_names))
        if unknown:
            raise InvalidHeaderError(f"header.tuning: {what} names graphs {unknown} the context does not have")
        graphs = {name: _config(config, f"{what} graph {name!r}") for name, config in graphs_raw.items()}
        entries.append(TuningEntry(_text(item.get("tier"), f"{what} tier"), fingerprint, graphs))
    return tuple(entries)


def parse_identity(raw: Any, header_sha256: str) -> str:
    """A context's identity: the header's `identity` (a tuned copy keeps its source's), else its checksum."""
    if raw is None:
        return header_sha256
    if not isinstance(raw, str) or not _SHA.fullmatch(raw):
        raise InvalidHeaderError("header.identity must be a lowercase hex SHA-256")
    return raw

"""The adapters a text-generation context can run: those its dialog config names and those added while it runs."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from quiver.errors import GenerationError
from quiver.runtime.context import Context
from quiver.runtime.sections import forget_section
from quiver.runtime.state import LoraStrengths
from quiver.t2t.config import LoraAdapterConfig


class AdapterSet:
    """Adapters by name (Genie's LoRA adapters), each with its sections; safe to change from any thread."""

    def __init__(self, context: Context, configured: Mapping[str, LoraAdapterConfig], source: object) -> None:
        self._context = context
        self._adapters = dict(configured)
        self._source = source  # where the configured ones come from, for messages
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return list(self._adapters)

    def get(self, name: str) -> LoraAdapterConfig:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise GenerationError(f"no LoRA adapter {name!r} in {self._source}; it has {self.names or 'none'}")
        return adapter

    def add(self, name: str, sections: Sequence[str | Path]) -> None:
        """Makes one more adapter usable by name (a server loads them while it runs): its sections are
        checked against the context now, every check applying them would make. Its strengths are those
        its sections' metadata name."""
        if not sections:
            raise GenerationError(f"adapter {name!r} needs at least one section (.qsec)")
        alphas: list[str] = []
        for section in sections:
            loaded = self._context.check_binary_section(None, section)
            strengths = LoraStrengths.from_metadata(loaded.metadata, str(section))
            alphas += [a for a in (strengths.active if strengths else ()) if a not in alphas]
        self._add(LoraAdapterConfig(name, tuple(alphas), tuple(Path(s) for s in sections)))

    def add_unsectioned(self, name: str) -> None:
        """An adapter its owner fills itself (a PEFT folder `quiver serve` loads): a name, no sections."""
        self._add(LoraAdapterConfig(name, (name,), ()))

    def _add(self, adapter: LoraAdapterConfig) -> None:
        with self._lock:
            if not adapter.name or adapter.name in self._adapters:
                name = adapter.name
                raise GenerationError(f"an adapter needs a new name; {name!r} is {'taken' if name else 'empty'}")
            self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Forgets an adapter added or configured (requests for it are refused from now on)."""
        with self._lock:
            removed = self._adapters.pop(name, None)
            if removed is None:
                raise GenerationError(f"no LoRA adapter {name!r}; it has {self.names or 'none'}")
            still = {p for adapter in self._adapters.values() for p in adapter.bin_sections}
        for path in removed.bin_sections:
            if path not in still:  # the verified copy of its sections goes with it
                forget_section(path)

"""Makes ORT's delegated subpackages importable by their `quiver.ort` names, e.g.
`from quiver.ort.capi.onnxruntime_pybind11_state import Fail`, as `import onnxruntime as ...` code does.

The alias is ORT's own module object, never a second copy: its native extension is loaded once and its
classes (the error classes Quiver's errors derive from) are the same objects under both names.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

PREFIX = "quiver.ort."


class DelegatedModuleAliases:
    """`quiver.ort.<delegated>[.sub...]` resolves to `onnxruntime.<delegated>[.sub...]`: a meta path finder
    and its loader, by protocol (importlib.abc's base classes cost ~8 ms to import and add nothing)."""

    def __init__(self, delegated: frozenset[str]) -> None:
        self._delegated = delegated
        self._specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if not fullname.startswith(PREFIX) or fullname[len(PREFIX) :].split(".")[0] not in self._delegated:
            return None
        # a loader by protocol (create_module, exec_module); typeshed's asks for the retired load_module too
        return importlib.util.spec_from_loader(fullname, self)  # type: ignore[arg-type]

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module("onnxruntime." + spec.name[len(PREFIX) :])
        self._specs[spec.name] = module.__spec__  # the import system overwrites it: put back in exec_module
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__  # the import system just set the alias's spec: ORT's goes back
        if alias is not None:
            module.__spec__ = self._specs.pop(alias.name, alias)


def install(delegated: frozenset[str]) -> None:
    if not any(isinstance(finder, DelegatedModuleAliases) for finder in sys.meta_path):
        sys.meta_path.insert(0, DelegatedModuleAliases(delegated))  # before the path finder: no second copy

"""Makes ORT's delegated subpackages importable by their `quiver.ort` names, e.g.
`from quiver.ort.capi.onnxruntime_pybind11_state import Fail`, as `import onnxruntime as ...` code does;
and by their own names while `sys.modules["onnxruntime"]` is `quiver.ort` (`quiver.ort.install()`), where
`import onnxruntime.quantization` would otherwise look for it inside Quiver's folder.

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

from quiver import ort_package

PREFIX = "quiver.ort."
SWAPPED_PREFIX = ort_package.NAME + "."


class DelegatedModuleAliases:
    """`quiver.ort.<delegated>[.sub...]`, and `onnxruntime.<delegated>[.sub...]` under a swap, resolve to
    ORT's own `onnxruntime.<delegated>[.sub...]`: a meta path finder and its loader, by protocol
    (importlib.abc's base classes cost time to import and add nothing)."""

    def __init__(self, delegated: frozenset[str]) -> None:
        self._delegated = delegated
        self._specs: dict[str, Any] = {}

    def _target(self, fullname: str) -> str | None:
        """The module `fullname` stands for, if this finder resolves it: ORT's own for a delegated name;
        under a swap, `onnxruntime.backend` is Quiver's (one copy, as `import quiver.ort.backend` gives)."""
        if fullname.startswith(PREFIX):
            rest = fullname[len(PREFIX) :]
        elif fullname.startswith(SWAPPED_PREFIX) and not ort_package.is_real(sys.modules.get(ort_package.NAME)):
            rest = fullname[len(SWAPPED_PREFIX) :]
            if rest.split(".")[0] == "backend":
                return PREFIX + rest
        else:
            return None
        return SWAPPED_PREFIX + rest if rest.split(".")[0] in self._delegated else None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if self._target(fullname) is None:
            return None
        # a loader by protocol (create_module, exec_module); typeshed's asks for the retired load_module too
        return importlib.util.spec_from_loader(fullname, self)  # type: ignore[arg-type]

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        target = self._target(spec.name)
        assert target is not None  # find_spec only made specs for names it resolves
        if target.startswith(PREFIX):
            module = importlib.import_module(target)
        else:
            module = ort_package.submodule(target[len(SWAPPED_PREFIX) :])
        self._specs[spec.name] = module.__spec__  # the import system overwrites it: put back in exec_module
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__  # the import system just set the alias's spec: ORT's goes back
        if alias is not None:
            module.__spec__ = self._specs.pop(alias.name, alias)


def install(delegated: frozenset[str]) -> None:
    if not any(isinstance(finder, DelegatedModuleAliases) for finder in sys.meta_path):
        sys.meta_path.insert(0, DelegatedModuleAliases(delegated))  # before the path finder: no second copy

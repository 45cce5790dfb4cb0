"""The layer order of docs/DESIGN.md is the code's: no upward import, no import cycle (type-only ones too)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

from tests.support import ROOT  # noqa: E402

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(source_root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the `quiver` package found first on the path (the installed one, or a copy)."""
    env = {"PYTHONPATH": str(source_root), "PATH": str(LINT_IMPORTS.parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    result = _lint(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_upward_import_breaks_the_layer_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "src" / "quiver", tmp_path / "quiver", ignore=shutil.ignore_patterns("__pycache__"))
    planted = tmp_path / "quiver" / "ir" / "dtypes.py"
    planted.write_text(planted.read_text() + "\nfrom quiver.runtime.context import Context  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0 and "quiver.ir.dtypes -> quiver.runtime.context" in result.stdout, result.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected sets of modules (Tarjan), iteratively: each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def test_no_import_cycle_between_modules() -> None:
    graph = grimp.build_graph("quiver")  # every import: module level, in functions, under TYPE_CHECKING
    assert _cycles(graph) == []

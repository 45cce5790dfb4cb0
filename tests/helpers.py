"""Small helpers shared by tests that look inside a loaded context."""

from __future__ import annotations

from typing import Any

import quiver


def executables(context: quiver.Context) -> dict[str, Any]:
    """The prepared backend state of each live graph, by graph name."""
    assert context._store is not None
    return {name: live.executable for name, live in context._store._live.items()}

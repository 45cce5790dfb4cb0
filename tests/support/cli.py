"""The `quiver` command line run as users run it (a real process), and its one-line errors checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def quiver(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("QUIVER_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "quiver", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("quiver: error: "), result.stderr  # not after a blank line
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]

"""The README's two commands are what CI runs, its tour runs as written, and so does every example in
the guides (`text` blocks are synopses with placeholders, not examples)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT  # noqa: E402

README = (ROOT / "README.md").read_text()
# Guides whose examples run on the public API alone; docs/t2t.md's needs an exported LLM and runs in
# tests/test_t2t_real.py
GUIDES = ["docs/python-api.md", "docs/ort.md"]
EXAMPLE_LANGUAGES = ("sh", "python")


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_second() -> None:
    first_block = _blocks(README, "sh")[0]
    assert README.index(first_block) < README.index("## ")
    demo, tests = first_block.strip().splitlines()
    assert demo.endswith("quiver demo")
    assert "'.[test]'" in tests and "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_an_entry_point_not_a_manual() -> None:
    assert len(README.splitlines()) <= 200


def test_every_code_block_of_the_readme_and_the_guides_is_an_example_or_a_synopsis() -> None:
    for path in ["README.md", *GUIDES, "docs/cli.md", "docs/t2t.md", "docs/tuning.md", "docs/lora.md", "docs/serve.md"]:
        languages = re.findall(r"^```(\w*)$", (ROOT / path).read_text(), re.M)[0::2]  # opening fences
        assert set(languages) <= {*EXAMPLE_LANGUAGES, "text"}, (path, languages)


def test_the_readme_tour_runs_as_written(tmp_path: Path) -> None:
    tour = _blocks(README, "sh")[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", tour], cwd=tmp_path, env=env, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert (tmp_path / "tour" / "family.qctx").is_file()
    assert b"quiver.ort runs it on: quiver" in result.stdout
    cwd = Path.cwd()
    os.chdir(tmp_path / "tour")  # the tour's Python runs where its commands left their files
    try:
        for block in _blocks(README, "python"):
            exec(compile(block, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(
    "guide, block",
    [(guide, block) for guide in GUIDES for block in _blocks((ROOT / guide).read_text(), "python")],
)
def test_the_guides_examples_run(guide: str, block: str) -> None:
    exec(compile(block, guide, "exec"), {})

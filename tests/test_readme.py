"""The README's two commands are what CI runs, and its Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_second() -> None:
    first_block = re.search(r"```sh\n(.*?)```", README, re.S)
    assert first_block is not None and README.index(first_block.group(0)) < README.index("## ")
    demo, tests = first_block.group(1).strip().splitlines()
    assert demo.endswith("quiver demo")
    assert "'.[test]'" in tests and "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("block", re.findall(r"```python\n(.*?)```", README, re.S))
def test_readme_python_examples_run(block: str) -> None:
    exec(compile(block, "README.md", "exec"), {})

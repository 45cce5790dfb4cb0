"""Private copies of section files: exact, and independent of the file afterwards, whichever way they are made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quiver.formats import private_copy
from quiver.formats.private_copy import read_private

_WAYS = {  # how a copy is made: each way forced, as on a machine that has no better one
    "memfd": {},
    "one read": {"_copy_into_memfd": lambda fd, size: None},
}


@pytest.mark.parametrize("size", [1, 2_000_001])
@pytest.mark.parametrize("way", list(_WAYS))
def test_a_copy_is_exact_and_outlives_the_file(
    tmp_path: Path, way: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, replacement in _WAYS[way].items():
        monkeypatch.setattr(private_copy, name, replacement)
    path = tmp_path / "s.qsec"
    path.write_bytes(os.urandom(size))
    expected = path.read_bytes()
    with open(path, "rb") as file:
        copy, count = read_private(file.fileno(), size)
    path.write_bytes(bytes(size))  # rewritten in place
    assert count == size and bytes(copy) == expected


def test_a_file_shorter_than_its_header_says_is_copied_as_far_as_it_goes(tmp_path: Path) -> None:
    path = tmp_path / "s.qsec"
    path.write_bytes(b"x" * 1000)
    with open(path, "rb") as file:
        _, count = read_private(file.fileno(), 5000)
    assert count == 1000  # the reader then refuses it as changed while read

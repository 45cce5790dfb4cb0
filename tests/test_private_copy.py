"""Private copies of section files: exact, and independent of the file afterwards, with or without memfds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quiver.formats.private_copy import read_private


@pytest.mark.parametrize("memfd", [True, False])
def test_a_copy_is_exact_and_outlives_the_file(tmp_path: Path, memfd: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not memfd:
        monkeypatch.delattr(os, "memfd_create", raising=False)  # the copy by one read, as where there is none
    path = tmp_path / "s.qsec"
    path.write_bytes(os.urandom(2_000_001))
    expected = path.read_bytes()
    with open(path, "rb") as file:
        copy, count = read_private(file.fileno(), 2_000_001)
    path.write_bytes(bytes(2_000_001))  # rewritten in place
    assert count == 2_000_001 and bytes(copy) == expected


def test_a_file_shorter_than_its_header_says_is_copied_as_far_as_it_goes(tmp_path: Path) -> None:
    path = tmp_path / "s.qsec"
    path.write_bytes(b"x" * 1000)
    with open(path, "rb") as file:
        _, count = read_private(file.fileno(), 5000)
    assert count == 1000  # the reader then refuses it as changed while read

"""GGUF files written for tests with the `gguf` package (the test extras install it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf


@contextmanager
def gguf_file(path: Path, arch: str) -> Iterator[gguf.GGUFWriter]:
    """A writer of an `arch` file at `path`: what it was given (metadata, tensors) is written when the block ends."""
    writer = gguf.GGUFWriter(str(path), arch)
    yield writer
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

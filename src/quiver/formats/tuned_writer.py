"""Writes a context with a new tuning: the regions copied unchanged, the header replaced (formats/tuned.py
reads and checks the tuning)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from quiver.formats.layout import MAGIC, MAJOR, MINOR, Preamble
from quiver.formats.reader import ContextFile
from quiver.formats.tuned import TuningEntry
from quiver.formats.writer import publish, temporary_file


def write_tuned(
    source: ContextFile,
    destination: str | Path,
    entries: Sequence[TuningEntry],
) -> Path:
    """Writes `source` with `entries` as its tuning (replacing what it had), atomically, to `destination`.

    The regions before the header are copied unchanged; the header is the source's, with `tuning` and
    `identity` set. `destination` may be the source's own path: the file is replaced, never rewritten,
    and only by a file that reads back (a tuning the reader refuses is an error here, not in `run`).
    """
    destination = Path(destination).resolve()
    header = json.loads(bytes(source.buffer[source.header_offset :]).decode("utf-8"))
    header["identity"] = source.identity
    header["tuning"] = [entry.to_json() for entry in entries]
    if not entries:
        del header["tuning"]
    data = json.dumps(header, separators=(",", ":")).encode()
    offset = source.header_offset
    flags = source.flags  # the regions are the source's, deflated or not
    preamble = Preamble(MAJOR, MINOR, flags, offset, len(data), offset + len(data), hashlib.sha256(data).digest())
    fd, tmp = temporary_file(destination.name, destination.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(b"\0" * len(preamble.pack()))  # the preamble goes last: until then the file is not whole
            out.write(source.buffer[len(preamble.pack()) : offset])
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
            out.seek(0)
            out.write(preamble.pack(MAGIC))
            out.flush()
            os.fsync(out.fileno())
        with ContextFile.open(tmp):  # read back, every check made, before it replaces anything
            pass
        publish(Path(tmp), destination)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return destination

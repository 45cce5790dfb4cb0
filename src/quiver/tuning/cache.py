"""The performance cache: tuning results per device tier, one JSON file each, shared by concurrent tuners.

`DIR/<tier>.json` holds the fingerprint of the device it was measured on and one record per graph
variant key (graph content, input shapes, knob space). Writers take `DIR/<tier>.lock` (an exclusive
`flock`), re-read the file, merge their records and replace it atomically, so two tuners at once lose
nothing and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from quiver import portable
from quiver.backends.cpu import tuned_value_problem
from quiver.errors import QuiverError, TuningError
from quiver.formats.files import read_text
from quiver.formats.writer import write_text_atomically
from quiver.runtime.tuned import differences

FORMAT = "quiver-performance-cache"
VERSION = 1


def tier_name(fingerprint: Mapping[str, str]) -> str:
    """A file name for a device tier: readable (backend, processor, cores) plus a hash of every field, so a
    different runtime build or processor gets its own file."""
    digest = hashlib.sha256(json.dumps(dict(fingerprint), sort_keys=True).encode()).hexdigest()[:10]
    cpu = re.sub(r"[^a-z0-9]+", "-", str(fingerprint.get("cpu", "")).lower()).strip("-")[:40] or "unknown"
    backend = re.sub(r"[^a-z0-9]+", "-", str(fingerprint.get("backend", "backend")).lower())[:16]
    cores = re.sub(r"[^0-9]+", "", str(fingerprint.get("cores", "")))[:6] or "?"  # a file name: no path parts
    return f"{backend}-{cpu}-{cores}c-{digest}"


def _cores(fingerprint: Mapping[str, str]) -> int | None:
    cores = str(fingerprint.get("cores", ""))
    return int(cores) if cores.isdigit() and 0 < int(cores) <= 1 << 16 else None


def _is_ms(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9


def record_problem(record: object, cores: int | None) -> str | None:
    """What is wrong with a cache record of the cpu backend (field, value, what it must be), or None."""
    if not isinstance(record, dict):
        return "it is not a JSON object"
    config, changed = record.get("config"), record.get("changed", {})
    if not isinstance(config, dict):
        return "'config' must be an object of knob values"
    for name, value in config.items():
        problem = tuned_value_problem(str(name), value, cores)
        if problem:
            return f"config: {problem}"
    if not isinstance(changed, dict) or any(config.get(k, object()) != v for k, v in changed.items()):
        return "'changed' must be an object of values the config holds"
    for name in ("default_ms", "tuned_ms"):
        if not _is_ms(record.get(name)):
            return f"{name!r} must be a duration in milliseconds, not {str(record.get(name))[:40]}"
    return None


class PerformanceCache:
    """One device tier's file in `directory` (created if missing; emptied first when `invalidate`)."""

    def __init__(self, directory: str | Path, fingerprint: Mapping[str, str], invalidate: bool = False) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TuningError(f"cannot create the performance cache folder {self.directory}: {exc.strerror}") from None
        self.fingerprint = dict(fingerprint)
        self.tier = tier_name(fingerprint)
        self.path = self.directory / f"{self.tier}.json"
        self.notes: list[str] = []  # what happened to the file on open (rebuilt, and why)
        with self._locked():
            if invalidate and self.path.exists():
                self.path.unlink()
                self.notes.append(f"{self.path.name}: invalidated, measuring again")
            self._records = self._read()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = self.directory / f"{self.tier}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise TuningError(f"cannot lock the performance cache {lock}: {exc.strerror}") from None
        try:
            portable.lock_file(fd)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read(self) -> dict[str, dict[str, Any]]:
        """The file's records, each checked; none when it is missing or was made on another device (it is
        rebuilt). A damaged record is an error that names the file, the record and the field."""
        if not self.path.exists() and not self.path.is_symlink():
            return {}
        try:
            text = read_text(self.path, limit=256 << 20, what="performance cache")  # never a FIFO or device
        except QuiverError as exc:
            raise TuningError(f"cannot read the performance cache ({exc}); delete it") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise TuningError(
                f"the performance cache {self.path} is damaged ({exc}); delete it or pass "
                "--invalidate-performance-cache"
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("records"), dict):
            raise TuningError(
                f"{self.path} is not a Quiver performance cache; delete it or pass --invalidate-performance-cache"
            )
        stored = data.get("fingerprint")
        if data.get("version") != VERSION or stored != self.fingerprint:
            changed = differences(stored, self.fingerprint) if isinstance(stored, dict) else ["its format"]
            self.notes.append(f"{self.path.name} was made on another device ({'; '.join(changed)}): rebuilding it")
            return {}
        cores = _cores(self.fingerprint)
        for key, record in data["records"].items():
            problem = record_problem(record, cores) if self.fingerprint.get("backend") == "cpu" else None
            problem = problem or (None if isinstance(record, dict) else "it is not a JSON object")
            if problem:
                raise TuningError(
                    f"the performance cache {self.path} has a bad record {str(key)[:16]}...: {problem}; delete the "
                    "file or pass --invalidate-performance-cache"
                )
        return dict(data["records"])

    def lookup(self, key: str) -> dict[str, Any] | None:
        return self._records.get(key)

    def store(self, key: str, record: Mapping[str, Any]) -> None:
        """Adds a record: merged under the lock with what other tuners wrote meanwhile, replaced atomically."""
        with self._locked():
            merged = self._read()
            merged[key] = dict(record)
            content = {"format": FORMAT, "version": VERSION, "tier": self.tier, "fingerprint": self.fingerprint}
            text = json.dumps({**content, "records": merged}, indent=1, sort_keys=True)
            try:
                write_text_atomically(self.path, text)
            except OSError as exc:
                raise TuningError(f"cannot write the performance cache {self.path}: {exc.strerror}") from None
            self._records = merged

    def __len__(self) -> int:
        return len(self._records)

"""Opening input files safely: regular files only (never a FIFO, a device or a folder), reads bounded."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from quiver.errors import FileAccessError

OFF_VALUES = frozenset({"0", "off", "false", "no"})  # what turns a folder setting off


def user_cache_folder(name: str) -> Path:
    """Quiver's folder `name` in the user's cache: $XDG_CACHE_HOME/quiver/NAME, else ~/.cache/quiver/NAME."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quiver" / name


def cache_folder_setting(variable: str, name: str) -> Path | None:
    """The folder an environment variable names (`off`, `0`, `false` or `no`: None), else `user_cache_folder(name)`."""
    value = os.environ.get(variable, "")
    if value.strip().lower() in OFF_VALUES:
        return None
    return Path(value) if value else user_cache_folder(name)


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for reading, refused unless it is a regular file.

    Opened non-blocking first: opening a FIFO for reading would otherwise wait for a writer forever,
    and `/dev/zero` would be read until memory runs out.
    """
    if "\0" in str(path):
        raise FileAccessError(f"{str(path)!r} is not a valid path (it holds a NUL byte)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}; check the path") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise FileAccessError(f"cannot read {path}: it is {kind}; give the path of a file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, limit: int | None = None, what: str = "file") -> bytes:
    """The bytes of a regular file, refused (not read) when it is larger than `limit`."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if limit is not None and size > limit:
            raise FileAccessError(f"{path}: {size} bytes is more than a {what} can be ({limit}); check the path")
        try:
            return handle.read()
        except OSError as exc:
            raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_text(path: str | Path, limit: int = 64 * 1024 * 1024, what: str = "text file") -> str:
    """A regular UTF-8 text file (configs, lists), refused when larger than `limit` or not UTF-8."""
    data = read_regular(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileAccessError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); check the path") from None

"""What a graph checks of the arrays a run is given: feeds against its inputs, buffers against its outputs."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from quiver.errors import FeedDTypeError, FeedNameError, FeedShapeError
from quiver.ir.tensors import TensorInfo


def validate_feeds(
    graph_name: str,
    inputs: tuple[TensorInfo, ...],
    feeds: Mapping[str, object],
    checked: dict[str, tuple[np.ndarray, tuple[int, ...]]] | None = None,
) -> dict[str, np.ndarray]:
    """Checks names, dtypes and shapes against the graph's inputs; returns the feeds as arrays.

    `checked` remembers arrays that passed (kept alive, so identities stay theirs): the same array fed
    again with the same shape is not checked again (a KV cache fed at every step of a generation).
    """
    expected = {i.name: i for i in inputs}
    if feeds.keys() != expected.keys():
        unknown = sorted(set(feeds) - set(expected))
        missing = sorted(set(expected) - set(feeds))
        parts = ([f"unknown {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else [])
        raise FeedNameError(f"graph {graph_name!r}: feeds {', '.join(parts)}; its inputs are {sorted(expected)}")
    arrays = {}
    for name, value in feeds.items():
        known = checked.get(name) if checked is not None else None
        if known is not None and known[0] is value and known[1] == value.shape:  # type: ignore[attr-defined]
            arrays[name] = known[0]
            continue
        info = expected[name]
        array = np.asarray(value)
        if info.dtype == "string" and array.dtype.kind in "UOSV":
            array = _as_strings(array)
        if array.dtype != info.numpy_dtype:
            raise FeedDTypeError(
                f"graph {graph_name!r}: input {name!r} expects {info.dtype}, got {array.dtype}; "
                f"convert it with .astype(np.{info.numpy_dtype.name})"
            )
        if info.shape is not None:
            fits = len(info.shape) == array.ndim and all(
                not isinstance(dim, int) or dim == actual for dim, actual in zip(info.shape, array.shape)
            )
            if not fits:
                raise FeedShapeError(
                    f"graph {graph_name!r}: input {name!r} expects shape {list(info.shape)}, got {list(array.shape)}"
                )
        arrays[name] = array
        if checked is not None and array is value and array.nbytes >= _REMEMBERED_BYTES:
            checked[name] = (array, array.shape)
    return arrays


def _as_strings(array: np.ndarray) -> np.ndarray:
    """Strings as ORT takes them: str and object arrays as they are; bytes (`S`) and raw bytes (`V`, NULs
    and all) decoded as UTF-8."""
    if array.dtype.kind not in "SV":
        return array.astype(object)
    items = [bytes(item).decode("utf-8") for item in array.ravel()]
    return np.array(items, dtype=object).reshape(array.shape)


_REMEMBERED_BYTES = 4096  # smaller feeds (token ids, positions) are new arrays each run anyway


def validate_outputs(graph_name: str, outputs: tuple[TensorInfo, ...], out: Mapping[str, np.ndarray]) -> None:
    """Output buffers must be writable, C-contiguous numpy arrays of the output's dtype and shape: its fixed
    dimensions as they are, a named one (a batch) of any size the run's feeds then give it (ORT checks)."""
    expected = {o.name: o for o in outputs}
    for name, array in out.items():
        info = expected.get(name)
        if info is None:
            raise FeedNameError(f"graph {graph_name!r} has no output {name!r}; its outputs are {sorted(expected)}")
        if not isinstance(array, np.ndarray) or not array.flags.writeable or not array.flags.c_contiguous:
            raise FeedDTypeError(f"graph {graph_name!r}: the buffer for {name!r} must be a writable C-contiguous array")
        if array.dtype != info.numpy_dtype:
            raise FeedDTypeError(f"graph {graph_name!r}: output {name!r} is {info.dtype}; its buffer is {array.dtype}")
        fits = (
            info.shape is not None
            and len(info.shape) == array.ndim
            and all(not isinstance(d, int) or d == n for d, n in zip(info.shape, array.shape))
        )
        if not fits:
            raise FeedShapeError(
                f"graph {graph_name!r}: output {name!r} has shape {list(info.shape or [])}; its buffer is "
                f"{list(array.shape)} (buffers are for outputs of a known rank and fixed dimensions)"
            )

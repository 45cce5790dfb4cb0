"""qnn-net-run style I/O: input lists of raw/.npy files in, `Result_<i>/<output>.raw` out."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from quiver.errors import FileAccessError, InputListError
from quiver.formats.files import read_text
from quiver.formats.writer import write_atomically
from quiver.ir.tensors import TensorInfo
from quiver.runtime.graph import Graph


def _resolve(path_text: str, list_folder: Path) -> Path:
    path = Path(path_text)
    if not path.is_absolute() and not path.exists():
        path = list_folder / path
    if not path.is_file():
        raise InputListError(
            f"input file {path_text!r} not found (looked relative to the working folder and the list's)"
        )
    return path


def _read_tensor(path: Path, info: TensorInfo, shape_hint: Sequence[int] | None = None) -> np.ndarray:
    if path.suffix == ".npy":
        try:  # mapped first: a header claiming more data than the file holds fails here, allocating nothing
            return np.array(np.load(path, mmap_mode="r", allow_pickle=False))
        except (ValueError, OSError, TypeError, OverflowError) as exc:
            raise InputListError(f"{path} is not a readable .npy file ({exc})") from None
    dtype = info.numpy_dtype.newbyteorder("<")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise InputListError(f"{path}: {size} bytes is not a whole number of {info.dtype} values")
    count = size // dtype.itemsize
    shape = list(shape_hint or info.shape or [count])
    unknown = [i for i, d in enumerate(shape) if not isinstance(d, int)]
    known = math.prod(d for d in shape if isinstance(d, int))
    if len(unknown) == 1 and known and count % known == 0:
        shape[unknown[0]] = count // known  # one dynamic dim: implied by the file size
    elif unknown:
        raise InputListError(
            f"input {info.name!r} has dynamic shape {list(info.shape or [])}; a raw file cannot say its shape: "
            "give it with --input-shape, use a .npy file, or fix the shape at build time"
        )
    dims = [int(d) for d in shape if isinstance(d, int)]  # every dim is known here
    if math.prod(dims) != count:
        raise InputListError(f"{path}: {count} {info.dtype} values do not fit input {info.name!r} of shape {shape}")
    return np.fromfile(path, dtype=dtype).reshape(dims).astype(info.numpy_dtype, copy=False)


def parse_input_list(
    list_path: str | Path,
    graph: Graph | Sequence[TensorInfo],
    shapes: Mapping[str, Sequence[int]] | None = None,
    optional: Sequence[TensorInfo] = (),
) -> list[dict[str, np.ndarray]]:
    """One feed dict per line: `name:=path name2:=path2` or, for one-input graphs, just `path`.

    `graph` is the graph the feeds are for, or just its inputs. Lines starting with `#` are comments
    (qnn-net-run's output-name line included). `shapes` gives the shape of raw files for inputs whose
    shape is dynamic. `optional` inputs may be named in a line and need not be.
    """
    shapes = shapes or {}
    list_path = Path(list_path)
    try:
        lines = read_text(list_path, what="input list").splitlines()
    except FileAccessError as exc:
        raise InputListError(f"cannot read the input list: {exc}") from None
    inputs = {i.name: i for i in (graph.inputs if isinstance(graph, Graph) else graph)}
    accepted = {**{i.name: i for i in optional}, **inputs}  # `optional`: may be given, need not be (named)
    unknown = sorted(set(shapes) - set(accepted))
    if unknown:
        raise InputListError(
            f"shapes given for {unknown} (--input-shape), which are not inputs; the inputs are {sorted(inputs)}"
        )
    feeds = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        feed: dict[str, np.ndarray] = {}
        for token in line.split():
            name, sep, path_text = token.partition(":=")
            if not sep:
                if len(inputs) != 1:
                    raise InputListError(
                        f"{list_path}:{number}: write `name:=path` for each of the inputs {sorted(inputs)}"
                    )
                name, path_text = next(iter(inputs)), token
            if name not in accepted:
                raise InputListError(
                    f"{list_path}:{number}: {name!r} is not an input; the inputs are {sorted(accepted)}"
                )
            feed[name] = _read_tensor(_resolve(path_text, list_path.parent), accepted[name], shapes.get(name))
        feeds.append(feed)
    if not feeds:
        raise InputListError(f"{list_path} lists no inputs")
    return feeds


def output_file_stem(name: str) -> str:
    """Output names may hold characters that paths cannot: qnn-net-run replaces them with `_`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def run_input_list(
    graph: Graph,
    list_path: str | Path,
    output_dir: str | Path,
    npy: bool = False,
    shapes: Mapping[str, Sequence[int]] | None = None,
    on_result: Callable[[int, int], object] | None = None,
) -> list[Path]:
    """Executes the graph for each line of the list; writes `Result_<i>/<output>.raw` (and `.npy`).

    `on_result(done, total)` is called after each result (for progress bars).
    """
    output_dir = Path(output_dir)
    written = []
    feeds = parse_input_list(list_path, graph, shapes)
    for index, feed in enumerate(feeds):
        result_dir = output_dir / f"Result_{index}"
        result_dir.mkdir(parents=True, exist_ok=True)
        for name, value in graph.execute(feed).items():
            raw = result_dir / f"{output_file_stem(name)}.raw"
            little_endian = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<"), copy=False)
            write_atomically(raw, little_endian.tobytes())  # replaced, never rewritten: a reader sees old or new
            written.append(raw)
            if npy:
                buffer = io.BytesIO()
                np.save(buffer, value)
                write_atomically(result_dir / f"{output_file_stem(name)}.npy", buffer.getbuffer())
        if on_result is not None:
            on_result(index + 1, len(feeds))
    return written

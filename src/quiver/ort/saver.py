"""QNN Saver's role in `quiver.ort`: a session's graph and each run's inputs and outputs, recorded in a folder.

`backend_type: saver` (or `qnn_saver_path`) makes a session record instead of only run: QNN's Saver
writes the API calls it sees as C source to replay on a device; here the session's model is ONNX already,
so the log is the model and its runs, which any ONNX Runtime replays. Layout, one folder per session
under the saver path (`session-<time>-<pid>-<n>`): `model.onnx` (the model as given; external data stays
where the source names it), `session.json` (source path, provider options), and per run
`run-<n>.inputs.npz` / `run-<n>.outputs.npz`. Every file is written whole, then renamed into place.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from quiver.formats.writer import write_atomically

_SESSIONS = itertools.count()


class SaverLog:
    """The record of one session: its model, then each run as it happens (safe from any thread)."""

    def __init__(self, root: str | Path, model: bytes, source: str | None, options: Mapping[str, str]) -> None:
        self.folder = Path(root) / f"session-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_SESSIONS)}"
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomically(self.folder / "model.onnx", model)
        about = {"source": source, "provider_options": dict(options)}
        write_atomically(self.folder / "session.json", json.dumps(about, indent=1).encode())
        self._runs = itertools.count()
        self._lock = threading.Lock()

    def record(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        with self._lock:
            run = next(self._runs)
        for kind, arrays in (("inputs", inputs), ("outputs", outputs)):
            buffer = io.BytesIO()
            named = {name: np.asarray(value) for name, value in arrays.items()}
            np.savez(buffer, **named)  # type: ignore[arg-type]  # numpy's stubs type **kwds as allow_pickle's bool
            write_atomically(self.folder / f"run-{run:06d}.{kind}.npz", buffer.getvalue())


def recorded_runs(folder: str | Path) -> Iterator[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """A session's recorded runs, in order: (inputs, outputs) of each, to replay on its `model.onnx`."""
    for inputs in sorted(Path(folder).glob("run-*.inputs.npz")):
        outputs = inputs.with_name(inputs.name.replace(".inputs.", ".outputs."))
        with np.load(inputs) as fed, np.load(outputs) as got:
            yield dict(fed), dict(got)

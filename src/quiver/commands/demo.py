"""`quiver demo`: a base model and two fine-tunes, built into one context, run and checked against ONNX Runtime."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from quiver.ort_package import onnxruntime as ort
from quiver.runtime.context import Context
from quiver.testing.family import TransformerShape, make_family, sample_input_ids

DEMO_SHAPE = TransformerShape(vocab=2000, hidden=256, heads=4, ffn=1024, layers=4, max_positions=128)
TOLERANCE = 1e-4


@dataclass(frozen=True)
class DemoRow:
    graph: str
    separate_bytes: int  # the graph's own .onnx file
    load_ms: float  # Context.from_binary (shared by all graphs; same for every row)
    first_output_ms: float  # first execute: prepares the graph, then runs it
    latency_ms: float  # median of later executes
    ort_latency_ms: float  # plain ONNX Runtime on the source model, same input
    max_abs_diff: float

    @property
    def matches(self) -> bool:
        return self.max_abs_diff <= TOLERANCE


@dataclass(frozen=True)
class DemoResult:
    rows: list[DemoRow]
    context_bytes: int
    unique_weight_bytes: int
    path: Path | None  # None: made in a temporary folder, removed again (pass a workdir to keep it)

    @property
    def separate_bytes(self) -> int:
        return sum(r.separate_bytes for r in self.rows)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def run_demo(
    workdir: str | Path | None = None,
    shape: TransformerShape = DEMO_SHAPE,
    repeats: int = 30,
    on_step: Callable[[str], None] = lambda _: None,
) -> DemoResult:
    """Builds the demo family into one context, runs every graph on the cpu backend and checks it against ORT.

    Without a workdir everything is made in a temporary folder that is removed before returning.
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="quiver-demo-") as temporary:
            result = run_demo(temporary, shape, repeats, on_step)
        return dataclasses.replace(result, path=None)
    folder = Path(workdir)
    folder.mkdir(parents=True, exist_ok=True)
    on_step("making a base model and two fine-tunes")
    family = make_family(shape, count=3, tuned_layers=1)
    paths = {}
    for name, model in family.items():
        paths[name] = folder / f"{name}.onnx"
        onnx.save(model, str(paths[name]))
    on_step("building one context")
    context = Context.create("cpu", workdir=folder)
    for name, path in paths.items():
        context.add_graph(name, path)
    qctx = context.save(folder / "family.qctx")
    stats = context.weight_stats()
    context.close()

    ids = sample_input_ids(shape, batch=1, seq=32)
    start = time.perf_counter()
    loaded = Context.from_binary(qctx, backend="cpu")
    load_ms = (time.perf_counter() - start) * 1e3
    rows = []
    for name, path in paths.items():
        on_step(f"running {name}")
        graph = loaded.graph(name)
        start = time.perf_counter()
        ours = graph.execute({"input_ids": ids})["last_hidden_state"]
        first_ms = (time.perf_counter() - start) * 1e3
        loaded.wait_until_ready()  # steady state: the background weight packing is done
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        theirs = session.run(None, {"input_ids": ids})[0]
        rows.append(
            DemoRow(
                graph=name,
                separate_bytes=path.stat().st_size,
                load_ms=load_ms,
                first_output_ms=first_ms,
                latency_ms=_median_ms(lambda g=graph: g.execute({"input_ids": ids}), repeats),  # type: ignore[misc]
                ort_latency_ms=_median_ms(lambda s=session: s.run(None, {"input_ids": ids}), repeats),  # type: ignore[misc]
                max_abs_diff=float(np.abs(ours - theirs).max()),
            )
        )
    loaded.close()
    return DemoResult(rows, qctx.stat().st_size, stats.unique_bytes, qctx)

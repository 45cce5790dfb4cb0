"""Concurrency stress: runs (and bound runs) racing section/strength switches, per-run adapters, eviction, fork.

Short runs are part of the tests (tests/test_concurrency.py); a long run on demand:

    python -m tests.stress.concurrency --seconds 60

prints one JSON object; every count of invalid outputs or failures must be 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import quiver
from quiver.lora.prepare import prepare
from quiver.ort.epcontext import wrap_context
from quiver.testing.family import SMALL, make_family, sample_input_ids

X = np.random.default_rng(11).standard_normal((4, 16)).astype(np.float32)
# Use cases whose strengths for one adapter differ ("strong"): a run mixing one state's tensors with
# another's strengths gives an output no valid state gives.
USE_CASES = ("base", "elementary", "elementary_long", "strong", "elementary")
YAML_EXTRA = """- name: strong
  adapter_names: [elementary, long]
  adapter_alphas: [2.0, 1.0]
"""
LONG_STRENGTHS = (1.5, 2.0)  # what the switcher sets for "long" in the elementary_long use case


@dataclass(frozen=True)
class LoraProject:
    folder: Path  # lora.qctx, <use case>.qsec, model_ctx.onnx (EPContext over lora.qctx)

    @property
    def context(self) -> Path:
        return self.folder / "lora.qctx"

    def section(self, use_case: str) -> Path:
        return self.folder / f"{use_case}.qsec"


def make_lora_project(root: Path) -> LoraProject:
    """The LoRA test project (a base, two PEFT adapters, three use cases), prepared and wrapped for ORT."""
    from tests.support.peft_models import make_project

    root.mkdir(parents=True, exist_ok=True)
    project = make_project(root)
    (project / "lora.yaml").write_text((project / "lora.yaml").read_text() + YAML_EXTRA)
    out = root / "out"
    prepare(project / "lora.yaml", out)
    wrap_context(out / "lora.qctx", out)
    return LoraProject(out)


def valid_outputs(project: LoraProject) -> dict[str, np.ndarray]:
    """Every state the switcher can leave the graph in, run one at a time: the only outputs allowed."""
    with quiver.Context.from_binary(project.context) as context:
        graph = context.graph("model")
        outputs = {}
        for use_case in ["strong", *USE_CASES[:3]]:
            context.apply_binary_section("model", project.section(use_case))
            outputs[use_case] = graph.execute({"x": X})["y"]
        for value in LONG_STRENGTHS:
            graph.set_lora_strength("long", value)
            outputs[f"elementary_long/long={value}"] = graph.execute({"x": X})["y"]
    return outputs


def _matches(output: np.ndarray, valid: dict[str, np.ndarray]) -> str | None:
    return next((name for name, expected in valid.items() if np.allclose(output, expected, rtol=1e-5, atol=1e-5)), None)


def _race(seconds: float, workers: list[Callable[[], None]], switcher: Callable[[], None]) -> None:
    """Workers and the switcher, each in its own thread, looping until the time is up. Threads switch
    every 10 µs (Python's default: 5 ms), so reads a few statements apart can straddle a change."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        _loop_until(time.monotonic() + seconds, [*workers, switcher])
    finally:
        sys.setswitchinterval(interval)


def _loop_until(stop: float, steps: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def loop(step: Callable[[], None]) -> None:
        try:
            while time.monotonic() < stop:
                step()
        except BaseException as exc:  # reported by the caller's counts
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(step,)) for step in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def switching_sections(project: LoraProject, seconds: float, threads: int = 4, bound: bool = False) -> dict[str, Any]:
    """`threads` runs executing while one more switches sections and strengths: every output must be
    one of the valid states'. `bound`: each thread runs a binding of its own (`Graph.bind`)."""
    valid = valid_outputs(project)
    seen: dict[str, int] = {}
    invalid = 0
    lock = threading.Lock()
    with quiver.Context.from_binary(project.context) as context:
        graph = context.graph("model")
        context.apply_binary_section("model", project.section("base"))
        switches = itertools.cycle([*USE_CASES[:3], *(f"long={v}" for v in LONG_STRENGTHS), *USE_CASES[3:]])

        def worker() -> Callable[[], None]:
            outputs = graph.bind({"x": X.copy()}, {}).run if bound else lambda: graph.execute({"x": X})

            def run() -> None:
                nonlocal invalid
                match = _matches(outputs()["y"], valid)
                with lock:
                    if match is None:
                        invalid += 1
                    else:
                        seen[match] = seen.get(match, 0) + 1

            return run

        def switch() -> None:
            time.sleep(0.0002)  # runs get the interpreter between switches
            step = next(switches)
            if step.startswith("long="):
                if graph.lora_strengths.get("long"):  # only the elementary_long use case holds "long"
                    graph.set_lora_strength("long", float(step.removeprefix("long=")))
            else:
                context.apply_binary_section("model", project.section(step))

        _race(seconds, [worker() for _ in range(threads)], switch)
    return {"runs": sum(seen.values()) + invalid, "invalid": invalid, "states_seen": len(seen)}


def per_run_adapters(project: LoraProject, seconds: float, threads: int = 4) -> dict[str, Any]:
    """`quiver.ort` sessions sharing one context, each thread running with its own per-run adapter (and
    one without): every output must be its own adapter's."""
    valid = valid_outputs(project)
    options = quiver.ort.SessionOptions()
    options.add_session_config_entry("ep.share_ep_contexts", "1")
    model = str(project.folder / "model_ctx.onnx")
    sessions = [quiver.ort.InferenceSession(model, options) for _ in range(2)]
    plans = []
    for index in range(threads):
        use_case = USE_CASES[index % len(USE_CASES)]
        run_options = quiver.ort.RunOptions()
        if use_case != "base":
            adapter = quiver.ort.LoraAdapter()
            adapter.Load(str(project.section(use_case)))
            run_options.add_active_adapter(adapter)
        plans.append((sessions[index % 2], run_options if use_case != "base" else None, use_case))
    wrong = runs = 0
    lock = threading.Lock()

    def worker(session: Any, run_options: Any, use_case: str) -> Callable[[], None]:
        def run() -> None:
            nonlocal wrong, runs
            output = session.run(None, {"x": X}, run_options)[0]
            ok = np.allclose(output, valid[use_case], rtol=1e-5, atol=1e-5)
            with lock:
                runs += 1
                wrong += not ok

        return run

    def idle() -> None:
        time.sleep(0.01)

    _race(seconds, [worker(*plan) for plan in plans], idle)
    for session in sessions:
        session.close()
    return {"runs": runs, "wrong_adapter": wrong}


def eviction(context_path: Path, seconds: float, threads: int = 4) -> dict[str, Any]:
    """Threads running every graph of a family context under a memory hint that fits one graph: graphs
    are evicted and prepared again all the time; no run may fail."""
    ids = sample_input_ids(SMALL, 1, 8, seed=3)
    failures: list[str] = []
    runs = 0
    lock = threading.Lock()
    with quiver.Context.from_binary(context_path, memory_limit_hint_mb=0.001) as context:
        names = context.graph_names
        expected = {name: context.graph(name).execute({"input_ids": ids}) for name in names}

        def worker(offset: int) -> Callable[[], None]:
            order = itertools.cycle(names[offset:] + names[:offset])

            def run() -> None:
                nonlocal runs
                name = next(order)
                try:
                    output = context.graph(name).execute({"input_ids": ids})
                    ok = all(np.allclose(output[k], v, rtol=1e-4, atol=1e-4) for k, v in expected[name].items())
                    problem = None if ok else f"{name}: wrong output"
                except Exception as exc:  # counted: the point is that there are none
                    problem = f"{name}: {type(exc).__name__}: {exc}"
                with lock:
                    runs += 1
                    if problem:
                        failures.append(problem)

            return run

        def release() -> None:
            time.sleep(0.005)
            context.release_graph(names[0])

        _race(seconds, [worker(i) for i in range(threads)], release)
    return {"runs": runs, "failures": len(failures), "first_failures": failures[:3]}


# A server process: it loads and executes (packing starts in the background), then forks a worker that
# runs every graph and ends the way gunicorn's workers do: sys.exit, with the interpreter's shutdown
# (atexit, finalizers, joining threads).
FORK_DELAYS = (0.0, 0.001, 0.002, 0.003, 0.005, 0.008, 0.013, 0.021)  # seconds after the first run

_FORKING_SERVER = """
import os, sys, time, numpy as np, quiver
from quiver.testing.family import SMALL, sample_input_ids
ids = {"input_ids": sample_input_ids(SMALL, 1, 8, seed=4)}
with quiver.Context.from_binary(sys.argv[1]) as reference:
    expected = {name: reference.graph(name).execute(ids) for name in reference.graph_names}

def all_match(context):
    return all(
        np.allclose(context.graph(name).execute(ids)[k], v, rtol=1e-4, atol=1e-4)
        for name, outputs in expected.items() for k, v in outputs.items()
    )

for delay in map(float, sys.argv[2:]):
    context = quiver.Context.from_binary(sys.argv[1])
    context.graph(context.graph_names[0]).execute(ids)  # starts packing in the background
    time.sleep(delay)
    pid = os.fork()
    if pid == 0:
        print("child", "ok" if all_match(context) else "wrong", flush=True)
        sys.exit(0)  # the context left open: the child's exit closes it
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
    print("parent", "ok" if all_match(context) else "wrong", flush=True)
    context.close()
"""


def fork_after_execute(context_path: Path, timeout: float = 120.0) -> dict[str, Any]:
    """A server process executes a context (its packing thread still running), then forks, at several
    moments of that packing: each child runs every graph and exits normally, and the parent goes on."""
    server = subprocess.Popen(
        [sys.executable, "-c", _FORKING_SERVER, str(context_path), *map(str, FORK_DELAYS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a hung child is killed with it
    )
    try:
        stdout, stderr = server.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        stdout, _ = server.communicate()
        return {"hung": True, "output": stdout}
    lines = stdout.splitlines()
    return {
        "hung": False,
        "forks": sum(line.startswith("child exit") for line in lines),
        "children_ok": lines.count("child ok"),
        "child_exits": sorted({int(line.split()[-1]) for line in lines if line.startswith("child exit")}),
        "parents_ok": lines.count("parent ok"),
        "stderr": stderr[-2000:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per scenario")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        project = make_lora_project(Path(folder) / "lora")
        family = quiver.Context.create("cpu", workdir=folder)
        for name, model in make_family(SMALL).items():
            family.add_graph(name, model)
        family_path = family.save(Path(folder) / "family.qctx")
        family.close()
        report = {
            "seconds": args.seconds,
            "switching_sections": switching_sections(project, args.seconds),
            "switching_sections_bound_runs": switching_sections(project, args.seconds, bound=True),
            "per_run_adapters": per_run_adapters(project, args.seconds),
            "eviction": eviction(family_path, args.seconds),
            "fork_after_execute": fork_after_execute(family_path),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

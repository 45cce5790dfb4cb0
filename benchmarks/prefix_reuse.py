"""Prefix reuse in `quiver serve`: time to the first token of a 1,000-token prompt, of the same prompt
again, of one sharing its first 900 tokens, and of each turn of a 10-turn chat (whose history grows by
the turns before), with the prefix cache on and off (`--prefix-cache-mb 0`), in the same rounds.

    python benchmarks/run.py --only prefix_reuse

SmolLM2-135M-Instruct fp32, context 2048, 2 threads, prompts of random token ids, greedy, 8 new tokens;
each server fresh per round, the two alternating round by round; time to first token as the `openai`
client sees it (a streamed completion: from the request to the first piece of text).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai

from quiver.t2t.export import ExportOptions, export
from serve import _free_port, _wait_healthy
from t2t import THREADS

CONTEXT, PREFIX, TURNS = 2048, 1000, 10


def _first_token_s(client: openai.OpenAI, model: str, prompt: list[int]) -> float:
    sent = time.perf_counter()
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].text:
            return time.perf_counter() - sent
    raise RuntimeError("no text came")


def _round(config: Path, cache_mb: int, seed: int) -> dict[str, Any]:
    port = _free_port()
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", str(port),
               "--prefix-cache-mb", str(cache_mb)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        model = config.resolve().parent.name
        rng = np.random.default_rng(seed)
        _first_token_s(client, model, rng.integers(100, 40000, 20).tolist())  # warm-up
        prompt = rng.integers(100, 40000, PREFIX).tolist()
        other = prompt[:900] + rng.integers(100, 40000, 100).tolist()
        result = {
            "first_s": _first_token_s(client, model, prompt),
            "again_s": _first_token_s(client, model, prompt),
            "shared_900_s": _first_token_s(client, model, other),
        }
        history: list[int] = []
        turns = []
        for _ in range(TURNS):  # each turn: the history so far, a new 80-token message
            history += rng.integers(100, 40000, 80).tolist()
            turns.append(_first_token_s(client, model, history))
            history += rng.integers(100, 40000, 8).tolist()  # the reply, as the client sends it back
        return result | {"chat_turns_s": turns}
    finally:
        process.terminate()
        process.wait(60)


def measure_prefix_reuse(folder: Path, llms: Path, rounds: int = 3) -> dict[str, Any]:
    config = export(llms / "smollm2", folder / "smollm2", options=ExportOptions(CONTEXT, n_threads=THREADS)).path
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for round_ in range(rounds):
        for label in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            print(f"  prefix reuse round {round_ + 1}/{rounds}: cache {label}", file=sys.stderr)
            runs[label].append(_round(config, 256 if label == "on" else 0, round_))
    on = runs["on"]
    return {
        "model": f"SmolLM2-135M-Instruct fp32, context {CONTEXT}, {THREADS} threads",
        "again_over_first": statistics.median(r["again_s"] / r["first_s"] for r in on),
        "shared_900_over_first": statistics.median(r["shared_900_s"] / r["first_s"] for r in on),
        "chat_last_over_first_turn": {
            k: statistics.median(r["chat_turns_s"][-1] / r["chat_turns_s"][0] for r in v) for k, v in runs.items()
        },  # fmt: skip
        "medians_s": {
            k: {key: statistics.median(r[key] for r in v) for key in ("first_s", "again_s", "shared_900_s")}
            for k, v in runs.items()
        },  # fmt: skip
        "rounds": runs,
    }

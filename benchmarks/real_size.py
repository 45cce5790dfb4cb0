"""Models of real size: `quiver t2t export` of Llama-3.2-1B's and 3B's shapes (random bf16 weights, the real
configs' shapes: benchmarks/size_models.py), fp32 and int4, each with a rank-16 adapter on all seven
projections; then, at 1B, Quiver beside onnxruntime-genai's builder and llama.cpp on the same weights.

    python benchmarks/run.py --only real_size

Per export (a fresh process each): wall time, peak RSS (the kernel's high-water mark of the process),
the context's size and the model's weights' size in float32. At 1B, side by side (benchmarks/size_peers.py;
where the export venv or llama.cpp's build is missing, Quiver's rows alone): genai's fp32 and int4 exports
and llama.cpp's F32 conversion and Q4_0 quantization (no adapter: neither takes one at export), timed the
same way; then for each of the six models, in rounds whose order turns: open to the first token (spawn to
first token, the files in the page cache: one warm-up open first) and prefill / decode tok/s with prompts of
128 and 512 tokens (128 new, greedy, 2 threads everywhere: benchmarks/t2t.py's worker, llama-server's own
timings), RSS while generating; every process with glibc's malloc on huge pages, as `quiver t2t run` and
`quiver serve` run themselves (benchmarks/t2t.py does the same). Last, 3B int4 (no adapter) decoding
against the memory bandwidth: its decode tok/s times the bytes a step reads (the weights, and the float32
keys and values cached before it), over this machine's read bandwidth (the best of a few passes of
OpenBLAS's matrix-vector product over a 1 GB float32 matrix, which reads each byte once, on as many threads).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import llama_completion  # a sibling script, not a package
from size_models import make_adapter, make_model
from size_peers import genai_export, gguf_exports, open_genai, open_llama, open_python
from t2t import CONTEXT, NEW_TOKENS, PROMPTS, THREADS, _genai_copy, _medians, _worker, worker_prompts
from timing import alternating_runs, peers_on_huge_pages

SIZES = ("1b", "3b")

_EXPORT = r"""
import json, resource, sys, time
from quiver.cli.main import main
start = time.perf_counter()
code = main(sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.perf_counter() - start,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

_OPEN = r"""
import json, sys, time
start = time.perf_counter()
from quiver.t2t.dialog import Dialog
dialog = Dialog.from_config(sys.argv[1])
opened = time.perf_counter()
dialog.token_query([1, 2, 3, 4], max_new_tokens=1)
print(json.dumps({"open_s": opened - start, "first_token_s": time.perf_counter() - start}), flush=True)
"""


def _run(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _export(model: Path, adapter: Path | None, out: Path, bits: int | None, *extra: str) -> dict[str, Any]:
    args = ["t2t", "export", "--model", str(model), *(["--lora", f"a={adapter}"] if adapter else []), "-o", str(out),
            *extra]  # fmt: skip
    result = _run(_EXPORT, *args, *(["--weight-bitwidth", str(bits)] if bits else []))
    if result["code"] != 0:
        raise RuntimeError(f"the export of {model} failed")
    return result | {"context_bytes": (out / "model.qctx").stat().st_size}


def _kv_bytes_per_token(model: Path) -> int:
    """Bytes of keys and values one token takes in Quiver's float32 caches, from the model's config."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return int(config["num_hidden_layers"] * 2 * heads * head_dim * 4)


def measure_real_size(folder: Path, cache: Path, tokenizer: Path, venv_python: Path, rounds: int = 3) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for size in SIZES:
        model = make_model(size, cache / f"llama-{size}", tokenizer)
        adapter = make_adapter(size, cache / f"llama-{size}-adapter")
        weights = (model / "model.safetensors").stat().st_size * 2  # bf16 on disk: float32 is twice that
        for label, bits in (("fp32", None), ("int4", 4)):
            out = folder / f"{size}-{label}"
            print(f"  size: exporting {size} {label}", file=sys.stderr)
            result[f"{size} {label}"] = _export(model, adapter, out, bits) | {"float32_weights_bytes": weights}
            shutil.rmtree(out)  # a 3B fp32 context is 13 GB: one at a time on disk
    with peers_on_huge_pages() as tunables:  # every side as `quiver t2t run` runs itself (benchmarks/t2t.py)
        result["1b side by side"] = _side_by_side(folder, cache / "llama-1b", venv_python, rounds)
        result["1b side by side"]["glibc_tunables"] = tunables
        result["3b int4 bandwidth"] = _bandwidth_use(folder, cache / "llama-3b", rounds)
    return result


_READ_BANDWIDTH = r"""
import json, sys, time
import numpy as np
matrix = np.ones((1 << 18, 1024), np.float32)  # 1 GiB: far beyond the caches
vector = np.ones(1024, np.float32)
best = float("inf")
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    matrix @ vector
    best = min(best, time.perf_counter() - start)
print(json.dumps({"bytes_per_s": matrix.nbytes / best}))
"""


def read_bandwidth(threads: int, passes: int = 7) -> float:
    """This machine's read bandwidth in bytes/s on `threads` threads (OpenBLAS's, in a process of its own)."""
    import os

    env = os.environ | {"OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", _READ_BANDWIDTH, str(passes)], capture_output=True, text=True,
                         env=env, check=True)  # fmt: skip
    return float(json.loads(out.stdout)["bytes_per_s"])


def _bandwidth_use(folder: Path, model: Path, rounds: int) -> dict[str, Any]:
    """3B int4's decode speed against the memory bandwidth: the bytes a step reads per token — the weights
    (the context: the layers' and the head's 4-bit blocks; the token table's rows a step gathers are a few KB)
    and the keys and values cached before it (float32, at the reply's middle position) — over this machine's
    read bandwidth."""
    print("  size: Quiver's int4 export of 3b, no adapter, for decoding at the bandwidth", file=sys.stderr)
    out = folder / "quiver-3b-int4"
    made = _export(model, None, out, 4, "--context-size", str(CONTEXT))
    runs, bandwidths = [], []
    for _ in range(rounds):  # the bandwidth measured between the runs, under the same conditions
        runs.append(_worker("quiver", str(out / "genie_config.json"), "both"))
        bandwidths.append(read_bandwidth(THREADS))
    shutil.rmtree(out)
    decode = {prompt: statistics.median(r[prompt]["decode_tok_s"] for r in runs) for prompt in ("128", "512")}
    cached = {p: _kv_bytes_per_token(model) * (int(p) + NEW_TOKENS // 2) for p in decode}  # read at each step
    read = {p: made["context_bytes"] + cached[p] for p in decode}
    bandwidth = statistics.median(bandwidths)
    return {
        "context_bytes": made["context_bytes"],
        "kv_bytes_read_per_step": cached,
        "decode_tok_s": decode,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "bytes_read_gb_s": {p: tok_s * read[p] / 1e9 for p, tok_s in decode.items()},
        "fraction_of_bandwidth": {p: tok_s * read[p] / bandwidth for p, tok_s in decode.items()},
        "weights_only_fraction": {p: tok_s * made["context_bytes"] / bandwidth for p, tok_s in decode.items()},
        "rounds": {"decode": runs, "read_bandwidth_bytes_per_s": bandwidths},
    }


def _side_by_side(
    folder: Path, model: Path, venv_python: Path, rounds: int, precisions: tuple[str, ...] = ("fp32", "int4")
) -> dict[str, Any]:
    """Quiver's 1B exports (no adapter, as the peers') beside genai's and llama.cpp's of the same weights:
    the exports, then opening and generating in alternating rounds; `precisions`: fp32, int4 or both."""
    engines: dict[str, Callable[[], dict[str, Any]]] = {}
    exports: dict[str, Any] = {}
    opens: dict[str, Callable[[], float]] = {}
    for label, bits in (("fp32", None), ("int4", 4)):
        if label not in precisions:
            continue
        print(f"  size: Quiver's {label} export of 1b, no adapter", file=sys.stderr)
        out = folder / f"quiver-1b-{label}"
        exports[f"quiver {label}"] = _export(model, None, out, bits, "--context-size", str(CONTEXT))
        config = out / "genie_config.json"
        opens[f"quiver {label}"] = partial(open_python, _OPEN, config)
        engines[f"quiver {label}"] = partial(_worker, "quiver", str(config), "both")
    unavailable: dict[str, str] = {}
    if venv_python.is_file():
        for precision in precisions:
            print(f"  size: genai's {precision} export of 1b", file=sys.stderr)
            out = folder / f"genai-1b-{precision}"
            exports[f"genai {precision}"] = genai_export(model, out, precision, venv_python)
            pinned = _genai_copy(out, folder / f"genai-1b-{precision}-threads")
            opens[f"genai {precision}"] = partial(open_genai, pinned)
            engines[f"genai {precision}"] = partial(_worker, "genai", str(pinned), "-")
    else:
        unavailable["genai"] = f"no export venv at {venv_python} (ci/make-real-models llms makes it)"
    try:
        from llama_server import build, environment

        server, env = build() / "llama-server", environment()
        print("  size: llama.cpp's F32 conversion and Q4_0 quantization of 1b", file=sys.stderr)
        ggufs = gguf_exports(model, folder / "llama-1b-gguf", venv_python, build(), env)
        for kind, made in ggufs.items():
            if {"f32": "fp32", "q4_0": "int4"}[kind] not in precisions:
                continue
            label = f"llama.cpp {kind.upper()}"
            exports[label] = made
            llama = {"server": server, "model": Path(made["path"]), "env": env}
            opens[label] = partial(open_llama, server, llama["model"], THREADS, env)
            engines[label] = partial(llama_completion.speed, llama, CONTEXT, THREADS, worker_prompts(), NEW_TOKENS)
    except (OSError, subprocess.CalledProcessError, ImportError, RuntimeError) as exc:
        unavailable["llama.cpp"] = f"{type(exc).__name__}: {exc}"[:300]
    for open_ in opens.values():
        open_()  # every file into the page cache once
    opened = alternating_runs(opens, rounds, "size open")
    generated = alternating_runs(engines, rounds, "size generate")
    generation = {label: _medians(runs) for label, runs in generated.items()}
    kv_mb = _kv_bytes_per_token(model) * (max(PROMPTS) + NEW_TOKENS) / 2**20  # the longest prompt's, at its end
    return {
        "threads": THREADS,
        "exports": exports,
        "unavailable": unavailable,
        "open_to_first_token_s": {label: statistics.median(times) for label, times in opened.items()},
        "generation": generation,
        "quiver_kv_in_use_mb": kv_mb,
        # RSS while generating (after the longest prompt's generation) / (the context's bytes + keys and values)
        "quiver_rss_over_weights_and_kv": {
            label: generation[label]["rss_growth_mb"] / (exports[label]["context_bytes"] / 2**20 + kv_mb)
            for label in generation
            if label.startswith("quiver")
        },
        "rounds": {"open": opened, "generation": generated},
    }

"""The peers of `quiver t2t export` on a model folder of real size, made from the same weights and timed the
same way: onnxruntime-genai's model builder (fp32 and int4, in the corpus's export venv: it needs torch and
transformers) and llama.cpp's `convert_hf_to_gguf.py` (F32, the same venv) then `llama-quantize` (Q4_0:
symmetric 4-bit blocks of 32, Quiver's `rtn` grid), as the sdist vendors them (benchmarks/llama_server.py).

Every step runs in a process of its own under a small wrapper that reports its wall time and the kernel's
peak RSS of it (`RUSAGE_CHILDREN` of a fresh wrapper: that one child and what it waited for). Opening is
timed from the spawn of a process to its first token, the same for every engine: Quiver's and genai's a
Python process that loads and generates one token, llama.cpp's a `llama-server` polled every 10 ms until
healthy, then asked for one token.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_completion  # a sibling script, not a package

BUILDER = Path(__file__).resolve().parent / "genai_builder.py"

_TIMED = r"""
import json, resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
print(json.dumps({"code": done.returncode, "seconds": time.perf_counter() - start, "stderr": done.stderr[-2000:],
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""

_GENAI_OPEN = r"""
import sys
import numpy as np
import onnxruntime_genai as og
model = og.Model(sys.argv[1])
params = og.GeneratorParams(model)
params.set_search_options(max_length=8, do_sample=False)
generator = og.Generator(model, params)
generator.append_tokens(np.array([1, 2, 3, 4], np.int32))
generator.generate_next_token()
print("first token", flush=True)
"""


def timed(*command: str | Path) -> dict[str, Any]:
    """Runs `command` in a process of its own: its wall time and peak RSS; raises where it fails."""
    out = subprocess.run([sys.executable, "-c", _TIMED, *map(str, command)], capture_output=True, text=True)
    result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if result.pop("code") != 0:
        raise RuntimeError(f"{Path(str(command[1] if len(command) > 1 else command[0])).name} failed: "
                           f"{result['stderr'][-600:]}")  # fmt: skip
    result.pop("stderr")
    return result


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def genai_export(model: Path, out: Path, precision: str, venv_python: Path) -> dict[str, Any]:
    """onnxruntime-genai's builder on `model`: `precision` fp32 or int4, for the CPU."""
    cache = out.with_name(out.name + "-cache")  # the builder's scratch: not part of the model
    result = timed(venv_python, BUILDER, "-i", model, "-o", out, "-p", precision, "-e", "cpu", "-c", cache)
    shutil.rmtree(cache, ignore_errors=True)
    return result | {"bytes": folder_bytes(out)}


def gguf_exports(model: Path, out: Path, venv_python: Path, build: Path, env: dict[str, str]) -> dict[str, Any]:
    """llama.cpp's conversion of `model` to F32 GGUF, then its Q4_0 quantization of that file."""
    converter = build.parents[1] / "src" / "convert_hf_to_gguf.py"  # <cache>/build-<hash>/bin -> <cache>/src
    # the converter imports sentencepiece before it looks for a SentencePiece vocabulary (then takes the
    # tokenizer.json): a benchmark-only package, added to the export venv here
    if subprocess.run([str(venv_python), "-c", "import sentencepiece"], capture_output=True).returncode != 0:
        install = [str(venv_python), "-m", "pip", "install", "-q", "sentencepiece"]
        subprocess.run(install, check=True, capture_output=True)
    out.mkdir(parents=True, exist_ok=True)
    f32, q4_0 = out / "model-f32.gguf", out / "model-q4_0.gguf"
    converted = timed(venv_python, converter, model, "--outtype", "f32", "--outfile", f32)
    quantized = timed(build / "llama-quantize", f32, q4_0, "Q4_0")
    return {
        "f32": converted | {"path": str(f32), "bytes": f32.stat().st_size},
        "q4_0": quantized | {"path": str(q4_0), "bytes": q4_0.stat().st_size, "after": "the F32 conversion"},
    }


def open_python(code: str, *args: str | Path, python: str = sys.executable) -> float:
    """Seconds from the spawn of `python -c code args` to its first line of output, which it prints when it
    has loaded a model and made one token (what it does after, such as waiting at exit for a background
    thread, is not timed)."""
    start = time.perf_counter()
    child = subprocess.Popen([python, "-c", code, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    seconds = time.perf_counter() - start
    _, errors = child.communicate()
    if child.returncode != 0 or not line:
        raise RuntimeError(errors[-2000:])
    return seconds


def open_llama(server: Path, model: Path, threads: int, env: dict[str, str]) -> float:
    """Seconds from the spawn of `llama-server` to its first token (one, from a four-token prompt)."""
    start = time.perf_counter()

    def first_token(complete: Callable[[dict[str, Any]], Any], _: object) -> float:
        complete({"prompt": [1, 2, 3, 4], "n_predict": 1})
        return time.perf_counter() - start

    return float(llama_completion.run({"server": server, "model": model, "env": env}, 512, threads, first_token, 0.01))


def open_genai(folder: Path) -> float:
    return open_python(_GENAI_OPEN, folder)

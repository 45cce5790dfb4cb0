"""Models of real size: `quiver t2t export` of Llama-3.2-1B's and 3B's shapes (random bf16 weights, the real
configs' shapes: benchmarks/size_models.py), fp32 and int4, each with a rank-16 adapter on all seven
projections; then opening the 1B exports and generating.

    python benchmarks/run.py --only real_size

Per export (a fresh process each): wall time, peak RSS (the kernel's high-water mark of the process),
the context's size and the model's weights' size in float32. Per 1B context: open to the first token
(fresh processes, the second and later opens: the file in the page cache) and prefill / decode tok/s
with prompts of 128 and 512 tokens (benchmarks/t2t.py's worker, 2 threads), RSS growth while
generating. Only Quiver is measured here: onnxruntime-genai's builder and llama.cpp on these weights
are not side by side yet (the issue's figures: genai's int4 builder peaks at 9.75 / 18.5 GiB, llama.cpp's
conversion at <= 3.3 GiB).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from size_models import make_adapter, make_model
from t2t import _worker

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
print(json.dumps({"open_s": opened - start, "first_token_s": time.perf_counter() - start}))
"""


def _run(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _export(model: Path, adapter: Path, out: Path, bits: int | None) -> dict[str, Any]:
    args = ["t2t", "export", "--model", str(model), "--lora", f"a={adapter}", "-o", str(out)]
    result = _run(_EXPORT, *args, *(["--weight-bitwidth", str(bits)] if bits else []))
    if result["code"] != 0:
        raise RuntimeError(f"the export of {model} failed")
    return result | {"context_bytes": (out / "model.qctx").stat().st_size}


def measure_real_size(folder: Path, cache: Path, tokenizer: Path, opens: int = 3) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for size in SIZES:
        model = make_model(size, cache / f"llama-{size}", tokenizer)
        adapter = make_adapter(size, cache / f"llama-{size}-adapter")
        weights = (model / "model.safetensors").stat().st_size * 2  # bf16 on disk: float32 is twice that
        for label, bits in (("fp32", None), ("int4", 4)):
            out = folder / f"{size}-{label}"
            print(f"  size: exporting {size} {label}", file=sys.stderr)
            row = _export(model, adapter, out, bits) | {"float32_weights_bytes": weights}
            if size == "1b":
                config = str(out / "genie_config.json")
                row["open"] = [_run(_OPEN, config) for _ in range(opens + 1)][1:]  # the first warms the page cache
                row["open_to_first_token_s"] = statistics.median(r["first_token_s"] for r in row["open"])
                row["generation"] = _worker("quiver", config, "both")
            result[f"{size} {label}"] = row
            shutil.rmtree(out)  # a 3B fp32 context is 13 GB: one at a time on disk
    return result

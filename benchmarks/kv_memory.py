"""Serving memory that follows the tokens in use: the batched decoder of `quiver serve` on SmolLM2-135M int4
at 2048 positions and `--max-batch 8`, its private memory (the kernel's RssAnon) at rest, with eight
512-token sequences cached, and after they end.

    python benchmarks/run.py --only kv_memory

In a fresh process: the decoder made (the engine's own `BatchDecoder`), then eight rows prefilled with
512 random token ids each (windows of 128, as the engine feeds them), then every row freed as the
engine frees a row whose sequence ended. The keys and values those sequences cache: layers × 2 × rows ×
kv heads × 512 × head size × 4 bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from quiver.t2t.export import ExportOptions, export

_WORKER = r"""
import json, sys
import numpy as np
def private_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
from quiver.t2t.batch import BatchDecoder
start = private_mb()
decoder = BatchDecoder.from_config(sys.argv[1], max_batch=8)
idle = private_mb()
rng = np.random.default_rng(0)
for row in range(8):
    ids = [1] + [int(i) for i in rng.integers(100, 40000, 511)]
    for at in range(0, 512, 128):
        decoder.prefill(row, ids[at : at + 128], at, 0)
full = private_mb()
kv = sum(array[:, :, :512].nbytes for array in decoder._cache.values()) / 2**20
decoder.free(range(8))
print(json.dumps({"before_mb": start, "idle_mb": idle, "eight_512_mb": full, "freed_mb": private_mb(),
                  "kv_bytes_mb": kv, "kv_at_full_context_mb": kv * decoder.capacity / 512}))
"""


def measure_kv_memory(folder: Path, llms: Path) -> dict[str, Any]:
    config = export(llms / "smollm2", folder / "kv-memory", options=ExportOptions(context_size=2048, weight_bits=4))
    out = subprocess.run([sys.executable, "-c", _WORKER, str(config.path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    result["growth_over_kv_bytes"] = (result["eight_512_mb"] - result["idle_mb"]) / result["kv_bytes_mb"]
    return result

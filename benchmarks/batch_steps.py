"""`quiver serve`'s decode steps on their own graph (`batch_decode`: Quiver's DecodeAttention) against the
batched graph's own (ONNX Runtime's GroupQueryAttention, the kernel it replaces), side by side: Llama-3.2-1B's
shapes in int4 (random bf16 weights, benchmarks/size_models.py), 2048 positions, the engine's own
`BatchDecoder`, steps of 1 and 8 rows with 512 cached positions each (random keys and values: every page
written, as a served sequence's are). Fresh processes, the two in turn, the order turning round by round;
the same threads on both sides (the context's config). JSON on stdout.

    python benchmarks/batch_steps.py [FOLDER] [--rounds 3]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from quiver.t2t.export import ExportOptions, export
from size_models import cached_model, size_arguments

CACHED = 512
STEPS = 24  # the median of the last 20
ROWS = (1, 8)

_WORKER = r"""
import json, sys, time
import numpy as np
from quiver.t2t import batch
config, attention, rows, cached, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
if attention == "ort":  # no decode graph of its own: the steps run the batched graph, as before it
    batch.BATCH_DECODE_GRAPH = "not in the context"
decoder = batch.BatchDecoder.from_config(config, max_batch=rows)
rng = np.random.default_rng(0)
for cache in decoder._cache.values():
    cache[:rows, :, : cached + steps] = rng.standard_normal(cache[:rows, :, : cached + steps].shape, np.float32)
times = []
for step in range(steps):
    start = time.perf_counter()
    decoder.decode([5] * rows, [cached + step] * rows, [batch.BASE_SLOT] * rows)
    times.append((time.perf_counter() - start) * 1e3)
decoder.close()
print(json.dumps({"step_ms": float(np.median(times[4:]))}))
"""


def _step_ms(config: Path, attention: str, rows: int) -> float:
    code = [sys.executable, "-c", _WORKER, str(config), attention, str(rows), str(CACHED), str(STEPS)]
    out = subprocess.run(code, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["step_ms"])


def main() -> None:
    args = size_arguments("batch-steps", rounds=3)
    out = args.folder / "quiver-1b-int4"
    if not (out / "genie_config.json").is_file():
        print("exporting 1b int4 ...", file=sys.stderr)
        export(cached_model("1b"), out, options=ExportOptions(context_size=2048, weight_bits=4))
    config = out / "genie_config.json"
    result: dict[str, Any] = {"model": "Llama-3.2-1B's shapes, random bf16 weights, int4 (rtn), 2048 positions",
                              "cached_positions": CACHED, "rounds": args.rounds}  # fmt: skip
    for rows in ROWS:
        samples: dict[str, list[float]] = {"quiver": [], "ort": []}
        for round_ in range(args.rounds):
            for attention in ("quiver", "ort") if round_ % 2 == 0 else ("ort", "quiver"):
                samples[attention].append(_step_ms(config, attention, rows))
        quiver_ms, ort_ms = (statistics.median(samples[k]) for k in ("quiver", "ort"))
        result[f"{rows} rows"] = {"decode_attention_ms": quiver_ms, "group_query_attention_ms": ort_ms,
                                  "ratio": quiver_ms / ort_ms, "samples": samples}  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

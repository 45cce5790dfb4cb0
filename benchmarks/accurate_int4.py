"""Accurate 4-bit at scale: `rtn-min` (a scale and a float minimum per block, exact on a Q4_1 grid; its
decode graph on ORT's int8 kernel with the activations' remainder as a second row) beside `rtn`
(symmetric blocks, the int8 kernel alone), on Llama-3.2-1B's shapes (random bf16 weights with the real
config's shapes: benchmarks/size_models.py; no adapter), context 1024.

    python benchmarks/run.py --only accurate_int4

Both exports in fresh processes, alternated round by round (benchmarks/t2t.py's worker: prompts of 128
and 512 tokens, 128 new tokens, greedy, 2 threads); the ratios are medians of per-round ratios. What
`rtn-min` keeps of a model's text is held by the tests (SmolLM2: 128 of 128 greedy tokens), not here:
random weights lie on no grid.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

from quiver.t2t.export import ExportOptions, export
from size_models import make_model
from t2t import PROMPTS, THREADS, _medians, _paired, _worker
from timing import alternating_runs

CONTEXT = 1024  # the 512-token prompt and its 128 new tokens
KINDS = ("decode_tok_s", "prefill_tok_s")


def measure_accurate_int4(folder: Path, cache: Path, tokenizer: Path, rounds: int = 3) -> dict[str, Any]:
    model = make_model("1b", cache / "llama-1b", tokenizer)
    configs = {}
    for quantizer in ("rtn-min", "rtn"):
        print(f"  accurate int4: exporting 1b {quantizer}", file=sys.stderr)
        options = ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4, quantizer=quantizer)
        configs[quantizer] = export(model, folder / f"1b-{quantizer}", options=options).path
    runs = alternating_runs({label: partial(_worker, "quiver", str(path), "both") for label, path in configs.items()},
                            rounds, "accurate int4")  # fmt: skip
    return {
        "model": f"Llama-3.2-1B's shapes, random bf16 weights, context {CONTEXT}, int4 blocks of 32",
        "threads": THREADS,
        "engines": {label: _medians(r) for label, r in runs.items()},
        "rtn-min / rtn": {
            str(n): {
                kind: _paired(runs["rtn-min"], runs["rtn"], str(n), kind) for kind in ("decode_tok_s", "prefill_tok_s")
            }
            for n in PROMPTS
        },
        "context_bytes": {label: (path.parent / "model.qctx").stat().st_size for label, path in configs.items()},
        "rounds": runs,
    }

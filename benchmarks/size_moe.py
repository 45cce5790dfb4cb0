"""Mixture-of-experts models of real size at 4 bits: the experts float (what every 4-bit export did before
they were quantized; `--override '*.mlp.experts.*=float'`) against the experts in QMoE's 4-bit blocks.

The models: the families corpus's tiny Qwen3-MoE, Qwen2-MoE and Mixtral configs (tests/real/make_families.py)
scaled to real shapes (hidden 2048, 16 layers, 16 heads of 128, 4 key/value heads, a 151936-token vocabulary;
8 experts of 1024 (Mixtral's 2048), the corpus's top-k and routing), random bf16 weights saved by transformers
itself (its on-disk names) in the corpus's export venv; made once under ~/.cache/quiver/size-moe/. No peer:
onnxruntime-genai's builder builds none of these folders (docs/BENCHMARKS.md, "Every family").

Per export, in a fresh process: wall time, peak RSS, the context's size. Then both exports of each model, in
rounds whose order turns: prefill and decode tok/s at prompts of 128 and 512 tokens (128 new, greedy, 2
threads: benchmarks/t2t.py's worker) and RSS while generating. JSON on stdout.

    python benchmarks/size_moe.py [FOLDER] [--rounds 3]
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from real_size import _export
from size_families import SCALE
from size_models import CACHE, EXPORT_VENV, corpus, size_arguments
from t2t import _medians, _worker
from timing import alternating_runs

CASES = {"qwen3_moe": {}, "qwen2_moe": {}, "mixtral": {"intermediate_size": 2048}}  # per case: its own sizes
KEEP_EXPERTS_FLOAT = "*.mlp.experts.*=float"


def _model(case: str, sizes: dict[str, int]) -> Path:
    """The case scaled to real shapes (made once)."""
    folder = CACHE / "size-moe" / case
    if (folder / "config.json").is_file():
        return folder
    source = corpus("families") / case
    subprocess.run([str(EXPORT_VENV), "-c", SCALE, str(source), str(folder), "16", json.dumps(sizes)], check=True)
    return folder


def main() -> None:
    args = size_arguments("size-moe-exports", rounds=3)
    report: dict[str, Any] = {}
    for case, sizes in CASES.items():
        model = _model(case, sizes)
        exports, configs = {}, {}
        for label, extra in (("experts float", ("--override", KEEP_EXPERTS_FLOAT)), ("experts QMoE", ())):
            out = args.folder / case / label.replace(" ", "-")
            exports[label] = _export(model, None, out, 4, *extra)
            configs[label] = out / "genie_config.json"
        runs = alternating_runs({n: lambda c=c: _worker("quiver", str(c), "plain") for n, c in configs.items()},
                                args.rounds, case)  # fmt: skip
        shutil.rmtree(args.folder / case)  # its exports (the float experts' are several GB): made again next run
        report[case] = {
            "weights_bytes": (model / "model.safetensors").stat().st_size,
            "exports": exports,
            "median": {label: _medians(r) for label, r in runs.items()},
            "decode_512_ratio": statistics.median(
                q["512"]["decode_tok_s"] / f["512"]["decode_tok_s"]
                for q, f in zip(runs["experts QMoE"], runs["experts float"])
            ),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

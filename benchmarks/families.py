"""Every family, side by side with onnxruntime-genai: prefill and decode of Quiver's export of each model
of the families corpus (tests/real/make_families.py: tiny random-weight models of each architecture,
and the real Gemma 3 270M) against onnxruntime-genai's builder's export of the same folder, where the
builder builds it.

    python benchmarks/run.py --only families

Both fp32, 2 intra-op threads each, in fresh processes, the order turning round by round
(benchmarks/t2t.py's worker: greedy, prompts of 32 and 256 tokens and 64 new ones for the tiny models,
whose contexts are 512 positions; 128 and 512 tokens and 128 new ones for Gemma 3 270M). The builder
runs in the corpus's export venv (it needs torch and transformers; benchmarks/genai_builder.py hands it
transformers 5's rope settings in the form it reads); its exports are kept under
~/.cache/quiver/genai-families/<corpus key>/, and a family it cannot build is listed with its reason.
Beside the speeds, how many leading greedy tokens of genai's export equal transformers' (Quiver's are
held equal by tests/integration/test_families.py).
On the tiny models a step is mostly per-node overhead, not arithmetic: the ratios compare the two
graphs and runtimes' fixed costs as much as their kernels.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from quiver.errors import QuiverError
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.quality import leading_equal
from t2t import THREADS, _genai_copy, _paired, _worker, genai_replies

TINY = {"lengths": [32, 256], "new": 64, "high": 49000, "genai_max_length": 512}
REAL = {"lengths": [128, 512], "new": 128, "high": 40000, "genai_max_length": 1024}
REAL_MODELS = {"gemma3_270m": "greedy"}  # its expected tokens' key in <name>.json
BUILDER = Path(__file__).resolve().parent / "genai_builder.py"  # genai's builder, shimmed for transformers 5


def _genai_build(source: Path, out: Path, venv_python: Path) -> str | None:
    """onnxruntime-genai's fp32 export of `source` into `out` (kept); None, or why the builder failed."""
    failed = out.with_name(out.name + ".failed")
    if (out / "genai_config.json").is_file():
        return None
    if failed.is_file():
        return failed.read_text()
    command = [str(venv_python), str(BUILDER), "-i", str(source), "-o", str(out), "-p", "fp32", "-e", "cpu",
               "-c", str(out.parent / "cache")]  # fmt: skip
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0 or not (out / "genai_config.json").is_file():
        reason = (built.stderr.strip().splitlines() or ["no genai_config.json written"])[-1][:300]
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(reason)
        return reason
    return None


def _genai_agrees(case: str, corpus: Path, genai: Path, scratch: Path, shape: dict[str, Any]) -> list[int]:
    """Leading greedy tokens of genai's export equal to transformers', per prompt of the corpus (a peer
    that computes another model would make its speed beside the point)."""
    if case in REAL_MODELS:
        raw = json.loads((corpus / f"{case}.json").read_text())
        expected = {"prompt_ids": raw["prompt_ids"], "base": raw[REAL_MODELS[case]]}
    else:
        raw = json.loads((corpus / "expected.json").read_text())[case]
        expected = {"prompt_ids": raw["prompts"], "base": raw["base"]}
    path = scratch / f"{case}-expected.json"
    path.write_text(json.dumps(expected))
    replies = genai_replies(genai, path, "base", shape["genai_max_length"])
    return [leading_equal(r, w) for r, w in zip(replies, expected["base"])]


def _median_runs(runs: list[dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    return {str(n): {k: statistics.median(r[str(n)][k] for r in runs) for k in runs[0][str(n)]} for n in lengths}


def measure_families(folder: Path, corpus: Path, venv_python: Path, cache: Path, rounds: int = 3) -> dict[str, Any]:
    cases = sorted(p.name for p in corpus.iterdir() if (p / "config.json").is_file() and not p.name.endswith(".qv"))
    cases = [c for c in cases if c in REAL_MODELS or c in json.loads((corpus / "expected.json").read_text())]
    result: dict[str, Any] = {"threads": THREADS, "families": {}}
    for case in cases:
        shape = REAL if case in REAL_MODELS else TINY
        row: dict[str, Any] = {}
        result["families"][case] = row
        try:
            config = export(corpus / case, folder / f"{case}-quiver", options=ExportOptions(n_threads=THREADS)).path
        except QuiverError as exc:
            row["quiver"] = f"refused: {exc}"
            continue
        reason = _genai_build(corpus / case, cache / case, venv_python)
        if reason is not None:
            row["genai"] = f"cannot build: {reason}"
            continue
        genai = _genai_copy(cache / case, folder / f"{case}-genai")
        try:
            row["genai_agreement"] = _genai_agrees(case, corpus, genai, folder, shape)
        except subprocess.CalledProcessError as exc:  # genai's runtime refuses its own export
            row["genai"] = f"failed: {(exc.stderr or '').strip().splitlines()[-1:] or exc}"[:400]
            continue
        plan = [("quiver", str(config)), ("genai", str(genai))]
        runs: dict[str, list[dict[str, Any]]] = {"quiver": [], "genai": []}
        for round_ in range(rounds):
            for engine, path in plan if round_ % 2 == 0 else plan[::-1]:
                print(f"  families round {round_ + 1}/{rounds}: {case} {engine}", file=sys.stderr)
                try:
                    runs[engine].append(_worker(engine, path, "both", json.dumps(shape)))
                except RuntimeError as exc:
                    row[engine] = f"failed: {str(exc).strip().splitlines()[-1][:300]}"
        if any(isinstance(row.get(e), str) for e in runs):
            continue
        row |= {engine: _median_runs(r, shape["lengths"]) for engine, r in runs.items()}
        row["ratios"] = {
            str(n): {
                key: _paired(runs["quiver"], runs["genai"], str(n), key) for key in ("prefill_tok_s", "decode_tok_s")
            }
            for n in shape["lengths"]
        }
    return result

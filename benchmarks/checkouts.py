"""Text generation at an earlier commit and now, side by side: did a change (a restructuring, a rename)
leave the speed as it was?

    python benchmarks/checkouts.py BEFORE [--rounds 6] [--json benchmarks/results/checkouts.json]

Each side exports SmolLM2-135M-Instruct (the llms corpus) fp32 and int4 at context 1024 with its own code,
then runs its own `benchmarks/t2t.py` worker (prompts of 128 and 512 tokens, 128 new, greedy, 2 threads)
in fresh processes, the four runs of a round in an order that turns round by round. The earlier commit is
checked out into a temporary folder (`git archive`); "now" is this working tree. Out: per precision,
prompt and measure, the median and every round's ratio of now over before.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_EXPORT = """
import sys
from pathlib import Path
from quiver.t2t.export import ExportOptions, export
bits = int(sys.argv[3]) or None
print(export(Path(sys.argv[1]), Path(sys.argv[2]), options=ExportOptions(1024, n_threads=2, weight_bits=bits)).path)
"""


def _worker_code(tree: Path) -> str:
    """`benchmarks/t2t.py`'s worker as that tree wrote it (it imports that tree's modules)."""
    module = ast.parse((tree / "benchmarks" / "t2t.py").read_text())
    for node in module.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_WORKER":
            return str(ast.literal_eval(node.value))
    raise SystemExit(f"{tree}/benchmarks/t2t.py has no _WORKER")


def _run(code: str, tree: Path, *args: str) -> str:
    environment = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return done.stdout.strip().splitlines()[-1]


def _checkout(commit: str, folder: Path) -> Path:
    archive = folder / "before.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "before", filter="data")
    return folder / "before"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "checkouts.json")
    args = parser.parse_args()
    corpus = Path(subprocess.run(["bash", "ci/make-real-models", "llms"], capture_output=True, text=True,
                                 check=True, cwd=ROOT).stdout.strip())  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="quiver-checkouts-") as tmp:
        folder = Path(tmp)
        trees = {"before": _checkout(args.before, folder), "now": ROOT}
        configs = {}
        for side, tree in trees.items():
            for bits in (4, 0):
                out = folder / f"{side}-{bits}"
                configs[(side, bits)] = _run(_EXPORT, tree, str(corpus / "smollm2"), str(out), str(bits))
        workers = {side: _worker_code(tree) for side, tree in trees.items()}
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in configs}
        order = list(configs)
        for round_ in range(args.rounds):
            for side, bits in order if round_ % 2 == 0 else order[::-1]:
                print(f"  round {round_ + 1}/{args.rounds}: {side} {'int4' if bits else 'fp32'}", file=sys.stderr)
                measured = _run(workers[side], trees[side], "quiver", configs[(side, bits)], "both")
                runs[(side, bits)].append(json.loads(measured))
    ratios = {}
    for bits in (4, 0):
        for prompt in ("128", "512"):
            for kind in ("decode_tok_s", "prefill_tok_s"):
                pairs = zip(runs[("now", bits)], runs[("before", bits)], strict=True)
                each = sorted(now[prompt][kind] / before[prompt][kind] for now, before in pairs)
                label = f"{'int4' if bits else 'fp32'} {prompt} {kind}"
                ratios[label] = {"median": statistics.median(each), "rounds": [round(r, 3) for r in each]}
    report = {"before": args.before, "rounds": args.rounds, "now_over_before": ratios,
              "runs": {f"{side} {'int4' if bits else 'fp32'}": r for (side, bits), r in runs.items()}}  # fmt: skip
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()

"""Opening a 1B model again, alone: Quiver's fp32 and int4 exports of Llama-3.2-1B's shapes (no adapter,
context 1024) beside llama.cpp's F32 and Q4_0 files of the same weights, spawn to first token as
`--only real_size` times it (benchmarks/size_peers.py), in alternating rounds; the exports are made once
into FOLDER and kept. JSON on stdout.

    python benchmarks/size_opens.py [FOLDER] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from llama_server import build, environment
from real_size import _OPEN, _export
from size_models import cached_model
from size_peers import gguf_exports, open_llama, open_python
from timing import peers_on_huge_pages

CACHE = Path.home() / ".cache" / "quiver"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path, nargs="?", default=CACHE / "size-opens")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = cached_model("1b")  # the folder `--only real_size` makes
    venv = CACHE / "export-venv" / "bin" / "python"
    server, env = build() / "llama-server", environment()
    ggufs = args.folder / "gguf"
    if not (ggufs / "model-q4_0.gguf").is_file():
        gguf_exports(model, ggufs, venv, build(), env)
    opens = {}
    for label, bits in (("fp32", None), ("int4", 4)):
        out = args.folder / f"quiver-{label}"
        if not (out / "model.qctx").is_file():
            _export(model, None, out, bits, "--context-size", "1024")
        opens[f"quiver {label}"] = (open_python, (_OPEN, out / "genie_config.json"))
    for kind in ("f32", "q4_0"):
        opens[f"llama.cpp {kind.upper()}"] = (open_llama, (server, ggufs / f"model-{kind}.gguf", 2, env))
    with peers_on_huge_pages() as tunables:
        for open_, given in opens.values():
            open_(*given)  # every file into the page cache once
        rounds: dict[str, list[float]] = {label: [] for label in opens}
        for number in range(args.rounds):
            labels = list(opens) if number % 2 == 0 else list(opens)[::-1]
            for label in labels:
                print(f"  open round {number + 1}/{args.rounds}: {label}", file=sys.stderr)
                open_, given = opens[label]
                rounds[label].append(open_(*given))
    ratios = {
        f"{ours} / {theirs}": statistics.median(a / b for a, b in zip(rounds[ours], rounds[theirs]))
        for ours, theirs in (("quiver fp32", "llama.cpp F32"), ("quiver int4", "llama.cpp Q4_0"))
    }
    medians = {label: statistics.median(times) for label, times in rounds.items()}
    print(json.dumps({"glibc_tunables": tunables, "median_s": medians, "ratios": ratios, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()

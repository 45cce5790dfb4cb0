"""Opening a 1B model again, alone: Quiver's fp32 and int4 exports of Llama-3.2-1B's shapes (no adapter,
context 1024) beside llama.cpp's F32 and Q4_0 files of the same weights, spawn to first token as
`--only real_size` times it (benchmarks/size_peers.py), in alternating rounds; the exports are made once
into FOLDER and kept. JSON on stdout.

    python benchmarks/size_opens.py [FOLDER] [--rounds 5]
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

from llama_server import build, environment
from real_size import _OPEN, _export
from size_models import EXPORT_VENV, cached_model, size_arguments
from size_peers import gguf_exports, open_llama, open_python
from timing import alternating_runs, peers_on_huge_pages


def quiver_export(folder: Path, label: str, model: Path | None = None) -> Path:
    """The dialog config of Quiver's `label` ("fp32" or "int4") export of the 1B model in `folder`, made once
    (no adapter, context 1024)."""
    out = folder / f"quiver-{label}"
    if not (out / "model.qctx").is_file():
        _export(model or cached_model("1b"), None, out, 4 if label == "int4" else None, "--context-size", "1024")
    return out / "genie_config.json"


def main() -> None:
    args = size_arguments("size-opens", rounds=5)
    model = cached_model("1b")  # the folder `--only real_size` makes
    server, env = build() / "llama-server", environment()
    ggufs = args.folder / "gguf"
    if not (ggufs / "model-q4_0.gguf").is_file():
        gguf_exports(model, ggufs, EXPORT_VENV, build(), env)
    opens: dict[str, Callable[[], float]] = {}
    for label in ("fp32", "int4"):
        opens[f"quiver {label}"] = partial(open_python, _OPEN, quiver_export(args.folder, label, model))
    for kind in ("f32", "q4_0"):
        opens[f"llama.cpp {kind.upper()}"] = partial(open_llama, server, ggufs / f"model-{kind}.gguf", 2, env)
    with peers_on_huge_pages() as tunables:
        for open_ in opens.values():
            open_()  # every file into the page cache once
        rounds = alternating_runs(opens, args.rounds, "open")
    ratios = {
        f"{ours} / {theirs}": statistics.median(a / b for a, b in zip(rounds[ours], rounds[theirs]))
        for ours, theirs in (("quiver fp32", "llama.cpp F32"), ("quiver int4", "llama.cpp Q4_0"))
    }
    medians = {label: statistics.median(times) for label, times in rounds.items()}
    print(json.dumps({"glibc_tunables": tunables, "median_s": medians, "ratios": ratios, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()

"""A server replica's open from a packed-weights form (`quiver serve --packed-weights`, every Ray Serve
replica by default), the form's CRC-32 read in full against its stamp of a check already made: the fp32
export of `size_opens.py` (Llama-3.2-1B's shapes, random weights), opened in fresh processes as a replica
opens it (`BatchDecoder`, one row), in alternating rounds, the stamp removed before each "checked" open;
beside them the same open without a form ("own memory": ORT packs into the process, as `quiver serve` alone
does). Open time, the part of it spent reading CRC-32s, peak RSS and private memory after the open. JSON on
stdout.

    python benchmarks/packed_form_opens.py [FOLDER] [--rounds 3]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from quiver.backends.cpu import packed_file
from real_size import _run
from size_models import size_arguments
from size_opens import quiver_export
from timing import alternating_runs

_OPEN = r"""
import json, sys, time
from quiver.backends.cpu import packed_file
from quiver.t2t.batch import BatchDecoder
crc_s = 0.0
file_crc = packed_file._file_crc
def timed(path):
    global crc_s
    start = time.perf_counter()
    try:
        return file_crc(path)
    finally:
        crc_s += time.perf_counter() - start
packed_file._file_crc = timed
start = time.perf_counter()
BatchDecoder.from_config(sys.argv[1], max_batch=1, packed_weights=sys.argv[2] if sys.argv[2] != "-" else None)
open_s = time.perf_counter() - start
lines = [l.split() for l in open("/proc/self/status") if l.startswith(("VmHWM:", "RssAnon:"))]
status = {name.rstrip(":"): int(kb) * 1024 for name, kb, _ in lines}
print(json.dumps({"open_s": open_s, "crc_s": crc_s, "peak_rss_bytes": status["VmHWM"],
                  "private_bytes": status["RssAnon"]}), flush=True)
import os; os._exit(0)
"""


def _open(config: Path, forms: Path | None, drop_stamp: bool = False) -> dict[str, Any]:
    """A replica's open in a fresh process: from the forms under `forms` (None: none, packed in its memory)."""
    if forms is not None and drop_stamp:
        for stamp in forms.glob(f"*/{packed_file.CHECKED}"):
            stamp.unlink()
    return _run(_OPEN, str(config), str(forms or "-"))


def main() -> None:
    args = size_arguments("size-opens", rounds=3)
    config, forms = quiver_export(args.folder, "fp32"), args.folder / "packed-weights"
    made = _open(config, forms)  # makes the form where there is none yet
    time.sleep(packed_file.RACY_CHANGE_S)  # a form checked right after it was written is not stamped
    _open(config, forms)  # checked in full, stamped
    opens = {
        "checked": lambda: _open(config, forms, drop_stamp=True),
        "stamped": lambda: _open(config, forms),
        "own memory": lambda: _open(config, None),
    }
    rounds = alternating_runs(opens, args.rounds, "packed form open")
    keys = ("open_s", "crc_s", "peak_rss_bytes", "private_bytes")
    medians = {n: {key: statistics.median(run[key] for run in runs) for key in keys} for n, runs in rounds.items()}
    form_bytes = sum(f.stat().st_size for f in forms.glob(f"*/{packed_file.WEIGHTS}"))
    print(json.dumps({"form_bytes": form_bytes, "first_open": made, "median": medians, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()

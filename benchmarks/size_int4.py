"""1B and 3B int4 alone (`--only real_size`'s int4 rows, without its exports with adapters and its fp32 side):
Quiver's int4 export of Llama-3.2-1B's shapes beside onnxruntime-genai's int4 and llama.cpp's Q4_0 of the same
weights (open to the first token, prefill / decode, RSS while generating, in alternating rounds), then 3B int4
decoding against the memory bandwidth. Random bf16 weights with the real shapes (benchmarks/size_models.py).
JSON on stdout.

    python benchmarks/size_int4.py [FOLDER] [--rounds 3]
"""

from __future__ import annotations

import json

from real_size import _bandwidth_use, _side_by_side
from size_models import EXPORT_VENV, cached_model, size_arguments
from timing import peers_on_huge_pages


def main() -> None:
    args = size_arguments("size-int4", rounds=3)
    models = {size: cached_model(size) for size in ("1b", "3b")}
    args.folder.mkdir(parents=True, exist_ok=True)
    with peers_on_huge_pages() as tunables:
        result = {
            "glibc_tunables": tunables,
            "1b int4 side by side": _side_by_side(args.folder, models["1b"], EXPORT_VENV, args.rounds, ("int4",)),
            "3b int4 bandwidth": _bandwidth_use(args.folder, models["3b"], args.rounds),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

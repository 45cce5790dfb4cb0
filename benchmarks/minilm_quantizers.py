"""4-bit weights on a real encoder: how close each quantizer keeps MiniLM's sentence embeddings to float.

    python benchmarks/run.py --only minilm_quantizers

all-MiniLM-L6-v2 (the real-model corpus's `minilm.onnx`), `quiver quantize --act-bitwidth 16
--weight-bitwidth 4 --block-size B --quantizer Q` calibrated on the corpus's 16 calibration sentences
(MiniLM's own token ids of real text), judged on its 24 held-out sentences: the cosine between each
sentence's mean-pooled embedding by the float model (ONNX Runtime) and by the quantized one (a Quiver
context, cpu backend); mean and worst. Also the 8-bit per-channel variant (a16w8) for scale.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.real.corpus import held_out_cosines, quantize_a16w4  # noqa: E402

VARIANTS = [("rtn", 32), ("rtn-asym", 32), ("rtn", 16), ("rtn-asym", 16), ("gptq", 16), ("gptq-asym", 32),
            ("gptq-asym", 16)]  # fmt: skip


def measure_minilm_quantizers(corpus: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="quiver-minilm-4bit-") as tmp:
        for quantizer, block in VARIANTS:
            print(f"  minilm a16w4: {quantizer}, blocks of {block}", file=sys.stderr)
            cosines = held_out_cosines(corpus, quantize_a16w4(corpus, Path(tmp), quantizer, block))
            results[f"{quantizer} b{block}"] = {"mean": float(cosines.mean()), "worst": float(cosines.min())}
    return {
        "model": "all-MiniLM-L6-v2, a16w4, 16 calibration sentences, 24 held-out sentences",
        "sentence_cosine_to_float": results,
    }

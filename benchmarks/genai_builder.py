"""onnxruntime-genai's model builder, run as `python -m onnxruntime_genai.models.builder` is, in the corpus's
export venv, with shims for transformers 5's configs, which builder 0.18 reads in transformers 4's
form: it takes the rope's theta from `config.rope_theta` (else 10000: Gemma 3's global layers, 1e6,
came out wrong) where transformers 5 keeps it in `rope_parameters`, and Gemma 3's rope settings flat
(`rope_parameters["rope_type"]`, `rope_local_base_freq`) where transformers 5 writes them per layer type
({"full_attention": {...}, "sliding_attention": {...}}). The shims hand the builder those forms (the
global layers' rope, the local layers' theta); nothing else changes.

    EXPORT_VENV/bin/python benchmarks/genai_builder.py -i MODEL -o OUT -p fp32 -e cpu -c CACHE
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

# this folder's scripts (`quantization.py`...) must not stand in for the builder's own modules of those names
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import onnxruntime_genai.models  # noqa: E402

# the builder imports its parts as top-level modules (`from builders import ...`) from its own folder
sys.path.insert(0, str(Path(onnxruntime_genai.models.__file__).parent))
from builders import base  # type: ignore[import-not-found]  # noqa: E402

_original_init, _original_rope_init = base.Model.__init__, base.Model.make_rope_init


def _init(self, config, *args, **kwargs):  # type: ignore[no-untyped-def]
    """The rope's theta where transformers 5 keeps it (the builder reads `config.rope_theta`, else 10000)."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and not hasattr(config, "rope_theta"):
        config.rope_theta = (rope.get("full_attention") or rope).get("rope_theta", 10000)
    return _original_init(self, config, *args, **kwargs)


def _flat_rope_init(self, config):  # type: ignore[no-untyped-def]
    nested = getattr(config, "rope_parameters", None)
    if not (isinstance(nested, dict) and "full_attention" in nested and "sliding_attention" in nested):
        return _original_rope_init(self, config)
    config.rope_local_base_freq = nested["sliding_attention"]["rope_theta"]
    config.rope_parameters = dict(nested["full_attention"])
    try:
        return _original_rope_init(self, config)
    finally:
        config.rope_parameters = nested


base.Model.__init__, base.Model.make_rope_init = _init, _flat_rope_init

if __name__ == "__main__":
    sys.argv[0] = "onnxruntime_genai.models.builder"
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")

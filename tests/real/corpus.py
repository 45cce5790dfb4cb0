"""What the tests and the benchmarks share about the real-model corpus: outputs, cases, calibration, quantizing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

OUTPUTS = {"minilm": "last_hidden_state", "minilm_tuned": "last_hidden_state", "smollm": "logits"}
QUANTIZED = {  # variant of MiniLM -> `quiver quantize` options besides 16-bit activations
    "a16w8": ["--per-channel"],
    "a16w4": ["--weight-bitwidth", "4", "--block-size", "32"],
}


def case(corpus: Path, name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A model's inputs and torch's output for them (the ground truth)."""
    arrays = dict(np.load(corpus / f"{name}.npz"))
    return arrays, arrays.pop(OUTPUTS[name])


def write_calibration(folder: Path, count: int = 8) -> Path:
    """A QNN input list of inputs that are not the evaluated sentences: seeded token ids of MiniLM's
    vocabulary, in padded batches of two as a tokenizer makes them (padding exercises the attention mask)."""
    rng = np.random.default_rng(5)
    lines = []
    for i in range(count):
        lengths = rng.integers(6, 24, size=2)
        ids = np.zeros((2, int(lengths.max())), np.int64)
        mask = np.zeros_like(ids)
        for row, length in enumerate(lengths):
            ids[row, :length] = np.concatenate([[101], rng.integers(1996, 29000, length - 2), [102]])
            mask[row, :length] = 1
        np.save(folder / f"ids_{i}.npy", ids)
        np.save(folder / f"mask_{i}.npy", mask)
        lines.append(f"input_ids:=ids_{i}.npy attention_mask:=mask_{i}.npy")
    (folder / "calibration.txt").write_text("\n".join(lines) + "\n")
    return folder / "calibration.txt"


def quantize_minilm(corpus: Path, folder: Path) -> dict[str, Path]:
    """MiniLM as each variant of QUANTIZED, by `quiver quantize` (as a user runs it)."""
    calibration = write_calibration(folder)
    made = {}
    for name, options in QUANTIZED.items():
        made[name] = folder / f"minilm_{name}.onnx"
        result = subprocess.run(
            [sys.executable, "-m", "quiver", "quantize", str(corpus / "minilm.onnx"), "-o", str(made[name]),
             "--act-bitwidth", "16", "--input-list", str(calibration), "--quiet", *options],
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"quiver quantize failed for {name}: {result.stderr}")
    return made


def sentences(corpus: Path, kind: str) -> list[np.ndarray]:
    """MiniLM's token ids of the corpus's real sentences, `calibration` or `held_out`, [1, length] each."""
    arrays = np.load(corpus / "minilm_sentences.npz")
    return [arrays[f"{kind}_{i}"] for i in range(sum(name.startswith(f"{kind}_") for name in arrays.files))]


def write_sentence_list(corpus: Path, folder: Path) -> Path:
    """A QNN input list of the calibration sentences, one sample each (its attention mask all ones)."""
    lines = []
    for i, ids in enumerate(sentences(corpus, "calibration")):
        np.save(folder / f"sentence_ids_{i}.npy", ids)
        np.save(folder / f"sentence_mask_{i}.npy", np.ones_like(ids))
        lines.append(f"input_ids:=sentence_ids_{i}.npy attention_mask:=sentence_mask_{i}.npy")
    (folder / "sentences.txt").write_text("\n".join(lines) + "\n")
    return folder / "sentences.txt"


def quantize_a16w4(corpus: Path, folder: Path, quantizer: str, block_size: int) -> Path:
    """MiniLM with 16-bit activations and 4-bit weights by `quantizer`, calibrated on the corpus's
    calibration sentences, by `quiver quantize` (as a user runs it)."""
    out = folder / f"minilm_a16w4_{quantizer}_{block_size}.onnx"
    result = subprocess.run(
        [sys.executable, "-m", "quiver", "quantize", str(corpus / "minilm.onnx"), "-o", str(out), "--act-bitwidth",
         "16", "--weight-bitwidth", "4", "--block-size", str(block_size), "--quantizer", quantizer, "--input-list",
         str(write_sentence_list(corpus, folder)), "--quiet"],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"quiver quantize --quantizer {quantizer} failed: {result.stderr}")
    return out


def held_out_cosines(corpus: Path, model: Path) -> np.ndarray:
    """Per held-out sentence, the cosine between its mean-pooled embedding by the float model (ONNX
    Runtime) and by `model` in a Quiver context (cpu backend)."""
    import onnxruntime as ort

    import quiver

    def feeds(ids: np.ndarray) -> dict[str, np.ndarray]:
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    held_out = sentences(corpus, "held_out")
    float_model = ort.InferenceSession(str(corpus / "minilm.onnx"))
    reference = np.stack([float_model.run(None, feeds(ids))[0][0].mean(axis=0) for ids in held_out])
    with quiver.Context.create("cpu") as context:
        context.add_graph("q", model)
        context.finalize()
        graph = context.graph("q")
        got = np.stack([graph.execute(feeds(ids))["last_hidden_state"][0].mean(axis=0) for ids in held_out])
    return (got * reference).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))

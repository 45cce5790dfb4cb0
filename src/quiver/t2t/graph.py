"""Builds the decoder graph Quiver generates with: ORT's fused LLM operators over a fixed-size KV cache.

One ONNX graph serves as both the prefill graph (any number of new tokens) and the decode graph (one
token): `quiver t2t export` adds it twice with different input shapes, and the context stores its
weights once. The graph is composed from a family's parts (`families.DecoderConfig`): per layer, norms
fused with the residual add where they sit before a block (`SkipSimplifiedLayerNormalization`, or
`SkipLayerNormalization` for layer norms), plain ones after it, q/k/v projections (one MatMul when no
adapter needs them apart), q/k norms, `com.microsoft::GroupQueryAttention` (rotary positions inside it,
per layer, or none on NoPE layers; its scale, soft-cap and sliding window; past and present key/value
are one [1, kv_heads, context, head_dim] buffer the runner binds as both input and output, so a step
writes its new entries in place), a gated or plain MLP, attention and MLP in sequence or in parallel.
Only the last position reaches the final norm and the LM head: logits are [1, 1, vocab].

Projection weights keep their transformers names (`model.layers.N.self_attn.q_proj.weight`, stored
[in, out] for MatMul), so PEFT adapters find their attach points by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from quiver.ir.deferred import Deferred
from quiver.ir.ops import MS_DOMAIN
from quiver.ir.quiver_ops import DECODE_ATTENTION, QUIVER_DOMAIN
from quiver.passes.load import weight_initializer
from quiver.t2t.families import DecoderConfig, Rope
from quiver.t2t.io_names import (  # noqa: F401  (the graph's names, imported from here by its other users)
    BATCH,
    INPUT_IDS,
    LOGITS,
    PAST,
    PRESENT,
    SEQLENS_K,
    TOTAL_LENGTH,
    past_names,
    present_names,
)
from quiver.t2t.rope import rotary_tables

LM_HEAD, LM_HEAD_NODE = "lm_head.weight", "/lm_head/MatMul"
HEAD_ROWS = "lm_head.rows"  # an untied head's float [vocab, hidden] rows, kept beside its quantized copy
OPSET = 21


class _Builder:
    def __init__(
        self, config: DecoderConfig, weight: Callable[[str], Deferred], deferred: dict[str, Deferred] | None
    ) -> None:
        self.config = config
        self.read = weight
        self.deferred = deferred
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._constants: dict[tuple[str, bytes], str] = {}

    def weight(self, name: str, value: np.ndarray | Deferred) -> str:
        self.initializers.append(weight_initializer(name, value, self.deferred))
        return name

    def constant(self, array: np.ndarray) -> str:
        """A small constant, stored once however often it is used."""
        key = (str(array.dtype), array.tobytes() + bytes(str(array.shape), "ascii"))
        if key not in self._constants:
            self._constants[key] = self.weight(f"/constants/{len(self._constants)}", array)
        return self._constants[key]

    def scalar(self, value: float) -> str:
        return self.constant(np.array(value, np.float32))

    def node(self, op: str, inputs: list[str], name: str, domain: str = "", **attrs: Any) -> str:
        output = f"{name}/output_0"
        self.nodes.append(helper.make_node(op, inputs, [output], name=name, domain=domain, **attrs))
        return output

    # --- norms ----------------------------------------------------------------------------------------
    def _norm_weights(self, module: str, size: int) -> tuple[str, str]:
        """The norm's scale (Gemma's 1 + weight folded in; ones for a norm without weights) and bias ("")."""
        c = self.config
        if c.norm_weight:
            name = f"{module}.weight"
            offset = np.float32(c.norm_offset)
            scale = self.weight(name, self.read(name).map(lambda w: w + offset) if offset else self.read(name))
        else:
            scale = self.constant(np.ones(size, np.float32))
        bias = self.weight(f"{module}.bias", self.read(f"{module}.bias")) if c.norm_bias else ""
        return scale, bias

    def norm(self, x: str, module: str, scope: str, size: int, kind: str | None = None) -> str:
        """A norm over the last axis of `x` (`kind`: "rms" or "layer"; the config's by default)."""
        scale, bias = self._norm_weights(module, size)
        eps = self.config.norm_eps
        if (kind or self.config.norm) == "layer":
            inputs = [x, scale] + ([bias] if bias else [])
            return self.node("LayerNormalization", inputs, f"{scope}/LayerNorm", axis=-1, epsilon=eps)
        # RMSNorm from ONNX operators, in the form ORT fuses into its `SimplifiedLayerNormalization` (which
        # has no ONNX schema for a model to name)
        squared = self.node("Pow", [x, self.scalar(2.0)], f"{scope}/Pow")
        mean = self.node("ReduceMean", [squared, self.constant(np.array([-1], np.int64))], f"{scope}/Mean", keepdims=1)
        root = self.node("Sqrt", [self.node("Add", [mean, self.scalar(eps)], f"{scope}/Add")], f"{scope}/Sqrt")
        return self.node("Mul", [self.node("Div", [x, root], f"{scope}/Div"), scale], f"{scope}/Mul")

    def skip_norm(self, residual: str, delta: str, module: str, scope: str) -> tuple[str, str]:
        """norm(residual + delta) and the sum itself (the next residual), in one fused operator."""
        scale, bias = self._norm_weights(module, self.config.hidden)
        normed, total = f"{scope}/output_0", f"{scope}/output_3"
        if self.config.norm == "layer":
            op, inputs = "SkipLayerNormalization", [residual, delta, scale, bias]
        else:
            op, inputs = "SkipSimplifiedLayerNormalization", [residual, delta, scale]
        self.nodes.append(helper.make_node(op, inputs, [normed, "", "", total], name=scope, domain=MS_DOMAIN,
                                           epsilon=self.config.norm_eps))  # fmt: skip
        return normed, total

    # --- blocks ---------------------------------------------------------------------------------------
    def linear(self, x: str, module: str, bias: bool = False, order: np.ndarray | None = None) -> str:
        """x @ the module's weight [in, out] (+ its bias); `order`: the output columns taken in that order."""
        weight = self.read(f"{module}.weight")
        weight = weight if self.config.conv1d else weight.T  # GPT-2's Conv1D holds [in, out] already
        if order is not None:
            weight = weight.take(order, axis=1)
        scope = "/" + module.replace(".", "/")
        y = self.node("MatMul", [x, self.weight(f"{module}.weight", weight)], f"{scope}/MatMul")
        if bias:
            values = self.read(f"{module}.bias")
            values = values.take(order, axis=0) if order is not None else values
            y = self.node("Add", [y, self.weight(f"{module}.bias", values)], f"{scope}/Add")
        return y

    def split(self, x: str, sizes: list[int], scope: str) -> list[str]:
        outputs = [f"{scope}/output_{i}" for i in range(len(sizes))]
        self.nodes.append(helper.make_node("Split", [x, self.constant(np.array(sizes, np.int64))], outputs,
                                           name=scope, axis=-1))  # fmt: skip
        return outputs

    def head_norm(self, x: str, module: str, scope: str, heads: int) -> str:
        """A norm over each head's dimensions of a [.., heads * head_dim] projection."""
        d = self.config.head_dim
        split = self.node("Reshape", [x, self.constant(np.array([0, 0, heads, d], np.int64))], f"{scope}/Split")
        normed = self.norm(split, module, scope, d, "rms")  # every family's q/k norms are RMS norms
        return self.node("Reshape", [normed, self.constant(np.array([0, 0, heads * d], np.int64))], f"{scope}/Merge")

    def activation(self, x: str, scope: str) -> str:
        kind = self.config.activation
        if kind == "silu":
            return self.node("Mul", [x, self.node("Sigmoid", [x], f"{scope}/Sigmoid")], f"{scope}/Mul")
        if kind == "gelu_tanh":
            return self.node("FastGelu", [x], f"{scope}/FastGelu", domain=MS_DOMAIN)
        return self.node("Gelu", [x], f"{scope}/Gelu", domain=MS_DOMAIN)


def build_decoder(
    config: DecoderConfig,
    weight: Callable[[str], Deferred],
    context_size: int,
    fuse_qkv: bool = False,
    head_as_matmul: bool = False,
    batched: bool = False,
    head_rows: bool = False,
    fuse_gate_up: bool = False,
    deferred: dict[str, Deferred] | None = None,
) -> onnx.ModelProto:
    """The decoder as one ONNX graph; `weight(name)` returns a checkpoint tensor as float32, deferred.

    `fuse_qkv`: one MatMul by the q, k and v weights side by side, fed to attention packed (as
    onnxruntime-genai does); without it each projection keeps a MatMul of its own, where adapters attach.
    A checkpoint that holds them fused already (`config.qkv`) keeps its one projection either way.
    `fuse_gate_up`: the MLP's gate and up projections one MatMul too, its result split in two.
    `head_as_matmul`: the LM head as a MatMul by its own [hidden, vocab] copy (`LM_HEAD`), which weight
    quantization can turn into MatMulNBits; otherwise a tied head multiplies by the embedding itself.
    `batched`: a dynamic batch dimension (`BATCH`) instead of 1 on the tokens, the cache and the logits:
    each row is one sequence with its own length (`seqlens_k` per row), as `quiver serve` decodes them.
    `head_rows`: an untied head's float rows kept too (`HEAD_ROWS`), for a shortlist head to rescore with
    (a tied head's are the embedding).
    `deferred`: the large weights are placeholders, their values added to it, made when the context
    stores them (a streaming export: one tensor in memory at a time); without it every weight is in the
    model.
    """
    c = config
    b = _Builder(c, weight, deferred)
    tables: dict[str, tuple[str, str]] = {}  # by the rope's repr: one pair of tables per distinct rope

    def rope_inputs(rope: Rope | None) -> tuple[str, str]:
        if rope is None:
            return "", ""
        key = repr(rope)
        if key not in tables:
            cos, sin = rotary_tables(rope, context_size, c.max_positions)
            suffix = "" if not tables else f".{len(tables)}"
            tables[key] = (b.weight(f"cos_cache{suffix}", cos), b.weight(f"sin_cache{suffix}", sin))
        return tables[key]

    embedding = b.weight(f"{c.embedding}.weight", weight(f"{c.embedding}.weight"))
    hidden = b.node("Gather", [embedding, INPUT_IDS], "/model/embed_tokens/Gather")
    if c.embed_scale != 1.0:
        hidden = b.node("Mul", [hidden, b.scalar(c.embed_scale)], "/model/embed_tokens/Scale")
    if c.positions is not None:  # learned absolute positions: each row's tokens sit after its cached ones
        table = b.weight(f"{c.positions}.weight", weight(f"{c.positions}.weight"))
        one, zero = b.constant(np.array(1, np.int64)), b.constant(np.array(0, np.int64))
        shape = b.node("Shape", [INPUT_IDS], "/model/positions/Shape")
        count = b.node("Gather", [shape, one], "/model/positions/Count")
        total = b.node("Add", [b.node("Cast", [SEQLENS_K], "/model/positions/Cast", to=TensorProto.INT64), one],
                       "/model/positions/Total")  # fmt: skip
        start = b.node("Sub", [total, count], "/model/positions/Start")
        steps = b.node("Range", [zero, count, one], "/model/positions/Range")
        column = b.node("Unsqueeze", [start, b.constant(np.array([1], np.int64))], "/model/positions/Column")
        positions = b.node("Add", [column, steps], "/model/positions/Ids")
        learned = b.node("Gather", [table, positions], "/model/positions/Gather")
        hidden = b.node("Add", [hidden, learned], "/model/positions/Add")
    residual, delta = hidden, ""

    def enter(module: str | None, scope: str) -> str:
        """The input of a block: norm(residual + delta), the sum becoming the residual (or the sum alone)."""
        nonlocal residual, delta
        if module is None:
            if delta:
                residual, delta = b.node("Add", [residual, delta], f"{scope}/Add"), ""
            return residual
        if delta:
            normed, residual = b.skip_norm(residual, delta, module, scope)
            delta = ""
            return normed
        return b.norm(residual, module, scope, c.hidden)

    def leave(y: str, module: str | None, scope: str) -> str:
        """A block's output as it joins the residual: its norm after (if any) and the residual's scale."""
        if module is not None:
            y = b.norm(y, module, scope, c.hidden)
        if c.residual_scale != 1.0:
            y = b.node("Mul", [y, b.scalar(c.residual_scale)], f"{scope}/ResidualScale")
        return y

    q_size, kv_size = c.heads * c.head_dim, c.kv_heads * c.head_dim
    per_head_order = None  # GPT-NeoX's fused rows, head by head q, k, v: taken as all q, all k, all v
    if c.qkv_layout == "per_head":
        per_head_order = np.arange(3 * q_size).reshape(c.heads, 3, c.head_dim).transpose(1, 0, 2).reshape(-1)
    qkv_biased = {"q", "k", "v"} <= c.biases
    separable = c.qk_norm is None and c.clip_qkv is None  # q, k, v may reach attention packed
    fuse_qkv = fuse_qkv and separable and (qkv_biased or not {"q", "k", "v"} & c.biases)

    def attention(x: str, layer: int, scope: str) -> str:
        module = lambda name: c.module(layer, name)  # noqa: E731
        if c.qkv is not None or fuse_qkv:
            if c.qkv is not None:
                packed = b.linear(x, module(c.qkv), "qkv" in c.biases or qkv_biased, per_head_order)
            else:
                names = [module(n) for n in (c.q, c.k, c.v)]
                qkv = Deferred.concat([weight(f"{n}.weight") for n in names]).T
                w = b.weight(module("self_attn.qkv_proj.weight"), qkv)
                packed = b.node("MatMul", [x, w], f"{scope}/self_attn/qkv_proj/MatMul")
                if qkv_biased:
                    biases = Deferred.concat([weight(f"{n}.bias") for n in names])
                    bias = b.weight(module("self_attn.qkv_proj.bias"), biases)
                    packed = b.node("Add", [packed, bias], f"{scope}/self_attn/qkv_proj/Add")
            if separable:
                q, k, v = packed, "", ""
            else:
                q, k, v = b.split(packed, [q_size, kv_size, kv_size], f"{scope}/self_attn/qkv_split")
        else:
            q, k, v = (b.linear(x, module(n), p in c.biases) for n, p in ((c.q, "q"), (c.k, "k"), (c.v, "v")))
        if c.clip_qkv is not None:
            low, high = b.scalar(-c.clip_qkv), b.scalar(c.clip_qkv)
            q, k, v = (
                b.node("Clip", [t, low, high], f"{scope}/self_attn/clip_{n}") for t, n in ((q, "q"), (k, "k"), (v, "v"))
            )
        if c.qk_norm == "head":
            q = b.head_norm(q, module("self_attn.q_norm"), f"{scope}/self_attn/q_norm", c.heads)
            k = b.head_norm(k, module("self_attn.k_norm"), f"{scope}/self_attn/k_norm", c.kv_heads)
        elif c.qk_norm == "full":
            q = b.norm(q, module("self_attn.q_norm"), f"{scope}/self_attn/q_norm", q_size, "rms")
            k = b.norm(k, module("self_attn.k_norm"), f"{scope}/self_attn/k_norm", kv_size, "rms")
        kind = c.layer_kinds[layer]
        cos, sin = rope_inputs(kind.rope)
        past_key, past_value = past_names(layer)
        name = f"{scope}/self_attn/GroupQueryAttention"
        attrs: dict[str, Any] = {
            "num_heads": c.heads,
            "kv_num_heads": c.kv_heads,
            "scale": float(c.attention_scale),
            "do_rotary": int(kind.rope is not None),
            "rotary_interleaved": int(kind.rope is not None and kind.rope.interleaved),
            # ORT's local window is transformers' sliding_window, the same count of keys (tests/integration/
            # test_families.py holds the two to the same tokens past the window)
            "local_window_size": kind.window if kind.window is not None else -1,
        }
        if c.softcap:
            attrs["softcap"] = float(c.softcap)
        b.nodes.append(helper.make_node(
            "GroupQueryAttention", [q, k, v, past_key, past_value, SEQLENS_K, TOTAL_LENGTH, cos, sin],
            [f"{name}/output_0", *present_names(layer)], name=name, domain=MS_DOMAIN, **attrs,
        ))  # fmt: skip
        return b.linear(f"{name}/output_0", module(c.o), "o" in c.biases)

    def experts(x: str, layer: int, scope: str) -> str:
        """ORT's MoE operator: the router's logits in, the experts' gate and up rows interleaved (the one
        SwiGLU layout its CPU kernel takes), each expert's weights [out, in] as the checkpoint holds them."""
        moe = c.moe
        assert moe is not None
        module = lambda name: c.module(layer, name)  # noqa: E731
        # the operator takes tokens as rows: [tokens, hidden] and [tokens, experts], then the shape back
        rows = b.node("Reshape", [x, b.constant(np.array([-1, c.hidden], np.int64))], f"{scope}/mlp/Rows")
        router = b.linear(rows, module(moe.router))

        def part(e: int, which: int) -> Deferred:
            return weight(module(moe.expert.format(e=e, part=moe.names[which])) + ".weight")

        fc1 = Deferred.stack([Deferred.stack([part(e, 0), part(e, 1)], axis=1).reshape(2 * moe.intermediate, c.hidden)
                              for e in range(moe.experts)])  # fmt: skip
        fc2 = Deferred.stack([part(e, 2) for e in range(moe.experts)])
        w1, w2 = b.weight(module("mlp.experts.fc1"), fc1), b.weight(module("mlp.experts.fc2"), fc2)
        y = b.node("MoE", [rows, router, w1, "", w2], f"{scope}/mlp/MoE", domain=MS_DOMAIN, k=moe.top_k,
                   activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                   swiglu_limit=float("inf"), normalize_routing_weights=int(moe.normalize))  # fmt: skip
        y = b.node("Reshape", [y, b.node("Shape", [x], f"{scope}/mlp/Shape")], f"{scope}/mlp/Unrows")
        if moe.shared is None or moe.shared_gate is None:
            return y
        shared = gated_mlp(x, module(f"{moe.shared}.gate_proj"), module(f"{moe.shared}.up_proj"),
                           module(f"{moe.shared}.down_proj"), f"{scope}/mlp/shared_expert")  # fmt: skip
        gate = b.node("Sigmoid", [b.linear(x, module(moe.shared_gate))], f"{scope}/mlp/shared_expert_gate/Sigmoid")
        return b.node("Add", [y, b.node("Mul", [shared, gate], f"{scope}/mlp/shared/Mul")], f"{scope}/mlp/Add")

    def gated_mlp(x: str, gate_module: str, up_module: str, down_module: str, scope: str) -> str:
        gate, up = b.linear(x, gate_module, c.mlp_bias), b.linear(x, up_module, c.mlp_bias)
        product = b.node("Mul", [b.activation(gate, f"{scope}/act"), up], f"{scope}/Mul")
        return b.linear(product, down_module, c.mlp_bias)

    def mlp(x: str, layer: int, scope: str) -> str:
        module = lambda name: c.module(layer, name)  # noqa: E731
        if c.moe is not None and layer in c.moe.layers:
            return experts(x, layer, scope)
        if not c.gated:
            up = b.linear(x, module(c.up), c.mlp_bias)
            return b.linear(b.activation(up, f"{scope}/mlp/act"), module(c.down), c.mlp_bias)
        if c.gate_up is not None:
            both = b.linear(x, module(c.gate_up), c.mlp_bias)
            gate, up = b.split(both, [c.intermediate, c.intermediate], f"{scope}/mlp/Split")
        elif fuse_gate_up and not c.mlp_bias:
            names = [module(f"{n}.weight") for n in (c.gate, c.up)]
            w = b.weight(module("mlp.gate_up_proj.weight"), Deferred.concat([weight(n) for n in names]).T)
            both = b.node("MatMul", [x, w], f"{scope}/mlp/gate_up_proj/MatMul")
            gate, up = b.split(both, [c.intermediate, c.intermediate], f"{scope}/mlp/Split")
        else:
            return gated_mlp(x, module(c.gate), module(c.up), module(c.down), f"{scope}/mlp")
        product = b.node("Mul", [b.activation(gate, f"{scope}/mlp/act"), up], f"{scope}/mlp/Mul")
        return b.linear(product, module(c.down), c.mlp_bias)

    for layer in range(c.layers):
        scope = f"/model/layers.{layer}"
        if c.parallel:
            x = enter(c.attn_in_norm and c.module(layer, c.attn_in_norm), f"{scope}/input_layernorm")
            attended = attention(x, layer, scope)
            mlp_in = x if c.mlp_in_norm is None else b.norm(residual, c.module(layer, c.mlp_in_norm),
                                                             f"{scope}/post_attention_layernorm", c.hidden)  # fmt: skip
            delta = b.node("Add", [leave(attended, c.attn_out_norm and c.module(layer, c.attn_out_norm),
                                         f"{scope}/attn_out"),
                                   leave(mlp(mlp_in, layer, scope), c.mlp_out_norm and c.module(layer, c.mlp_out_norm),
                                         f"{scope}/mlp_out")], f"{scope}/parallel/Add")  # fmt: skip
            continue
        x = enter(c.attn_in_norm and c.module(layer, c.attn_in_norm), f"{scope}/input_layernorm")
        attended = attention(x, layer, scope)
        delta = leave(attended, c.attn_out_norm and c.module(layer, c.attn_out_norm), f"{scope}/attn_out_norm")
        x = enter(c.mlp_in_norm and c.module(layer, c.mlp_in_norm), f"{scope}/post_attention_layernorm")
        delta = leave(mlp(x, layer, scope), c.mlp_out_norm and c.module(layer, c.mlp_out_norm), f"{scope}/mlp_out_norm")

    bounds = [b.constant(np.array([v], np.int64)) for v in (-1, 2**62, 1)]

    def last_position(x: str, name: str) -> str:
        return b.node("Slice", [x, *bounds], f"/model/last_position/{name}")

    # only the last position goes on: the final norm (with the last residual add) and the LM head
    final, _ = b.skip_norm(last_position(residual, "residual"), last_position(delta, "delta"), c.final_norm,
                           "/model/norm")  # fmt: skip
    head_weight = f"{c.embedding}.weight" if c.tie_embeddings else f"{c.head}.weight"
    post = c.head_bias or c.logit_scale != 1.0 or bool(c.final_softcap)  # what follows the head's product
    logits = "/lm_head/output_0" if post else LOGITS
    if head_as_matmul:
        head = b.weight(LM_HEAD, weight(head_weight).T)
        if head_rows and not c.tie_embeddings:
            b.weight(HEAD_ROWS, weight(head_weight))
        b.nodes.append(helper.make_node("MatMul", [final, head], [logits], name=LM_HEAD_NODE))
    else:  # [vocab, hidden] as stored (transB): a tied head reuses the embedding itself, no copy
        head = embedding if c.tie_embeddings else b.weight(head_weight, weight(head_weight))
        b.nodes.append(helper.make_node("FusedMatMul", [final, head], [logits], name=LM_HEAD_NODE, domain=MS_DOMAIN,
                                        transB=1, alpha=1.0))  # fmt: skip
    if c.head_bias:
        logits = b.node("Add", [logits, b.weight(f"{c.head}.bias", weight(f"{c.head}.bias"))], "/lm_head/Add")
    if c.logit_scale != 1.0:
        logits = b.node("Mul", [logits, b.scalar(c.logit_scale)], "/lm_head/Scale")
    if c.final_softcap:
        capped = b.node("Tanh", [b.node("Div", [logits, b.scalar(c.final_softcap)], "/lm_head/cap/Div")],
                        "/lm_head/cap/Tanh")  # fmt: skip
        logits = b.node("Mul", [capped, b.scalar(c.final_softcap)], "/lm_head/cap/Mul")
    if post:
        b.nodes.append(helper.make_node("Identity", [logits], [LOGITS], name="/lm_head/logits"))

    rows: int | str = BATCH if batched else 1
    kv_shape = [rows, c.kv_heads, context_size, c.head_dim]
    inputs = [
        helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, [rows, "sequence"]),
        helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, [rows]),
        helper.make_tensor_value_info(TOTAL_LENGTH, TensorProto.INT32, []),
    ]
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [rows, 1, c.vocab])]
    for layer in range(c.layers):
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in past_names(layer)]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in present_names(layer)]
    graph = helper.make_graph(b.nodes, "decoder", inputs, outputs, b.initializers)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)], ir_version=10
    )


# what DecodeAttention's kernel computes of GroupQueryAttention (a node with more stays ORT's)
_DECODE_ATTENTION_ATTRIBUTES = {
    "num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved", "local_window_size", "softcap",
}  # fmt: skip


def decode_step_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """A decode step's graph of `model` (a copy: its weights are placeholders, cheap): each
    GroupQueryAttention as Quiver's DecodeAttention, the same inputs and attributes, whose kernel reads a
    layer's keys and values once for a step's one row (ORT's packs them for a GEMM at every step; a
    backend without the kernel runs ORT's operator in its place)."""
    step = type(model)()
    step.CopyFrom(model)
    for node in step.graph.node:
        known = {a.name for a in node.attribute} <= _DECODE_ATTENTION_ATTRIBUTES and len(node.input) <= 9
        if node.domain == MS_DOMAIN and node.op_type == "GroupQueryAttention" and known:
            node.domain, node.op_type = QUIVER_DOMAIN, DECODE_ATTENTION
    if not any(o.domain == QUIVER_DOMAIN for o in step.opset_import):
        step.opset_import.append(helper.make_opsetid(QUIVER_DOMAIN, 1))
    return step

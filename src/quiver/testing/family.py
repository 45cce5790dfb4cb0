"""Seeded, in-process transformer families (a base plus fine-tunes) for the demo, tests and benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quiver.lora.attach import NAME_SCOPES

OPSET = 17


@dataclass(frozen=True)
class TransformerShape:
    """Size of a BERT-like encoder; the defaults make a model of a few MB."""

    vocab: int = 1000
    hidden: int = 128
    heads: int = 4
    ffn: int = 512
    layers: int = 2
    max_positions: int = 128

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")


SMALL = TransformerShape()
# About 60 MB of float32 weights: the benchmark family.
BENCH = TransformerShape(vocab=8000, hidden=512, heads=8, ffn=2048, layers=4, max_positions=512)


class _Builder:
    """Accumulates nodes and initializers; names weights the way the dynamo exporter does (`val_N`)."""

    def __init__(self, rename_offset: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._counter = rename_offset

    def weight(self, array: np.ndarray) -> str:
        name = f"val_{self._counter}"
        self._counter += 1
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def named_weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def const(self, values: list[int] | list[float], dtype: type = np.int64) -> str:
        return self.weight(np.asarray(values, dtype=dtype))

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs: Any) -> list[str]:
        outputs = [f"t{len(self.nodes)}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, **attrs))
        return outputs

    def op1(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        return self.op(op_type, inputs, 1, **attrs)[0]


def _layer_weights(rng: np.random.Generator, shape: TransformerShape) -> dict[str, np.ndarray]:
    d, f = shape.hidden, shape.ffn
    scale = 1.0 / math.sqrt(d)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def vec(n: int, base: float = 0.0) -> np.ndarray:
        return (base + 0.02 * rng.standard_normal(n)).astype(np.float32)

    return {
        "ln1_g": vec(d, 1.0),
        "ln1_b": vec(d),
        "wq": mat(d, d),
        "bq": vec(d),
        "wk": mat(d, d),
        "bk": vec(d),
        "wv": mat(d, d),
        "bv": vec(d),
        "wo": mat(d, d),
        "bo": vec(d),
        "ln2_g": vec(d, 1.0),
        "ln2_b": vec(d),
        "w1": mat(d, f),
        "b1": vec(f),
        "w2": (mat(f, d) * math.sqrt(d / f)).astype(np.float32),
        "b2": vec(d),
    }


def family_weights(shape: TransformerShape, seed: int = 0) -> dict[str, object]:
    """Base weights: embeddings plus one dict per layer."""
    rng = np.random.default_rng(seed)
    return {
        "tok": (rng.standard_normal((shape.vocab, shape.hidden)) * 0.1).astype(np.float32),
        "pos": (rng.standard_normal((shape.max_positions, shape.hidden)) * 0.1).astype(np.float32),
        "layers": [_layer_weights(rng, shape) for _ in range(shape.layers)],
        "lnf_g": np.ones(shape.hidden, np.float32),
        "lnf_b": np.zeros(shape.hidden, np.float32),
    }


def fine_tune(weights: dict[str, object], layers: list[int], seed: int) -> dict[str, object]:
    """A copy of `weights` whose listed layers are perturbed: what a partial fine-tune changes."""
    rng = np.random.default_rng(seed)
    base_layers = weights["layers"]
    assert isinstance(base_layers, list)
    tuned = dict(weights)
    tuned["layers"] = [
        {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in layer.items()}
        if i in layers
        else layer
        for i, layer in enumerate(base_layers)
    ]
    return tuned


LORA_PREFIX = "lora_"


def build_model(
    shape: TransformerShape,
    weights: dict[str, object],
    name: str = "encoder",
    rename_offset: int = 0,
    lora_rank: int = 0,
) -> onnx.ModelProto:
    """An encoder graph as `torch.onnx` would export it: input_ids [batch, seq] -> last_hidden_state.

    With `lora_rank`, every linear layer gets a LoRA branch (x·A·B added to its output) whose weights,
    named `lora_A_<layer>_<proj>` / `lora_B_...`, start at zero: mark them updateable to swap adapters.
    """
    b = _Builder(rename_offset)
    d, h = shape.hidden, shape.heads
    head_dim = d // h

    ids = "input_ids"
    x = b.op1("Gather", [b.weight(weights["tok"]), ids])  # type: ignore[arg-type]
    seq_len = b.op1("Gather", [b.op1("Shape", [ids]), b.const([1])])
    positions = b.op1(
        "Range", [b.weight(np.array(0, np.int64)), b.op1("Squeeze", [seq_len]), b.weight(np.array(1, np.int64))]
    )
    x = b.op1("Add", [x, b.op1("Gather", [b.weight(weights["pos"]), positions])])  # type: ignore[arg-type]

    split_heads = b.const([0, 0, h, head_dim])
    merge_heads = b.const([0, 0, d])
    sqrt2 = b.weight(np.array(math.sqrt(2.0), np.float32))
    one = b.weight(np.array(1.0, np.float32))
    half = b.weight(np.array(0.5, np.float32))
    attn_scale = b.weight(np.array(1.0 / math.sqrt(head_dim), np.float32))

    layers = weights["layers"]
    assert isinstance(layers, list)
    for layer_index, w in enumerate(layers):
        ln = b.op1("LayerNormalization", [x, b.weight(w["ln1_g"]), b.weight(w["ln1_b"])], axis=-1, epsilon=1e-5)

        def linear(x_in: str, weight: np.ndarray, bias: np.ndarray, tag: str) -> str:
            y = b.op1("MatMul", [x_in, b.weight(weight)])
            # the module path, as the dynamo exporter records it: LoRA attach points are found by it
            module = f"layers.{tag.replace('_', '.', 1)}"
            scopes = ["", module.rsplit(".", 1)[0], module, "linear"]
            b.nodes[-1].metadata_props.add(key=NAME_SCOPES, value=repr(scopes))
            if lora_rank:
                a = b.named_weight(f"{LORA_PREFIX}A_{tag}", np.zeros((weight.shape[0], lora_rank), np.float32))
                lb = b.named_weight(f"{LORA_PREFIX}B_{tag}", np.zeros((lora_rank, weight.shape[1]), np.float32))
                y = b.op1("Add", [y, b.op1("MatMul", [b.op1("MatMul", [x_in, a]), lb])])
            return b.op1("Add", [y, b.weight(bias)])

        def heads(x_in: str, weight: np.ndarray, bias: np.ndarray, perm: list[int], tag: str) -> str:
            y = linear(x_in, weight, bias, tag)
            return b.op1("Transpose", [b.op1("Reshape", [y, split_heads])], perm=perm)

        q = heads(ln, w["wq"], w["bq"], [0, 2, 1, 3], f"{layer_index}_q")
        k = heads(ln, w["wk"], w["bk"], [0, 2, 3, 1], f"{layer_index}_k")
        v = heads(ln, w["wv"], w["bv"], [0, 2, 1, 3], f"{layer_index}_v")
        scores = b.op1("Mul", [b.op1("MatMul", [q, k]), attn_scale])
        ctx = b.op1("MatMul", [b.op1("Softmax", [scores], axis=-1), v])
        ctx = b.op1("Reshape", [b.op1("Transpose", [ctx], perm=[0, 2, 1, 3]), merge_heads])
        attn = linear(ctx, w["wo"], w["bo"], f"{layer_index}_o")
        x = b.op1("Add", [x, attn])

        ln = b.op1("LayerNormalization", [x, b.weight(w["ln2_g"]), b.weight(w["ln2_b"])], axis=-1, epsilon=1e-5)
        up = linear(ln, w["w1"], w["b1"], f"{layer_index}_up")
        # Gelu as torch exports it (erf form), so that older opsets run it too.
        gelu = b.op1("Mul", [b.op1("Mul", [up, half]), b.op1("Add", [b.op1("Erf", [b.op1("Div", [up, sqrt2])]), one])])
        down = linear(gelu, w["w2"], w["b2"], f"{layer_index}_down")
        x = b.op1("Add", [x, down])

    out = b.op1(
        "LayerNormalization",
        [x, b.weight(weights["lnf_g"]), b.weight(weights["lnf_b"])],  # type: ignore[arg-type]
        axis=-1,
        epsilon=1e-5,
    )
    b.nodes.append(helper.make_node("Identity", [out], ["last_hidden_state"]))

    graph = helper.make_graph(
        b.nodes,
        name,
        [helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", d])],
        initializer=b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="quiver-family")
    model.ir_version = 8
    return model


def make_family(
    shape: TransformerShape = SMALL, count: int = 3, tuned_layers: int = 1, seed: int = 0
) -> dict[str, onnx.ModelProto]:
    """A base model plus `count - 1` fine-tunes that differ from it in the last `tuned_layers` layers.

    Every model names its weights differently (as exporters do), so sharing must go by content.
    """
    base = family_weights(shape, seed)
    tuned = list(range(max(0, shape.layers - tuned_layers), shape.layers))
    models = {"base": build_model(shape, base, "base", rename_offset=0)}
    for i in range(1, count):
        variant = fine_tune(base, tuned, seed=seed * 1000 + i)
        models[f"finetune_{i}"] = build_model(shape, variant, f"finetune_{i}", rename_offset=1000 * i)
    return models


def sample_input_ids(shape: TransformerShape, batch: int = 1, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, shape.vocab, size=(batch, seq), dtype=np.int64)

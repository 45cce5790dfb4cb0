"""A small Llama-like chain of projections as torch.onnx (dynamo) exports it, PEFT adapter folders for it
(written with numpy + safetensors, as PEFT lays them out), and a LoRA project (YAML + folders) over both."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

from quiver.lora.attach import NAME_SCOPES, find_attach_points
from quiver.lora.create import create_lora_graph, slot_ranks
from quiver.lora.peft import PeftAdapter, load_peft_adapter

MODULES = {  # module path -> (in, out), a small Llama's attention projections
    "model.layers.0.self_attn.q_proj": (16, 16),
    "model.layers.0.self_attn.v_proj": (16, 8),
    "model.layers.1.self_attn.q_proj": (16, 16),
    "model.layers.1.self_attn.v_proj": (16, 8),
}


def write_adapter(
    folder: Path,
    config: dict,
    ranks: dict[str, int] | None = None,
    seed: int = 0,
    modules: dict[str, tuple[int, int]] = MODULES,
) -> Path:
    """A PEFT LoRA adapter folder: adapter_config.json + adapter_model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        r = (ranks or {}).get(module, config["r"])
        tensors[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((r, fan_in)).astype(np.float32)
        tensors[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((fan_out, r)).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return folder


CHAIN = [  # module, in, out: a Llama-like stack of projections joined by Tanh
    ("model.layers.0.self_attn.q_proj", 16, 16),
    ("model.layers.0.self_attn.v_proj", 16, 16),
    ("model.layers.1.self_attn.q_proj", 16, 16),
    ("model.layers.1.self_attn.v_proj", 16, 8),
]


BASE_WEIGHTS = {
    m: np.random.default_rng(i).standard_normal((i_, o)).astype(np.float32) * 0.3 for i, (m, i_, o) in enumerate(CHAIN)
}


def dynamo_linear(x: str, weight: str, output: str, module: str) -> onnx.NodeProto:
    """A linear as torch.onnx (dynamo) exports it: MatMul by a renamed [in, out] weight, module path in metadata."""
    node = helper.make_node("MatMul", [x, weight], [output], name=f"node_{output}")
    scopes = ["", *[".".join(module.split(".")[:k]) for k in range(1, module.count(".") + 2)], output]
    node.metadata_props.add(key=NAME_SCOPES, value=repr(scopes))
    return node


def _chain_model(name: str, nodes: list, initializers: list, out_features: int) -> onnx.ModelProto:
    """x [n, 16] -> y [n, out_features]."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", out_features])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def dynamo_like_model(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The CHAIN of linears joined by Tanh."""
    nodes, initializers, x = [], [], "x"
    for i, (module, _, _) in enumerate(CHAIN):
        nodes.append(dynamo_linear(x, f"val_{10 + i}", f"linear_{i}", module))
        initializers.append(numpy_helper.from_array(weights[module], f"val_{10 + i}"))
        x = f"linear_{i}"
        if i < len(CHAIN) - 1:
            nodes.append(helper.make_node("Tanh", [x], [f"tanh_{i}"], name=f"tanh_{i}"))
            x = f"tanh_{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    return _chain_model("llama_like", nodes, initializers, 8)


def merged(adapters: dict[str, PeftAdapter], active: dict[str, float]) -> onnx.ModelProto:
    """The exact math: W + Σ αᵢ·sᵢ·(Bᵢ·Aᵢ)ᵀ per module."""
    weights = {m: w.copy() for m, w in BASE_WEIGHTS.items()}
    for name, alpha in active.items():
        for module, lora in adapters[name].modules.items():
            weights[module] += alpha * lora.delta().T
    return dynamo_like_model(weights)


ORDER = ["elementary", "long"]


YAML = """
adapter:
- name: elementary
  lora_config: elementary
- name: long
  lora_config: long
use-case:
- name: base
  adapter_names: []
  model_name: base/model.onnx
- name: elementary
  adapter_names: [elementary]
- name: elementary_long
  adapter_names: [elementary, long]
  adapter_alphas: [1.0, 0.5]
"""


LORA_X = np.random.default_rng(11).standard_normal((4, 16)).astype(np.float32)


def make_project(root: Path) -> Path:
    """A base model, two PEFT adapters and the YAML, in `root`."""
    (root / "base").mkdir()
    onnx.save(dynamo_like_model(BASE_WEIGHTS), str(root / "base" / "model.onnx"))
    modules = {m: (i, o) for m, i, o in CHAIN}
    write_adapter(
        root / "elementary", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, seed=1, modules=modules
    )
    write_adapter(
        root / "long",
        {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]},
        seed=2,
        modules={m: s for m, s in modules.items() if m.endswith("q_proj")},
    )
    (root / "lora.yaml").write_text(YAML)
    return root


def expected_output(project: Path, strengths: dict[str, float]) -> np.ndarray:
    adapters = {n: load_peft_adapter(project / n, n) for n in ("elementary", "long")}
    model = merged(adapters, {name: value for name, value in strengths.items() if value})
    return ort.InferenceSession(model.SerializeToString()).run(None, {"x": LORA_X})[0]


def lora_graph_of(adapters: dict[str, PeftAdapter], base: onnx.ModelProto) -> tuple[onnx.ModelProto, list]:
    modules = sorted({m for a in adapters.values() for m in a.modules})
    points, missing = find_attach_points(base, modules)
    assert missing == []
    use_cases = {name: [name] for name in adapters} | {"all": list(adapters)}
    return create_lora_graph(base, points, slot_ranks(adapters, use_cases), len(adapters))


def peft_export(adapters: dict[str, PeftAdapter], active: list[str], names: str = "dynamo") -> onnx.ModelProto:
    """The CHAIN with PEFT's LoRA layers of the `active` adapters attached, as exporting a PEFT model gives
    it: per adapted module and adapter, MatMul by Aᵀ, MatMul by Bᵀ, Mul by the scaling, Add to the base
    output. `names`: "dynamo" renames weights and records `<module>.lora_A.<adapter>` in name scopes;
    "torchscript" keeps PEFT's parameter names as the weights' names."""
    nodes, initializers, x = [], [], "x"
    for i, (module, _, _) in enumerate(CHAIN):
        nodes.append(dynamo_linear(x, f"val_{10 + i}", f"base_{i}", module))
        initializers.append(numpy_helper.from_array(BASE_WEIGHTS[module], f"val_{10 + i}"))
        total = f"base_{i}"
        for name in active:
            lora = adapters[name].modules.get(module)
            if lora is None:
                continue
            tag = f"{i}_{name}"
            for which, weight in (("A", lora.lora_a.T), ("B", lora.lora_b.T)):
                scope = f"{module}.lora_{which}.{name}"
                stored = f"base_model.model.{scope}.weight" if names == "torchscript" else f"val_{which}_{tag}"
                source = x if which == "A" else f"down_{tag}"
                output = f"down_{tag}" if which == "A" else f"up_{tag}"
                nodes.append(dynamo_linear(source, stored, output, scope))
                initializers.append(numpy_helper.from_array(np.ascontiguousarray(weight), stored))
            initializers.append(numpy_helper.from_array(np.array(lora.scaling, np.float32), f"scaling_{tag}"))
            nodes.append(helper.make_node("Mul", [f"up_{tag}", f"scaling_{tag}"], [f"scaled_{tag}"]))
            nodes.append(helper.make_node("Add", [total, f"scaled_{tag}"], [f"sum_{tag}"]))
            total = f"sum_{tag}"
        x = total
        if i < len(CHAIN) - 1:
            nodes.append(helper.make_node("Tanh", [x], [f"tanh_{i}"], name=f"tanh_{i}"))
            x = f"tanh_{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    return _chain_model("llama_like_lora", nodes, initializers, 8)

"""PEFT adapter folders (written here with numpy + safetensors, as PEFT lays them out) and attach points."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors.numpy import save_file

import quiver
from quiver.lora.attach import find_attach_points
from quiver.lora.peft import load_peft_adapter
from tests.support import FIXTURES  # noqa: E402
from tests.support.peft_models import MODULES, write_adapter

BASIC = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_a_peft_folder_reads_into_modules_with_peft_scaling(tmp_path: Path) -> None:
    adapter = load_peft_adapter(write_adapter(tmp_path / "elementary", BASIC))
    assert adapter.name == "elementary"
    assert sorted(adapter.modules) == sorted(MODULES)
    q = adapter.modules["model.layers.0.self_attn.q_proj"]
    assert (q.rank, q.scaling, q.lora_a.shape, q.lora_b.shape) == (4, 2.0, (4, 16), (16, 4))
    np.testing.assert_allclose(q.delta(), 2.0 * q.lora_b @ q.lora_a, rtol=1e-6)


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path: Path) -> None:
    adapter = load_peft_adapter(write_adapter(tmp_path / "a", {**BASIC, "use_rslora": True}))
    assert adapter.modules["model.layers.1.self_attn.v_proj"].scaling == pytest.approx(8 / math.sqrt(4))


def test_rank_and_alpha_patterns_override_per_module(tmp_path: Path) -> None:
    config = {**BASIC, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"layers.0.self_attn.q_proj": 32}}
    ranks = {m: 2 for m in MODULES if m.endswith("v_proj")}
    adapter = load_peft_adapter(write_adapter(tmp_path / "a", config, ranks))
    assert adapter.modules["model.layers.0.self_attn.v_proj"].rank == 2
    assert adapter.modules["model.layers.0.self_attn.v_proj"].scaling == 8 / 2
    assert adapter.modules["model.layers.0.self_attn.q_proj"].scaling == 32 / 4
    assert adapter.modules["model.layers.1.self_attn.q_proj"].scaling == 8 / 4  # the pattern ends at a dot


def test_target_modules_may_be_a_regex_and_layers_may_be_limited(tmp_path: Path) -> None:
    regex = {**BASIC, "target_modules": r".*\.(q_proj|v_proj)"}
    assert len(load_peft_adapter(write_adapter(tmp_path / "a", regex)).modules) == 4
    layer0 = {k: v for k, v in MODULES.items() if ".layers.0." in k}
    limited = {**BASIC, "layers_to_transform": [0]}
    assert len(load_peft_adapter(write_adapter(tmp_path / "b", limited, modules=layer0)).modules) == 2
    with pytest.raises(quiver.AdapterError, match="do not belong together"):
        load_peft_adapter(write_adapter(tmp_path / "c", limited))  # layer 1 weights, layer 0 config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"peft_type": "IA3"}, "not LoRA"),
        ({"r": 0}, "positive"),
        ({"target_modules": ["k_proj"]}, "do not belong together"),
    ],
)
def test_unsupported_or_inconsistent_configs_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    folder = write_adapter(tmp_path / "a", BASIC)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **BASIC, **change}))
    with pytest.raises(quiver.AdapterError, match=message):
        load_peft_adapter(folder)


def test_broken_folders_are_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(quiver.AdapterError, match="adapter_config.json"):
        load_peft_adapter(tmp_path)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps(BASIC))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(quiver.AdapterError, match="safe_serialization=True"):
        load_peft_adapter(pickled)
    folder = write_adapter(tmp_path / "wrong_rank", BASIC, ranks={"model.layers.0.self_attn.q_proj": 3})
    with pytest.raises(quiver.AdapterError, match="rank 4"):
        load_peft_adapter(folder)
    half = tmp_path / "half"
    half.mkdir()
    save_file(
        {"base_model.model.x.q_proj.lora_A.weight": np.zeros((4, 16), np.float32)},
        str(half / "adapter_model.safetensors"),
    )
    (half / "adapter_config.json").write_text(json.dumps(BASIC))
    with pytest.raises(quiver.AdapterError, match="not both A and B"):
        load_peft_adapter(half)
    (half / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(quiver.AdapterError, match="safetensors"):
        load_peft_adapter(half)


def test_attach_points_are_found_in_a_real_dynamo_export() -> None:
    model = onnx.load(str(FIXTURES / "torch_base.onnx"), load_external_data=False)
    modules = ["layers.0.linear1", "layers.1.linear2", "layers.0.self_attn.out_proj", "layers.0.nothing"]
    found, missing = find_attach_points(model, modules)
    assert missing == ["layers.0.nothing"]
    linear1 = found["layers.0.linear1"]
    assert (linear1.op_type, linear1.found_by, linear1.in_features, linear1.out_features) == (
        "MatMul",
        "name_scopes",
        32,
        64,
    )
    assert linear1.weight.startswith("val_")  # the dynamo exporter renamed the transposed weight
    out_proj = found["layers.0.self_attn.out_proj"]
    assert (out_proj.op_type, out_proj.found_by, out_proj.weight) == (
        "Gemm",
        "weight_name",
        "layers.0.self_attn.out_proj.weight",
    )
    # a wrapper's prefix (PEFT's "model." for a causal LM) still matches at a dot boundary
    assert (
        find_attach_points(model, ["model.layers.1.linear2"])[0]["model.layers.1.linear2"].weight
        == found["layers.1.linear2"].weight
    )


def test_an_explicit_map_wins_and_must_name_a_linear_node() -> None:
    model = onnx.load(str(FIXTURES / "torch_base.onnx"), load_external_data=False)
    node = next(n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1].startswith("val_"))
    found, _ = find_attach_points(model, ["my.module"], explicit={"my.module": node})
    assert found["my.module"].found_by == "explicit"
    with pytest.raises(quiver.AdapterError, match="not a MatMul/Gemm/Conv"):
        find_attach_points(model, ["my.module"], explicit={"my.module": "no_such_node"})


def test_a_qnn_adapter_config_json_beside_peft_safetensors_reads_the_same(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "elementary", BASIC)
    (folder / "adapter_model.safetensors").rename(folder / "elementary.safetensors")
    qnn = {"name": "elementary", "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    (folder / "elementary.json").write_text(json.dumps(qnn))
    from_qnn = load_peft_adapter(folder / "elementary.json")
    (folder / "elementary.safetensors").rename(folder / "adapter_model.safetensors")
    from_peft = load_peft_adapter(folder)
    assert from_qnn.name == "elementary" and from_qnn.modules.keys() == from_peft.modules.keys()
    for module, lora in from_qnn.modules.items():
        assert lora.scaling == from_peft.modules[module].scaling == 2.0
        np.testing.assert_array_equal(lora.lora_a, from_peft.modules[module].lora_a)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(quiver.AdapterError, match="elementary.safetensors or adapter_model.safetensors"):
        load_peft_adapter(folder / "elementary.json")

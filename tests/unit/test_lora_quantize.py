"""LoRA-aware quantization: one QDQ graph, sections carrying each use case's adapter integers and encodings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import quiver
from quiver.formats.encodings import parse_encodings
from quiver.formats.section import SectionFile
from tests.support.cli import quiver as run_cli
from tests.support.peft_models import LORA_X as X
from tests.support.peft_models import expected_output as _expected
from tests.support.peft_models import make_project

CASES = {"base": {}, "elementary": {"elementary": 1.0}, "elementary_long": {"elementary": 1.0, "long": 0.5}}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_project(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def quantized(project: Path) -> Path:
    """`quiver lora prepare` with calibration inputs: a16w8 base, 16-bit adapter weights."""
    rng = np.random.default_rng(5)
    lines = []
    for i in range(6):  # X itself and five more: a range that covers the inputs the tests run
        (X if i == 0 else rng.standard_normal(X.shape).astype(np.float32)).tofile(project / f"calib_{i}.raw")
        lines.append(f"calib_{i}.raw")
    (project / "calib.txt").write_text("\n".join(lines) + "\n")
    out = project / "quantized"
    result = run_cli(
        "lora", "prepare", "--lora-config", project / "lora.yaml", "-o", out, "--input-list", project / "calib.txt",
        "--input-shape", f"x={X.shape[0]},{X.shape[1]}", "--act-bitwidth", "16", "--weight-bitwidth", "8",
        "--lora-weight-bitwidth", "16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


def _section_encodings(path: Path) -> dict:
    section = SectionFile.open(path)
    try:
        return parse_encodings(section.metadata["encodings"]).tensors
    finally:
        section.close()


def test_the_context_holds_one_qdq_graph_with_16_bit_adapters_on_an_8_bit_base(quantized: Path) -> None:
    with quiver.Context.from_binary(quantized / "lora.qctx") as context:
        graph = context.graph("model")
        encodings = graph.encodings()
        skeleton = onnx.ModelProto.FromString(context.file.skeleton("model"))
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in skeleton.graph.node}
    params = encodings.params()
    adapters = {name: e for name, e in params.items() if name.startswith("lora.")}
    base = {name: e for name, e in params.items() if not name.startswith("lora.") and e.bitwidth < 32}
    assert adapters and base
    assert {e.bitwidth for e in adapters.values()} == {16} and {e.bitwidth for e in base.values()} == {8}
    updateable = {t.name for t in graph.static_tensors if t.tensor_type is quiver.TensorType.UPDATEABLE_STATIC}
    assert any(name.endswith("_quantized") for name in updateable) and any(
        name.endswith("_scale") for name in updateable
    )


def test_each_section_carries_its_encodings_and_applying_it_updates_the_graph(quantized: Path) -> None:
    with quiver.Context.from_binary(quantized / "lora.qctx") as context:
        graph = context.graph("model")
        seen = {}
        for case in CASES:
            carried = _section_encodings(quantized / f"{case}.qsec")
            assert any(name.startswith("lora.") for name in carried)  # adapter weights
            assert any(e.kind == "activation" for e in carried.values())  # activations the adapters change
            context.apply_binary_section("model", quantized / f"{case}.qsec")
            now = graph.encodings().tensors
            for name, encoding in carried.items():
                assert now[name] == encoding, (case, name)
            seen[case] = carried
    # the base use case has all-zero adapter weights: every adapter weight's scale differs from elementary's
    weights = [name for name in seen["elementary"] if name.endswith((".A", ".B"))]
    assert weights and all(seen["elementary"][n].scale != seen["base"][n].scale for n in weights)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_every_use_case_matches_the_float_math_within_quantization_error(
    project: Path, quantized: Path, backend: str
) -> None:
    with quiver.Context.from_binary(quantized / "lora.qctx", backend=backend) as context:
        graph = context.graph("model")
        outputs = {}
        for case, strengths in [*CASES.items(), ("elementary", CASES["elementary"])]:  # and back again
            context.apply_binary_section("model", quantized / f"{case}.qsec")
            y = graph.execute({"x": X})["y"]
            expected = _expected(project, strengths)
            # a16w8: within 2 % of the output's range of the exact math W·x + Σ αᵢ·sᵢ·Bᵢ·Aᵢ·x
            assert np.abs(y - expected).max() <= 0.02 * np.abs(expected).max(), case
            if case in outputs:
                np.testing.assert_array_equal(y, outputs[case])  # switching back gives the same result
            outputs[case] = y
        assert not np.allclose(outputs["base"], outputs["elementary"], atol=1e-3)


def test_the_manifest_says_the_sections_are_quantized(quantized: Path) -> None:
    manifest = json.loads((quantized / "manifest.json").read_text())
    assert manifest["quantized"]["updateable_tensors"] > 0
    assert set(manifest["use_cases"]) == set(CASES)

"""LoRA-aware quantization: one QDQ graph, sections carrying each use case's adapter integers and encodings."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

import quiver
from quiver.formats.encodings import parse_encodings
from quiver.formats.section import SectionFile
from tests.support.cli import assert_one_line_error
from tests.support.cli import quiver as run_cli
from tests.support.peft_models import LORA_X as X
from tests.support.peft_models import expected_output as _expected
from tests.support.peft_models import make_project

CASES = {"base": {}, "elementary": {"elementary": 1.0}, "elementary_long": {"elementary": 1.0, "long": 0.5}}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_project(tmp_path_factory.mktemp("project"))


def _calibration_list(project: Path) -> Path:
    rng = np.random.default_rng(5)
    lines = []
    for i in range(6):  # X itself and five more: a range that covers the inputs the tests run
        (X if i == 0 else rng.standard_normal(X.shape).astype(np.float32)).tofile(project / f"calib_{i}.raw")
        lines.append(f"calib_{i}.raw")
    (project / "calib.txt").write_text("\n".join(lines) + "\n")
    return project / "calib.txt"


def _prepare(project: Path, out: Path, *options: str | Path) -> subprocess.CompletedProcess[str]:
    """`quiver lora prepare` at a16w8 with 16-bit adapter weights."""
    return run_cli(
        "lora", "prepare", "--lora-config", project / "lora.yaml", "-o", out, "--input-shape",
        f"x={X.shape[0]},{X.shape[1]}", "--act-bitwidth", "16", "--weight-bitwidth", "8", "--lora-weight-bitwidth",
        "16", *options,
    )  # fmt: skip


@pytest.fixture(scope="module")
def quantized(project: Path) -> Path:
    """`quiver lora prepare` with calibration inputs: a16w8 base, 16-bit adapter weights."""
    result = _prepare(project, project / "quantized", "--input-list", _calibration_list(project))
    assert result.returncode == 0, result.stderr
    return project / "quantized"


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


# QAT encodings as AIMET 1.0.0 writes them, naming tensors of the graph `quiver lora create` writes.
A0 = "lora.0.model.layers.0.self_attn.q_proj.A"
DELTA0 = "lora.0.model.layers.0.self_attn.q_proj.delta"
XA0 = "lora.0.model.layers.0.self_attn.q_proj.xa"


def _aimet(activations: dict[str, tuple[float, int]], params: dict[str, float]) -> str:
    """activations: name -> (scale, offset), 16-bit unsigned; params: name -> scale, 16-bit symmetric."""
    return json.dumps(
        {
            "version": "1.0.0",
            "activation_encodings": [
                {"name": n, "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False, "bw": 16, "scale": [s],
                 "offset": [o]} for n, (s, o) in activations.items()
            ],
            "param_encodings": [
                {"name": n, "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": True, "bw": 16, "scale": [s],
                 "offset": [-32768]} for n, s in params.items()
            ],
        }
    )  # fmt: skip


GIVEN = {  # use case -> its QAT encodings: (A's scale, delta's scale, delta's offset, linear_0's scale, offset)
    "elementary": (1.25e-3, 7.5e-4, -30000, None),
    "elementary_long": (2.5e-3, 1.5e-3, -31000, (4.0e-4, -32000)),
}
COMMON = (3.5e-4, -32768)  # linear_0's, by --quantization-overrides for every use case (elementary_long's wins)


@pytest.fixture(scope="module")
def from_qat(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`lora prepare` with per-use-case quant_overrides in the YAML and --quantization-overrides for all."""
    root = tmp_path_factory.mktemp("qat")
    for part in ("base", "elementary", "long"):
        shutil.copytree(project / part, root / part)
    adapters, use_cases = (project / "lora.yaml").read_text().split("use-case:")
    for case, (a_scale, delta_scale, delta_offset, linear) in GIVEN.items():
        activations = {DELTA0: (delta_scale, delta_offset)} | ({"linear_0": linear} if linear else {})
        (root / f"{case}.encodings").write_text(_aimet(activations, {A0: a_scale, "not_in_the_graph": 1.0}))
        use_cases = use_cases.replace(f"- name: {case}\n", f"- name: {case}\n  quant_overrides: {case}.encodings\n")
    (root / "lora.yaml").write_text(adapters + "use-case:" + use_cases)
    # and for every use case, what makes MatMul(x, A0) quantized under --float-fallback: x and x·A0
    common = {"linear_0": COMMON, "x": (1e-4, -32768), XA0: (1e-3, -32768)}
    (root / "common.encodings").write_text(_aimet(common, {}))
    result = _prepare(
        root, root / "out", "--input-list", _calibration_list(root), "--quantization-overrides",
        root / "common.encodings",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "name tensors the LoRA graph lacks, skipped: ['not_in_the_graph']" in result.stderr
    return root / "out"


def _ints(encoding: object) -> tuple[tuple[float, ...], tuple[int, ...], str]:
    return encoding.scale, encoding.zero_point, encoding.dtype  # type: ignore[attr-defined]


def test_each_section_carries_the_exact_scales_and_offsets_of_its_use_cases_qat_encodings(from_qat: Path) -> None:
    f32 = lambda value: float(np.float32(value))  # noqa: E731 - ORT keeps scales as float32
    with quiver.Context.from_binary(from_qat / "lora.qctx") as context:
        graph = context.graph("model")
        for case, (a_scale, delta_scale, delta_offset, linear) in GIVEN.items():
            carried = _section_encodings(from_qat / f"{case}.qsec")
            # AIMET's offset o is ONNX's zero point −o for unsigned types; symmetric 16-bit weights are int16
            assert _ints(carried[A0]) == ((f32(a_scale),), (0,), "int16"), case
            assert _ints(carried[DELTA0]) == ((f32(delta_scale),), (-delta_offset,), "uint16"), case
            scale, offset = linear or COMMON  # the use case's own wins over the common file's
            assert _ints(carried["linear_0"]) == ((f32(scale),), (-offset,), "uint16"), case
            context.apply_binary_section("model", from_qat / f"{case}.qsec")
            now = graph.encodings().tensors
            assert _ints(now[A0]) == _ints(carried[A0]) and _ints(now[DELTA0]) == _ints(carried[DELTA0])
        base = _section_encodings(from_qat / "base.qsec")
        assert _ints(base["linear_0"]) == ((f32(COMMON[0]),), (-COMMON[1],), "uint16")
        assert _ints(base[A0]) != _ints(carried[A0])  # calibrated: its adapter weights are zero


def test_lora_import_writes_each_use_cases_encodings_beside_its_tensors(from_qat: Path, tmp_path: Path) -> None:
    root = from_qat.parent
    result = run_cli("lora", "import", "--lora-config", root / "lora.yaml", "-o", tmp_path / "imported")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "imported" / "use_cases.json").read_text())
    assert "encodings" not in summary["base"]  # neither quant_overrides nor --quantization-overrides
    for case, (a_scale, delta_scale, delta_offset, _) in GIVEN.items():
        assert summary[case]["encodings"] == f"{case}.encodings"
        written = json.loads((tmp_path / "imported" / f"{case}.encodings").read_text())
        assert written["version"] == "1.0.0"  # the version the user gave
        params = {e["name"]: e for e in written["param_encodings"]}
        activations = {e["name"]: e for e in written["activation_encodings"]}
        assert set(params) == {A0}  # the name the graph lacks is left out
        assert (params[A0]["scale"], activations[DELTA0]["scale"]) == ([a_scale], [delta_scale])
        assert activations[DELTA0]["offset"] == [delta_offset]


def test_float_fallback_quantizes_from_the_encodings_alone_and_names_every_float_op(
    from_qat: Path, tmp_path: Path
) -> None:
    root = from_qat.parent
    result = _prepare(
        root, tmp_path / "fallback", "--float-fallback", "--quantization-overrides", root / "common.encodings"
    )
    assert result.returncode == 0, result.stderr
    named = result.stderr.split("op(s) stay float, an activation of each having no encoding: ", 1)[1].split("\n")[0]
    float_ops = dict(item[:-1].split(" (") for item in named.split(", "))
    with quiver.Context.from_binary(tmp_path / "fallback" / "lora.qctx") as context:
        skeleton = onnx.ModelProto.FromString(context.file.skeleton("model"))
        context.apply_binary_section("model", tmp_path / "fallback" / "elementary.qsec")
        encodings = context.graph("model").encodings().tensors
    compute = [n for n in skeleton.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear")]
    requantized = {n.input[0] for n in skeleton.graph.node if n.op_type == "QuantizeLinear"}
    quantized = {n.name for n in compute if set(n.output) <= requantized}  # its outputs are quantized
    assert quantized and not quantized & set(float_ops)  # what it names is float, ...
    assert {n.name for n in compute} - quantized <= set(float_ops)  # ... and every float op is named
    assert "node_linear_3" in float_ops and float_ops["node_linear_3"] == "MatMul"
    assert _ints(encodings[A0]) == ((float(np.float32(1.25e-3)),), (0,), "int16")  # elementary's own
    assert _ints(encodings[XA0]) == ((float(np.float32(1e-3)),), (32768,), "uint16")  # the common file's


def test_float_fallback_needs_encodings_for_every_use_case(from_qat: Path, tmp_path: Path) -> None:
    result = _prepare(from_qat.parent, tmp_path / "fallback", "--float-fallback")  # base has none
    assert_one_line_error(result, "use case 'base' has no encodings", "quant_overrides")


def test_a_calibration_list_carrying_lora_alpha_as_the_seeds_do_is_taken(project: Path, quantized: Path) -> None:
    """The seed's lists for the LoRA graph give `lora_alpha` beside the model's inputs; each use case is
    calibrated at its own adapter_alphas all the same, so the sections equal those of a list without it."""
    plain = _calibration_list(project).read_text().split()
    np.ones(2, np.float32).tofile(project / "alpha.raw")
    (project / "calib_alpha.txt").write_text("".join(f"x:={line} lora_alpha:=alpha.raw\n" for line in plain))
    result = _prepare(project, project / "with_alpha", "--input-list", project / "calib_alpha.txt")
    assert result.returncode == 0, result.stderr
    assert "lora_alpha is set per use case" in result.stderr
    for section in sorted(quantized.glob("*.qsec")):
        assert (project / "with_alpha" / section.name).read_bytes() == section.read_bytes(), section.name

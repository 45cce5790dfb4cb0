"""`quiver lora prepare`: YAML + PEFT folders -> context, sections, manifest; strengths at run time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import quiver
from quiver.formats.section import SectionFile
from quiver.lora.peft import load_peft_adapter
from quiver.lora.prepare import prepare
from tests.support.cli import assert_one_line_error
from tests.support.cli import quiver as run_cli
from tests.support.peft_models import BASE_WEIGHTS, YAML, dynamo_like_model, make_project, peft_export, write_adapter
from tests.support.peft_models import LORA_X as X
from tests.support.peft_models import expected_output as _expected


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_project(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def prepared(project: Path) -> Path:
    out = project / "out"
    genie = project / "configs" / "genie.json"  # a folder not made yet: every output option makes its folder
    result = run_cli("lora", "prepare", "--lora-config", project / "lora.yaml", "-o", out, "--genie-config", genie)
    assert result.returncode == 0, result.stderr
    assert "elementary_long" in result.stdout
    return out


def test_prepare_writes_context_sections_manifest_and_genie_config(prepared: Path) -> None:
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["context"] == "lora.qctx" and manifest["graph"] == "model"
    assert manifest["alpha_input"] == "lora_alpha" and manifest["adapters"] == ["elementary", "long"]
    assert manifest["use_cases"]["elementary_long"] == {
        "section": "elementary_long.qsec",
        "adapters": ["elementary", "long"],
        "alphas": [1.0, 0.5],
    }
    for case in manifest["use_cases"].values():
        assert (prepared / case["section"]).is_file()
    genie = json.loads((prepared.parent / "configs" / "genie.json").read_text())["lora"]
    assert genie["alpha-tensor-name"] == "lora_alpha"
    assert genie["adapters"][2] == {
        "version": 1,
        "name": "elementary_long",
        "alphas": ["elementary", "long"],
        "bin-sections": ["../out/elementary_long.qsec"],
    }


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_each_use_case_runs_with_its_yaml_alphas_and_strengths_can_change(
    project: Path, prepared: Path, backend: str
) -> None:
    context = quiver.Context.from_binary(prepared / "lora.qctx", backend=backend)
    graph = context.graph("model")
    cases = {"base": {}, "elementary": {"elementary": 1.0}, "elementary_long": {"elementary": 1.0, "long": 0.5}}
    for case, strengths in cases.items():
        context.apply_binary_section("model", prepared / f"{case}.qsec")
        expected_alphas = {"elementary": strengths.get("elementary", 0.0), "long": strengths.get("long", 0.0)}
        assert graph.lora_strengths == expected_alphas
        np.testing.assert_allclose(graph.execute({"x": X})["y"], _expected(project, strengths), atol=1e-4, rtol=1e-4)
    graph.set_lora_strength("long", 0.0)
    np.testing.assert_allclose(
        graph.execute({"x": X})["y"], _expected(project, {"elementary": 1.0}), atol=1e-4, rtol=1e-4
    )
    fed = graph.execute({"x": X, "lora_alpha": np.array([0.5, 1.0], np.float32)})["y"]  # feeding works too
    np.testing.assert_allclose(fed, _expected(project, {"elementary": 0.5, "long": 1.0}), atol=1e-4, rtol=1e-4)
    with pytest.raises(quiver.TensorUpdateError, match="no adapter 'short'"):
        graph.set_lora_strength("short", 1.0)


def test_quiver_run_applies_a_section_with_strengths(project: Path, prepared: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", X)
    (tmp_path / "list.txt").write_text(f"x:={tmp_path / 'x.npy'}\n")
    run = ["run", prepared / "lora.qctx", "--input-list", tmp_path / "list.txt", "--output-dir", tmp_path / "o"]
    result = run_cli(*run, "--npy", "--section", prepared / "elementary_long.qsec", "--lora-strength", "long=2.0")
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(
        np.load(tmp_path / "o" / "Result_0" / "y.npy"),
        _expected(project, {"elementary": 1.0, "long": 2.0}),
        atol=1e-4,
        rtol=1e-4,
    )
    assert_one_line_error(run_cli(*run, "--lora-strength", "long=1"), "no LoRA section applied")
    not_in_section = run_cli(*run, "--section", prepared / "elementary.qsec", "--lora-strength", "long=1")
    assert_one_line_error(not_in_section, "'long' is not in the section", "['elementary']")


def test_a_lora_context_runs_without_a_section_as_its_base_model(project: Path, prepared: Path) -> None:
    with quiver.Context.from_binary(prepared / "lora.qctx") as context:
        graph = context.graph("model")
        zero_adapter = graph.execute({"x": X})["y"]
        context.apply_binary_section("model", prepared / "base.qsec")
        np.testing.assert_array_equal(graph.execute({"x": X})["y"], zero_adapter)
    np.testing.assert_allclose(zero_adapter, _expected(project, {}), atol=1e-4, rtol=1e-4)


def test_inspect_shows_a_sections_tensors_and_use_case(prepared: Path) -> None:
    document = json.loads(run_cli("inspect", prepared / "elementary.qsec", "--json").stdout)
    assert document["kind"] == "binary section"
    assert document["metadata"]["lora"]["active"] == ["elementary"]
    tensors = [row["tensor"] for rows in document["graphs"].values() for row in rows]
    assert tensors and all(name.startswith("lora.") for name in tensors)
    table = run_cli("inspect", prepared / "elementary.qsec")
    assert table.returncode == 0 and "use case 'elementary'" in table.stdout


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: text.replace("  lora_config: long", "  lora_config: long\n  rank: 4"), "unknown keys ['rank']"),
        (lambda text: text.replace("base/model.onnx", "missing/model.onnx"), "does not exist"),
        (lambda text: text.replace("[1.0, 0.5]", "[1.0, .nan]"), "alphas are finite numbers"),
        (
            lambda text: text.replace(
                "  adapter_names: [elementary]\n", "  adapter_names: [elementary]\n  quant_overrides: [a]\n"
            ),
            "quant_overrides must be a file name",
        ),
        (
            lambda text: text.replace("model_name: base/model.onnx", "model_name: [base/model.onnx, 3]"),
            "model_name must be a file name",
        ),
        (lambda text: "share_adapters_between_graphs: maybe\n" + text, "share_adapters_between_graphs is Yes or No"),
    ],
)
def test_yaml_mistakes_are_one_line_errors(project: Path, tmp_path: Path, edit: Any, message: str) -> None:
    (project / "mistake.yaml").write_text(edit(YAML))
    for command in ("prepare", "create", "import"):
        result = run_cli("lora", command, "--lora-config", project / "mistake.yaml", "-o", tmp_path / command)
        assert_one_line_error(result, message)


def test_a_use_case_model_with_another_base_is_refused(project: Path, tmp_path: Path) -> None:
    other = {m: w + 1.0 for m, w in BASE_WEIGHTS.items()}
    onnx.save(dynamo_like_model(other), str(project / "other.onnx"))
    (project / "bad.yaml").write_text(YAML + "- name: drifted\n  adapter_names: [long]\n  model_name: other.onnx\n")
    with pytest.raises(quiver.AdapterError, match="base part must equal"):
        prepare(project / "bad.yaml", tmp_path / "out")


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("use-case:\n- name: x\n  adapter_names: [nope]\n", "unknown adapters"),
        ("adapter: []\nuse-case:\n- name: only\n  adapter_names: []\n", "no base use case"),
        ("- not a mapping", "YAML mapping"),
    ],
)
def test_broken_yaml_is_refused_with_what_to_do(tmp_path: Path, yaml_text: str, message: str) -> None:
    (tmp_path / "l.yaml").write_text(yaml_text)
    with pytest.raises(quiver.AdapterError, match=message):
        prepare(tmp_path / "l.yaml", tmp_path / "out")


def test_lora_map_reports_attach_points_and_writes_a_reusable_map(project: Path, tmp_path: Path) -> None:
    out = tmp_path / "maps" / "map.json"  # a folder not made yet
    result = run_cli("lora", "map", "--lora-config", project / "lora.yaml", "-o", out, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["missing"] == [] and len(report["attach_points"]) == 4
    assert json.loads(out.read_text())["model.layers.1.self_attn.v_proj"] == "node_linear_3"
    # a module the graph does not have: listed, one-line error, non-zero exit
    extra = {"model.layers.9.mlp.up_proj": (16, 16)}
    write_adapter(project / "stray", {"r": 2, "lora_alpha": 2, "target_modules": ["up_proj"]}, modules=extra)
    (project / "stray.yaml").write_text(YAML.replace("lora_config: long", "lora_config: stray"))
    assert_one_line_error(
        run_cli("lora", "map", "--lora-config", project / "stray.yaml"),
        "model.layers.9.mlp.up_proj",
        "attach_point_onnx_mapping",
    )


def test_lora_create_and_import_write_the_steps_of_prepare(project: Path, prepared: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from quiver.formats.section import SectionFile

    graph = tmp_path / "created" / "lora.onnx"  # a folder not made yet
    created = run_cli("lora", "create", "--lora-config", project / "lora.yaml", "-o", graph)
    assert created.returncode == 0, created.stderr
    model = onnx.load(str(graph))
    assert "lora_alpha" in [i.name for i in model.graph.input]
    # its tensor-name list (qairt-converter's --lora_weight_list) is what `build --updateable @FILE` takes
    names = (tmp_path / "created" / "lora_lora_tensor_names.txt").read_text().split()
    assert names and set(names) <= {t.name for t in model.graph.initializer}
    assert any(n.endswith(".A") for n in names) and any(n.endswith(".B") for n in names)
    built = run_cli("build", "-q", "-o", tmp_path / "lora.qctx", graph, "--updateable",
                    f"@{tmp_path / 'created' / 'lora_lora_tensor_names.txt'}")  # fmt: skip
    assert built.returncode == 0, built.stderr
    with quiver.Context.from_binary(tmp_path / "lora.qctx") as context:
        updateable = {t.name for t in context.graph("lora").static_tensors
                      if t.tensor_type is quiver.TensorType.UPDATEABLE_STATIC}  # fmt: skip
    assert updateable == set(names)
    session = ort.InferenceSession(str(graph))  # plain ORT runs the created graph
    zero = session.run(None, {"x": X, "lora_alpha": np.zeros(2, np.float32)})[0]
    np.testing.assert_allclose(zero, _expected(project, {}), atol=1e-5, rtol=1e-5)  # LoRA weights start at zero
    imported = run_cli("lora", "import", "--lora-config", project / "lora.yaml", "-o", tmp_path / "import")
    assert imported.returncode == 0, imported.stderr
    cases = json.loads((tmp_path / "import" / "use_cases.json").read_text())
    assert cases["elementary_long"]["alphas"] == [1.0, 0.5]
    values = load_file(str(tmp_path / "import" / "elementary_long.safetensors"))
    section = SectionFile((prepared / "elementary_long.qsec").read_bytes())
    for name, index in section.graphs["model"].tensors.items():
        np.testing.assert_array_equal(values[name], section.weight_array(index))
    # the generator's --adapter_weight_config step: sections from the import folder and the built context
    sections = run_cli("lora", "sections", "--context", tmp_path / "lora.qctx", "--import-dir", tmp_path / "import",
                       "-o", tmp_path / "sections")  # fmt: skip
    assert sections.returncode == 0, sections.stderr
    generated = SectionFile((tmp_path / "sections" / "elementary_long.qsec").read_bytes())
    assert generated.metadata["lora"]["alphas"] == [1.0, 0.5]
    assert generated.metadata["lora"]["active"] == ["elementary", "long"]
    for name, index in generated.graphs["lora"].tensors.items():
        np.testing.assert_array_equal(values[name], generated.weight_array(index))
    with quiver.Context.from_binary(tmp_path / "lora.qctx") as context:
        context.apply_binary_section("lora", tmp_path / "sections" / "elementary_long.qsec")
        out = context.graph("lora").execute({"x": X, "lora_alpha": np.array([1.0, 0.5], np.float32)})
    np.testing.assert_allclose(
        next(iter(out.values())), _expected(project, {"elementary": 1.0, "long": 0.5}), atol=1e-4, rtol=1e-4
    )
    (tmp_path / "import" / "use_cases.json").write_text(json.dumps({"x": {"tensors": "../../etc/passwd",
                                                                         "adapters": [], "alphas": []}}))  # fmt: skip
    assert_one_line_error(
        run_cli(
            "lora",
            "sections",
            "--context",
            tmp_path / "lora.qctx",
            "--import-dir",
            tmp_path / "import",
            "-o",
            tmp_path / "sections",
        ),  # fmt: skip
        "must be a file name in",
    )


def test_verify_checks_sections_and_inspect_lists_updateable_tensors(prepared: Path, tmp_path: Path) -> None:
    ok = run_cli("verify", prepared / "elementary.qsec")
    assert ok.returncode == 0 and ": ok" in ok.stdout
    damaged = bytearray((prepared / "elementary.qsec").read_bytes())
    damaged[5000] ^= 0x08
    (tmp_path / "damaged.qsec").write_bytes(bytes(damaged))
    assert_one_line_error(run_cli("verify", tmp_path / "damaged.qsec"), "checksum mismatch")
    report = json.loads(run_cli("inspect", prepared / "lora.qctx", "--json").stdout)
    assert len(report["graphs"][0]["updateable"]) == 3 * 4  # A, B and adapter index at each of 4 attach points


def _two_graph_project(project: Path, root: Path, share_key: str = "") -> Path:
    """The project with a second export of the base model (another batch size, weights renamed, as a
    second `torch.onnx` export names them) as a second graph: the base use case names both."""
    for part in ("base", "elementary", "long"):
        (root / part).symlink_to(project / part)
    second = dynamo_like_model(BASE_WEIGHTS)
    for tensor in second.graph.initializer:
        tensor.name = tensor.name.replace("val_", "w_")
    for node in second.graph.node:
        node.input[:] = [name.replace("val_", "w_") for name in node.input]
    second.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    onnx.save(second, str(root / "decode.onnx"))
    yaml = YAML.replace("model_name: base/model.onnx", "model_name: [base/model.onnx, decode.onnx]")
    (root / "lora.yaml").write_text(share_key + yaml)
    return root


@pytest.mark.parametrize("how", ["flag", "yaml", "no"])
def test_a_super_adapter_is_one_section_for_every_graph(
    project: Path, prepared: Path, tmp_path: Path, how: str
) -> None:
    root = _two_graph_project(project, tmp_path, "share_adapters_between_graphs: Yes\n" if how == "yaml" else "")
    flag = ["--share-adapters-between-graphs"] if how == "flag" else []
    result = run_cli("lora", "prepare", "--lora-config", root / "lora.yaml", "-o", root / "out", *flag, "--json")
    assert result.returncode == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["graphs"] == ["model", "decode"] and manifest["shared_between_graphs"] is (how != "no")
    case = manifest["use_cases"]["elementary_long"]
    with quiver.Context.from_binary(root / "out" / "lora.qctx") as context:
        if how == "no":  # a section per graph
            assert case["sections"] == {g: f"elementary_long.{g}.qsec" for g in ("model", "decode")}
            for graph, file in case["sections"].items():
                assert list(context.apply_binary_section(None, root / "out" / file).graphs) == [graph]
            sizes = [(root / "out" / f).stat().st_size for f in case["sections"].values()]
        else:  # one section updates both graphs, each distinct tensor in it once
            assert case["section"] == "elementary_long.qsec"
            section = context.apply_binary_section(None, root / "out" / case["section"])
            assert sorted(section.graphs) == ["decode", "model"]
            sizes = [(root / "out" / case["section"]).stat().st_size]
        expected = _expected(project, {"elementary": 1.0, "long": 0.5})
        np.testing.assert_allclose(context.graph("model").execute({"x": X})["y"], expected, rtol=1e-4, atol=1e-5)
        decoded = context.graph("decode").execute({"x": X[:1]})["y"]
        np.testing.assert_allclose(decoded, expected[:1], rtol=1e-4, atol=1e-5)
        assert context.weight_stats().unique_bytes < 0.6 * context.weight_stats().referenced_bytes  # base shared
    one_graph = (prepared / "elementary_long.qsec").stat().st_size  # the one-graph prepare's
    assert sum(sizes) <= 1.1 * one_graph if how != "no" else sum(sizes) >= 1.8 * one_graph


def test_only_the_base_use_case_names_several_models(project: Path, tmp_path: Path) -> None:
    root = _two_graph_project(project, tmp_path)
    text = (
        (root / "lora.yaml")
        .read_text()
        .replace("adapter_names: [elementary]\n", "adapter_names: [elementary]\n  model_name: [a.onnx, b.onnx]\n")
    )
    (root / "lora.yaml").write_text(text)
    result = run_cli("lora", "prepare", "--lora-config", root / "lora.yaml", "-o", root / "out")
    assert_one_line_error(result, "only the base use case names several models")


@pytest.mark.parametrize("names", ["dynamo", "torchscript"])
def test_adapters_given_by_their_config_take_their_weights_from_the_use_cases_exports(
    project: Path, prepared: Path, tmp_path: Path, names: str
) -> None:
    """QNN's flow: each adapter a config JSON alone, its weights in the graph exported for a use case."""
    adapters = {n: load_peft_adapter(project / n, n) for n in ("elementary", "long")}
    root = tmp_path / "qnn"
    (root / "base").mkdir(parents=True)
    shutil.copy(project / "base" / "model.onnx", root / "base" / "model.onnx")
    for name in adapters:
        (root / name).mkdir()
        shutil.copy(project / name / "adapter_config.json", root / name / f"{name}.json")  # no safetensors
    onnx.save(peft_export(adapters, ["elementary"], names), str(root / "elementary" / "model.onnx"))
    onnx.save(peft_export(adapters, ["elementary", "long"], names), str(root / "elementary_long.onnx"))
    yaml_text = YAML.replace("lora_config: elementary", "lora_config: elementary/elementary.json")
    yaml_text = yaml_text.replace("lora_config: long", "lora_config: long/long.json")
    yaml_text = yaml_text.replace(
        "- name: elementary\n  adapter_names: [elementary]",
        "- name: elementary\n  adapter_names: [elementary]\n  model_name: elementary/model.onnx",
    )
    yaml_text = yaml_text.replace(
        "  adapter_alphas: [1.0, 0.5]", "  adapter_alphas: [1.0, 0.5]\n  model_name: elementary_long.onnx"
    )
    (root / "lora.yaml").write_text(yaml_text)
    result = run_cli("lora", "prepare", "--lora-config", root / "lora.yaml", "-o", root / "out")
    assert result.returncode == 0, result.stderr
    for case in ("elementary", "elementary_long"):  # the same tensors as from the PEFT folders' safetensors
        ours = SectionFile((root / "out" / f"{case}.qsec").read_bytes())
        theirs = SectionFile((prepared / f"{case}.qsec").read_bytes())
        assert ours.graphs["model"].tensors.keys() == theirs.graphs["model"].tensors.keys()
        for tensor, index in theirs.graphs["model"].tensors.items():
            np.testing.assert_allclose(ours.weight_array(ours.graphs["model"].tensors[tensor]),
                                       theirs.weight_array(index), rtol=1e-6, atol=1e-7)  # fmt: skip
    with quiver.Context.from_binary(root / "out" / "lora.qctx") as context:
        context.apply_binary_section("model", root / "out" / "elementary_long.qsec")
        got = context.graph("model").execute({"x": X})["y"]
    np.testing.assert_allclose(got, _expected(project, {"elementary": 1.0, "long": 0.5}), rtol=1e-4, atol=1e-4)
    # an adapter whose use cases name no export has nowhere to read its weights from: one line saying so
    bare = YAML.replace("lora_config: long", "lora_config: long/long.json")
    (root / "bare.yaml").write_text(bare.replace("lora_config: elementary", "lora_config: elementary/elementary.json"))
    assert_one_line_error(run_cli("lora", "map", "--lora-config", root / "bare.yaml"), "has no weights", "model_name")


def _parts(weights: dict[str, np.ndarray], split: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The CHAIN split after its `split`-th linear in two models (as QNN's flow splits a decoder
    `..._1_of_2`, `..._2_of_2`): the first gives `h`, the second takes it."""
    whole = dynamo_like_model(weights)
    cut = f"tanh_{split - 1}"
    first_nodes = [
        n for n in whole.graph.node if int(n.output[0].rsplit("_", 1)[-1] if n.output[0] != "y" else 99) < split
    ]
    second_nodes = [n for n in whole.graph.node if n not in first_nodes]
    used = lambda nodes: {i for n in nodes for i in n.input}  # noqa: E731
    parts = []
    for nodes, source, sink in ((first_nodes, "x", cut), (second_nodes, cut, "y")):
        graph = onnx.helper.make_graph(
            nodes, f"part_{len(parts)}",
            [onnx.helper.make_tensor_value_info(source, onnx.TensorProto.FLOAT, ["n", 16])],
            [onnx.helper.make_tensor_value_info(sink, onnx.TensorProto.FLOAT, None)],
            [t for t in whole.graph.initializer if t.name in used(nodes)],
        )  # fmt: skip
        parts.append(onnx.helper.make_model(graph, opset_imports=whole.opset_import))
    return parts[0], parts[1]


@pytest.mark.parametrize("share", [True, False])
def test_a_model_split_in_parts_gives_each_part_the_adapters_of_its_modules(
    project: Path, tmp_path: Path, share: bool
) -> None:
    root = tmp_path / "split"
    root.mkdir()
    for folder in ("elementary", "long"):
        (root / folder).symlink_to(project / folder)
    first, second = _parts(BASE_WEIGHTS, 2)  # layer 0's q/v in the first part, layer 1's in the second
    onnx.save(first, str(root / "model_1_of_2.onnx"))
    onnx.save(second, str(root / "model_2_of_2.onnx"))
    yaml = YAML.replace("model_name: base/model.onnx", "model_name: [model_1_of_2.onnx, model_2_of_2.onnx]")
    (root / "lora.yaml").write_text(("share_adapters_between_graphs: Yes\n" if share else "") + yaml)
    result = run_cli("lora", "prepare", "--lora-config", root / "lora.yaml", "-o", root / "out", "--json")
    assert result.returncode == 0, result.stderr
    case = json.loads(result.stdout)["use_cases"]["elementary_long"]
    with quiver.Context.from_binary(root / "out" / "lora.qctx") as context:
        for file in [case["section"]] if share else case["sections"].values():
            context.apply_binary_section(None, root / "out" / file)
        h = next(iter(context.graph("model_1_of_2").execute({"x": X}).values()))
        y = next(iter(context.graph("model_2_of_2").execute({"tanh_1": h}).values()))
    np.testing.assert_allclose(y, _expected(project, {"elementary": 1.0, "long": 0.5}), rtol=1e-4, atol=1e-5)
    if not share:
        assert set(case["sections"]) == {"model_1_of_2", "model_2_of_2"}


def test_an_export_whose_layer_found_no_attach_point_is_an_error_not_an_unadapted_graph(
    project: Path, tmp_path: Path
) -> None:
    root = _two_graph_project(project, tmp_path)
    second = onnx.load(str(root / "decode.onnx"))
    for node in second.graph.node:  # its name scopes lost: layer 1's q_proj cannot be found in it
        if node.output[0] == "linear_2":
            del node.metadata_props[:]
    onnx.save(second, str(root / "decode.onnx"))
    assert_one_line_error(
        run_cli("lora", "prepare", "--lora-config", root / "lora.yaml", "-o", root / "out"),
        "model.layers.1.self_attn.q_proj",
        "holds the same layer weight",
    )

"""The `quiver` command line, run as users run it: a real process, real files, one-line errors."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import quiver as quiver_api
from quiver.formats.reader import ContextFile
from tests.support.cli import assert_one_line_error, quiver


@pytest.fixture(scope="module")
def built(family_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "family.qctx"
    result = quiver(
        "build", "-o", out, family_files["base"], f"{family_files['finetune_1']}:tuned", family_files["finetune_2"]
    )
    assert result.returncode == 0, result.stderr
    assert "saved by sharing" in result.stdout
    return out


def test_every_command_has_help() -> None:
    for command in ("", "demo", "build", "inspect", "run", "compare", "verify", "check"):
        result = quiver(*([command] if command else []), "--help")
        assert result.returncode == 0 and "Usage:" in result.stdout


def test_build_names_graphs_by_stem_or_suffix_and_reports_sharing(built: Path) -> None:
    report = json.loads(quiver("inspect", built, "--json").stdout)
    assert [g["name"] for g in report["graphs"]] == ["base", "tuned", "finetune_2"]
    assert report["graphs"][0]["inputs"] == [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "type": "APP_WRITE"}
    ]
    assert report["graphs"][0]["outputs"][0]["shape"] == ["batch", "sequence", 128]
    weights = report["weights"]
    assert report["size_bytes"] == built.stat().st_size
    assert weights["unique_bytes"] < weights["referenced_bytes"]
    assert report["graphs"][1]["shared_with"]["base"] > 0
    assert {t["index"] for t in report["tensors"]} == set(range(weights["unique_count"]))


def test_build_json_matches_inspect(family_files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "one.qctx"
    result = quiver("build", "-q", "--json", "-o", out, family_files["base"])
    built_report = json.loads(result.stdout)
    assert built_report == json.loads(quiver("inspect", out, "--json").stdout)


def test_build_with_fixed_input_shapes(family_files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "fixed.qctx"
    assert quiver("build", "-q", "-o", out, family_files["base"], "--input-shape", "input_ids=1,16").returncode == 0
    report = json.loads(quiver("inspect", out, "--json").stdout)
    assert report["graphs"][0]["inputs"][0]["shape"] == [1, 16]


def test_build_gives_one_model_two_graphs_with_their_own_shapes_and_refuses_names_no_graph_has(
    family_files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "two.qctx"
    base = family_files["base"]
    shapes = ["--input-shape", "input_ids=1,8", "--input-shape", "long:input_ids=1,32"]  # shared, then long's own
    result = quiver("build", "-q", "-o", out, f"{base}:short", f"{base}:long", *shapes)
    assert result.returncode == 0, result.stderr
    inputs = {g["name"]: g["inputs"][0]["shape"] for g in json.loads(quiver("inspect", out, "--json").stdout)["graphs"]}
    assert inputs == {"short": [1, 8], "long": [1, 32]}
    for typo in ("input_idz=1,8", "nope:input_ids=1,8", "long:input_idz=1,8"):
        assert_one_line_error(
            quiver("build", "-q", "-o", tmp_path / "no.qctx", f"{base}:short", f"{base}:long", "--input-shape", typo),
            typo.partition("=")[0],
            "no graph given has as an input",
        )
    assert not (tmp_path / "no.qctx").exists()


def test_inspect_prints_tables(built: Path) -> None:
    result = quiver("inspect", built, "--tensors")
    assert result.returncode == 0
    assert "stored tensors" in result.stdout and "tuned" in result.stdout and "x unique weights" in result.stdout


def test_inspect_exports_each_stored_weight_once_as_a_raw_file_with_an_index(
    built: Path, family_files: dict[str, Path], tmp_path: Path
) -> None:
    import onnx
    from onnx import numpy_helper

    result = quiver("inspect", built, "--export-weights", tmp_path / "weights")
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "weights" / "weights.json").read_text())
    report = json.loads(quiver("inspect", built, "--json").stdout)
    assert len(index["tensors"]) == report["weights"]["unique_count"] == len(list((tmp_path / "weights").glob("*.raw")))
    assert any(len(t["graphs"]) > 1 for t in index["tensors"])  # shared by graphs: written once, named by each
    for tensor in index["tensors"]:  # each file is named after a tensor that reads it
        first = min(name for names in tensor["graphs"].values() for name in names)
        stem = tensor["file"].removesuffix(".raw")
        assert stem == first or stem.endswith(f".{tensor['index']:05d}"), (stem, first)
    source = {t.name: numpy_helper.to_array(t) for t in onnx.load(family_files["base"]).graph.initializer}
    compared = 0
    for tensor in index["tensors"]:
        for name in tensor["graphs"].get("base", []):
            stored = np.fromfile(tmp_path / "weights" / tensor["file"], dtype=tensor["dtype"]).reshape(tensor["shape"])
            if name in source and stored.shape == source[name].shape:
                np.testing.assert_array_equal(stored, source[name])
                compared += 1
    assert compared > 0


def test_build_makes_the_weights_it_is_told_updateable_and_refuses_names_it_does_not_find(
    family_files: dict[str, Path], tmp_path: Path
) -> None:
    import onnx
    from onnx import numpy_helper

    weights = [t for t in onnx.load(family_files["base"]).graph.initializer if len(t.dims) == 2]
    names = [weights[0].name, weights[1].name]
    (tmp_path / "names.txt").write_text("# the first two\n" + "\n".join(names) + "\n")
    out = tmp_path / "generic.qctx"
    result = quiver("build", "-q", "-o", out, family_files["base"], "--updateable", f"@{tmp_path / 'names.txt'}")
    assert result.returncode == 0, result.stderr
    ids = {"input_ids": np.arange(8, dtype=np.int64).reshape(1, 8)}
    with quiver_api.Context.from_binary(out) as context:
        graph_name = next(iter(context.graph_names))
        assert set(context.file.graphs[graph_name].updateable) == set(names)
        graph = context.graph(graph_name)
        before = graph.execute(ids)
        graph.update_tensors({names[1]: 2 * numpy_helper.to_array(weights[1])})
        graph.finalize()
        after = graph.execute(ids)
    assert any(not np.array_equal(before[k], after[k]) for k in before)  # the new values ran
    bad = quiver("build", "-q", "-o", tmp_path / "bad.qctx", family_files["base"], "--updateable", "no.such.weight")
    assert_one_line_error(bad, "no.such.weight")


def test_run_writes_qnn_net_run_outputs_equal_to_onnxruntime(
    built: Path, family_files: dict[str, Path], tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 1000, size=(1, 10), dtype=np.int64) for _ in range(2)]
    batches[0].tofile(tmp_path / "ids0.raw")
    np.save(tmp_path / "ids1.npy", batches[1])
    (tmp_path / "inputs.txt").write_text("#last_hidden_state\ninput_ids:=ids0.raw\ninput_ids:=ids1.npy\n")
    result = quiver(
        "run",
        built,
        "--graph",
        "tuned",
        "--input-list",
        tmp_path / "inputs.txt",
        "--output-dir",
        tmp_path / "out",
        "--npy",
        "--input-shape",
        "input_ids=1,10",
    )
    assert result.returncode == 0, result.stderr
    session = ort.InferenceSession(str(family_files["finetune_1"]))
    for i, ids in enumerate(batches):
        expected = session.run(None, {"input_ids": ids})[0]
        raw = np.fromfile(tmp_path / "out" / f"Result_{i}" / "last_hidden_state.raw", dtype="<f4").reshape(
            expected.shape
        )
        np.testing.assert_allclose(raw, expected, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(np.load(tmp_path / "out" / f"Result_{i}" / "last_hidden_state.npy"), raw)


def test_run_on_the_reference_backend_infers_one_dynamic_dim(family_files: dict[str, Path], tmp_path: Path) -> None:
    built = tmp_path / "batch1.qctx"
    assert (
        quiver("build", "-q", "-o", built, family_files["base"], "--input-shape", "input_ids=1,sequence").returncode
        == 0
    )
    np.arange(6, dtype=np.int64).reshape(1, 6).tofile(tmp_path / "ids.raw")
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'ids.raw'}\n")  # one input: the name may be left out
    result = quiver(
        "run",
        built,
        "--graph",
        "base",
        "--input-list",
        tmp_path / "list.txt",
        "--output-dir",
        tmp_path / "o",
        "--backend",
        "reference",
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "o" / "Result_0" / "last_hidden_state.raw").stat().st_size == 6 * 128 * 4


def test_run_takes_qnns_backend_libraries_as_quiver_ort_does(built: Path, tmp_path: Path) -> None:
    np.arange(8, dtype=np.int64).reshape(1, 8).tofile(tmp_path / "ids.raw")
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'ids.raw'}\n")
    outputs = {}
    for backend in ("cpu", "libQnnHtp.so", "QnnHtp.dll", "htp"):
        result = quiver("run", built, "--graph", "base", "--input-list", tmp_path / "list.txt", "--output-dir",
                        tmp_path / backend, "--backend", backend, "--input-shape", "input_ids=1,8")  # fmt: skip
        assert result.returncode == 0, result.stderr
        warned = [line for line in result.stderr.splitlines() if line.startswith("quiver: warning:")]
        assert len(warned) == (backend != "cpu") and all("running on Quiver's cpu backend" in w for w in warned)
        outputs[backend] = (tmp_path / backend / "Result_0" / "last_hidden_state.raw").read_bytes()
    assert len(set(outputs.values())) == 1
    refused = quiver("run", built, "--graph", "base", "--input-list", tmp_path / "list.txt", "--output-dir",
                     tmp_path / "no", "--backend", "libQnnTpu.so", "--input-shape", "input_ids=1,8")  # fmt: skip
    assert refused.returncode == 2 and "no backend here" in refused.stderr


def test_run_errors_are_one_line(built: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_text("ids:=x.raw\n")
    assert_one_line_error(
        quiver("run", built, "--graph", "base", "--input-list", tmp_path / "bad.txt", "--output-dir", tmp_path),
        "'ids' is not an input",
    )
    run = ["run", built, "--graph", "base", "--input-list", tmp_path / "bad.txt", "--output-dir", tmp_path]
    assert_one_line_error(quiver(*run, "--input-shape", "ids=1,4"), "shapes given for ['ids']")
    (tmp_path / "odd.raw").write_bytes(b"\0" * 7)
    (tmp_path / "odd.txt").write_text("input_ids:=odd.raw\n")
    assert_one_line_error(
        quiver("run", built, "--graph", "base", "--input-list", tmp_path / "odd.txt", "--output-dir", tmp_path),
        "whole number of int64",
    )
    assert_one_line_error(
        quiver("run", built, "--graph", "nope", "--input-list", tmp_path / "odd.txt", "--output-dir", tmp_path),
        "no graph 'nope'",
        "tuned",
    )
    assert_one_line_error(
        quiver("run", built, "--input-list", tmp_path / "odd.txt", "--output-dir", tmp_path), "choose one with --graph"
    )


def test_run_reads_the_seeds_extensions_layout_and_warns_once_per_hardware_setting(built: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(8, dtype=np.int64).reshape(1, 8))
    (tmp_path / "list.txt").write_text("input_ids:=ids.npy\n")
    # the seed's htp_backend_extensions.json: context_configs beside backend_extensions, HTP blocks in the named file
    (tmp_path / "htp_config.json").write_text(json.dumps({
        "graphs": [{"graph_names": ["base", "tuned"], "vtcm_mb": 8, "O": 3}],
        "devices": [{"dsp_arch": "v73", "cores": [{"core_id": 0, "perf_profile": "burst"}]}],
    }))  # fmt: skip
    (tmp_path / "htp_backend_extensions.json").write_text(json.dumps({
        "backend_extensions": {"shared_library_path": "libQnnHtpNetRunExtensions.so",
                               "config_file_path": "htp_config.json"},
        "context_configs": {"enable_graphs": ["base"], "memory_limit_hint": 500, "is_persistent_binary": True,
                            "context_priority": "high"},
    }))  # fmt: skip
    config = tmp_path / "htp_backend_extensions.json"
    lists = f"{tmp_path / 'list.txt'},{tmp_path / 'list.txt'}"
    refused = quiver("run", built, "--graph", "base", "--graph", "tuned", "--input-list", lists,
                     "--config-file", config, "--output-dir", tmp_path / "no")  # fmt: skip
    assert refused.returncode == 1 and "enable_graphs allows ['base'], not ['tuned']" in refused.stderr
    # no --graph: the enabled graph is the only one to run (the context holds two)
    ran = quiver("run", built, "--input-list", tmp_path / "list.txt", "--config-file", config,
                 "--output-dir", tmp_path / "ok")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "ok" / "Result_0" / "last_hidden_state.raw").is_file()
    warnings = [line for line in ran.stderr.splitlines() if line.startswith("quiver: warning:")]
    for setting in ("graphs[0].vtcm_mb", "graphs[0].O", "devices[0].dsp_arch", "devices[0].cores[0].core_id",
                    "devices[0].cores[0].perf_profile", "context context_priority"):  # fmt: skip
        assert sum(setting + " tunes Snapdragon hardware" in line for line in warnings) == 1, (setting, warnings)
    assert len(warnings) == 6
    # the same setting in both places with two values is an error naming both files
    (tmp_path / "htp_config.json").write_text(json.dumps({"context": {"enable_graphs": ["tuned"]}}))
    assert_one_line_error(
        quiver(
            "run",
            built,
            "--input-list",
            tmp_path / "list.txt",
            "--config-file",
            config,
            "--output-dir",
            tmp_path / "no",
        ),  # fmt: skip
        "enable_graphs",
        "give one value",
    )


def test_run_takes_several_graphs_each_with_its_list_and_a_backend_extensions_config(
    built: Path, family_files: dict[str, Path], tmp_path: Path
) -> None:
    for i in range(2):
        np.save(tmp_path / f"ids{i}.npy", np.arange(10 * (i + 1), 10 * (i + 1) + 8, dtype=np.int64).reshape(1, 8))
        (tmp_path / f"list{i}.txt").write_text(f"input_ids:=ids{i}.npy\n")
    models = {"base": family_files["base"], "tuned": family_files["finetune_1"]}
    lists = {"base": tmp_path / "list0.txt", "tuned": tmp_path / "list1.txt"}
    by_pairs = ["run", built, "--graph", f"base:{lists['base']}", "--graph", f"tuned:{lists['tuned']}"]
    by_commas = [
        "run",
        built,
        "--graph",
        "base",
        "--graph",
        "tuned",
        "--input-list",
        f"{lists['base']},{lists['tuned']}",
    ]
    for index, command in enumerate((by_pairs, by_commas)):
        out = tmp_path / f"out{index}"
        result = quiver(*command, "--output-dir", out)
        assert result.returncode == 0, result.stderr
        for i, (graph, model) in enumerate(models.items()):
            ids = np.load(tmp_path / f"ids{i}.npy")
            expected = ort.InferenceSession(str(model)).run(None, {"input_ids": ids})[0]
            got = np.fromfile(out / graph / "Result_0" / "last_hidden_state.raw", dtype=np.float32)
            np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)
    (tmp_path / "htp.json").write_text(
        json.dumps({"context": {"enable_graphs": ["base"], "is_persistent_binary": True}})
    )
    (tmp_path / "extensions.json").write_text(json.dumps({"backend_extensions": {
        "shared_library_path": "libQnnHtpNetRunExtensions.so", "config_file_path": "htp.json"}}))  # fmt: skip
    allowed = quiver(*by_pairs[:4], "--config-file", tmp_path / "extensions.json", "--output-dir", tmp_path / "ok")
    assert allowed.returncode == 0, allowed.stderr
    assert_one_line_error(
        quiver(*by_pairs, "--config-file", tmp_path / "extensions.json", "--output-dir", tmp_path / "no"),
        "enable_graphs allows ['base'], not ['tuned']",
    )
    # memory_limit_hint is QNN's graph-switching hint, not a size check: both graphs run under a tiny one
    (tmp_path / "small.json").write_text(json.dumps({"context": {"memory_limit_hint": 0.001}}))
    switched = quiver(*by_pairs, "--config-file", tmp_path / "small.json", "--output-dir", tmp_path / "small")
    assert switched.returncode == 0, switched.stderr
    for graph in models:
        assert filecmp.cmp(tmp_path / "small" / graph / "Result_0" / "last_hidden_state.raw",
                           tmp_path / "out0" / graph / "Result_0" / "last_hidden_state.raw", shallow=False)  # fmt: skip
    assert_one_line_error(
        quiver("run", built, "--graph", "base", "--graph", "tuned", "--input-list", lists["base"], "--output-dir",
               tmp_path / "no"),
        "1 input list(s) for 2 graph(s)",
    )  # fmt: skip


def test_compare_reports_identical_and_different_tensors(family_files: dict[str, Path]) -> None:
    report = json.loads(quiver("compare", family_files["base"], family_files["finetune_1"], "--json").stdout)
    assert report["identical"] and report["different"] and not report["only_a"] and not report["only_b"]
    assert all(pair["a"] != pair["b"] for pair in report["identical"])  # matched by content, not by name
    assert report["context_bytes"] == report["separate_bytes"] - report["saved_bytes"]
    text = quiver("compare", family_files["base"], family_files["finetune_1"]).stdout
    assert "identical (shareable)" in text and "different tensors" in text


def test_verify_accepts_a_whole_file_and_refuses_a_damaged_one(built: Path, tmp_path: Path) -> None:
    result = quiver("verify", built)
    assert result.returncode == 0 and ": ok" in result.stdout
    damaged = bytearray(built.read_bytes())
    damaged[ContextFile.open(built).weights[0].offset + 3] ^= 0xFF
    (tmp_path / "damaged.qctx").write_bytes(bytes(damaged))
    assert_one_line_error(quiver("verify", tmp_path / "damaged.qctx"), "checksum mismatch")
    (tmp_path / "cut.qctx").write_bytes(bytes(damaged[:5000]))
    assert_one_line_error(quiver("verify", tmp_path / "cut.qctx"), "truncated")


def test_check_lists_operators_and_fails_on_unsupported_ones(family_files: dict[str, Path], tmp_path: Path) -> None:
    ok = quiver("check", family_files["base"], "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] and json.loads(ok.stdout)["path"] == "quiver"
    assert "quiver.ort runs it on: quiver" in quiver("check", family_files["base"]).stdout
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Hardmaxx", ["x"], ["y"]), helper.make_node("Dett", ["x"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, []),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "u.onnx"))
    assert_one_line_error(quiver("check", tmp_path / "u.onnx"), "Dett, Hardmaxx")
    assert_one_line_error(quiver("build", "-o", tmp_path / "u.qctx", tmp_path / "u.onnx"), "Dett (x1), Hardmaxx (x1)")
    assert not (tmp_path / "u.qctx").exists()


def test_bad_inputs_end_in_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    (tmp_path / "text.qctx").write_text("hello")
    assert_one_line_error(quiver("inspect", tmp_path / "text.qctx"), "truncated")
    (tmp_path / "zip.qctx").write_bytes(b"PK\x03\x04" + b"\0" * 200)
    assert_one_line_error(quiver("inspect", tmp_path / "zip.qctx"), "not a Quiver context binary")
    assert_one_line_error(quiver("inspect", tmp_path / "missing.qctx"), "cannot read")
    assert_one_line_error(quiver("build", "-o", tmp_path / "x.qctx", tmp_path / "missing.onnx"), "no ONNX model")
    usage = quiver("build", tmp_path / "m.onnx")
    assert usage.returncode == 2 and "Missing option" in usage.stderr


def test_demo_builds_runs_and_matches_onnxruntime(tmp_path: Path) -> None:
    result = quiver("demo", "--workdir", tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [g["graph"] for g in report["graphs"]] == ["base", "finetune_1", "finetune_2"]
    assert all(g["matches"] and g["max_abs_diff"] <= 1e-4 for g in report["graphs"])
    assert report["context_bytes"] < 0.6 * report["separate_bytes"]
    table = quiver("demo", "--workdir", tmp_path / "again")
    assert "one context" in table.stdout and "ok" in table.stdout


def test_the_demo_without_a_workdir_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from quiver.commands.demo import run_demo
    from quiver.testing.family import SMALL

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = run_demo(shape=SMALL, repeats=2)
    assert result.path is None and all(row.matches for row in result.rows)
    assert list(tmp_path.iterdir()) == []

"""`quiver quantize`: calibrated QDQ models, AIMET encodings in and out, mixed precision, integer weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import quiver
from quiver.backends.cpu import DEFAULT_ACCURACY_LEVEL, CpuBackend
from quiver.commands.accuracy import accuracy_report, sqnr_db
from quiver.formats.encodings import load_encodings
from quiver.passes.qdq import QuantizeOptions, quantize
from quiver.testing.family import TransformerShape, build_model, family_weights, sample_input_ids
from tests.support.cli import assert_one_line_error
from tests.support.cli import quiver as run_quiver
from tests.support.helpers import ort_fuses_8_bit_weights

# A sentence-embedding encoder with the proportions of a real one: the token table is a large part.
SHAPE = TransformerShape(vocab=4000, hidden=256, heads=4, ffn=1024, layers=2, max_positions=64)
SEQ = 16


def _ort(model: onnx.ModelProto | Path, ids: np.ndarray, accuracy_level: int = DEFAULT_ACCURACY_LEVEL) -> np.ndarray:
    """ORT on the QDQ model; its MatMulNBits fusion computes at `accuracy_level` (4, ORT's default: int8
    activations; 0: float32, the graph's own math)."""
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


def _bound(level: int, steps: float, theirs: np.ndarray) -> float:
    """How far Quiver's output may be from ORT's on the QDQ file at `level`: `steps` of the output's
    encoding where both compute alike. An ORT without its own 8-bit MatMulNBits fusion (before 1.32)
    computes the 8-bit weights in float32 at any level, where Quiver's context (rewritten at build, as
    ORT 1.32 rewrites them) quantizes activations to int8 at level 4: int8 rounding noise, a few % of the
    output's range (the level-0 rows check the rewrite's math exactly)."""
    return steps if level == 0 or ort_fuses_8_bit_weights() else 0.05 * float(np.abs(theirs).max())


# Quiver's backends beside the ORT accuracy level each should match: cpu by default computes as ORT does
# by default; at level 0 it and the reference backend compute the QDQ graph's own float math.
BACKENDS_AND_LEVELS = [("cpu", DEFAULT_ACCURACY_LEVEL), (CpuBackend(accuracy_level=0), 0), ("reference", 0)]


def _embedding(hidden: np.ndarray) -> np.ndarray:
    """Mean pooling over tokens: the sentence embedding."""
    return hidden.mean(axis=1).ravel()


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The float model and a QNN input list of four raw calibration inputs."""
    folder = tmp_path_factory.mktemp("quantize")
    onnx.save(build_model(SHAPE, family_weights(SHAPE, seed=3), "encoder"), folder / "encoder.onnx")
    lines = []
    for i in range(4):
        sample_input_ids(SHAPE, 1, SEQ, seed=i).tofile(folder / f"ids_{i}.raw")
        lines.append(f"input_ids:=ids_{i}.raw")
    (folder / "calibration.txt").write_text("#last_hidden_state\n" + "\n".join(lines) + "\n")
    return {"folder": folder, "model": folder / "encoder.onnx", "list": folder / "calibration.txt"}


@pytest.fixture(scope="module")
def a16w8(encoder: dict[str, Path]) -> dict[str, Path]:
    folder = encoder["folder"]
    result = run_quiver(
        "quantize", encoder["model"], "-o", folder / "a16w8.onnx", "--act-bitwidth", "16", "--input-list",
        encoder["list"], "--input-shape", f"input_ids=1,{SEQ}", "--encodings-out", folder / "enc" / "a16w8.encodings",
        "--report", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    encodings = folder / "enc" / "a16w8.encodings"  # a folder the command made
    return {"model": folder / "a16w8.onnx", "encodings": encodings, "summary": folder / "a16w8.json"}


def test_quantize_writes_a_qdq_model_and_aimet_100_encodings(encoder: dict[str, Path], a16w8: dict[str, Path]) -> None:
    model = onnx.load(a16w8["model"])
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    document = json.loads(a16w8["encodings"].read_text())
    assert document["version"] == "1.0.0"
    assert document["param_encodings"] and document["activation_encodings"]
    by_name = {e["name"]: e for e in document["activation_encodings"]}
    assert by_name["last_hidden_state"]["bw"] == 16 and by_name["last_hidden_state"]["dtype"] == "INT"
    # every 2-D weight is stored as 8-bit integers: the token table included
    stored = {t.name: t for t in model.graph.initializer}
    tables = [t for t in stored.values() if len(t.dims) == 2 and np.prod(t.dims) >= 4096]
    assert tables and all(t.data_type == onnx.TensorProto.UINT8 for t in tables)
    # the encodings file describes the scales the model uses
    for entry in document["param_encodings"]:
        if entry["name"] + "_scale" in stored and entry["enc_type"] == "PER_TENSOR":
            assert numpy_helper.to_array(stored[entry["name"] + "_scale"]).item() == pytest.approx(entry["scale"][0])


def test_the_qdq_model_runs_the_same_in_onnx_runtime_and_quiver(
    encoder: dict[str, Path], a16w8: dict[str, Path], tmp_path: Path
) -> None:
    context = quiver.Context.create("cpu", workdir=tmp_path)
    context.add_graph("a16w8", a16w8["model"])
    path = context.save(tmp_path / "a16w8.qctx")
    ids = sample_input_ids(SHAPE, 1, SEQ, seed=42)
    step = load_encodings(a16w8["encodings"]).tensors["last_hidden_state"].scale[0]
    # cpu runs ORT's kernels: within one step of the output's encoding. The reference backend rounds
    # intermediate quantizers from its own float math, and a flipped rounding travels a few steps.
    for (backend, level), steps in zip(BACKENDS_AND_LEVELS, (1, 1, 8)):
        theirs = _ort(a16w8["model"], ids, level)
        with quiver.Context.from_binary(path, backend=backend) as runtime:
            ours = runtime.graph("a16w8").execute({"input_ids": ids})["last_hidden_state"]
        assert np.abs(ours - theirs).max() <= _bound(level, steps * step * 1.001, theirs), backend


def test_a16w8_sentence_embeddings_keep_cosine_and_the_context_shrinks(
    encoder: dict[str, Path], a16w8: dict[str, Path], tmp_path: Path
) -> None:
    sizes = {}
    for name, source in (("float", encoder["model"]), ("a16w8", a16w8["model"])):
        context = quiver.Context.create("cpu", workdir=tmp_path)
        context.add_graph(name, source)
        sizes[name] = context.save(tmp_path / f"{name}.qctx").stat().st_size
        context.close()
    assert sizes["a16w8"] <= 0.30 * sizes["float"], sizes
    for seed in (100, 101, 102):
        ids = sample_input_ids(SHAPE, 1, SEQ, seed=seed)
        assert _cos(_embedding(_ort(encoder["model"], ids)), _embedding(_ort(a16w8["model"], ids))) >= 0.99


def test_the_report_gives_output_and_layer_accuracy(encoder: dict[str, Path], a16w8: dict[str, Path]) -> None:
    float_model, qdq_model = onnx.load(encoder["model"]), onnx.load(a16w8["model"])
    samples = [{"input_ids": sample_input_ids(SHAPE, 1, SEQ, seed=i)} for i in range(2)]
    report = accuracy_report(float_model, qdq_model, samples)
    (output,) = report.outputs
    a = np.concatenate([_ort(float_model, s["input_ids"]).ravel() for s in samples])
    b = np.concatenate([_ort(qdq_model, s["input_ids"]).ravel() for s in samples])
    noise = np.linalg.norm(a - b)
    assert output.sqnr_db == pytest.approx(20 * np.log10(np.linalg.norm(a) / noise), rel=1e-6)
    assert output.cosine == pytest.approx(_cos(a, b), abs=1e-9)
    assert len(report.layers) > 10
    assert [v for _, _, v in report.layers] == sorted(v for _, _, v in report.layers)  # worst first
    assert {op for _, op, _ in report.layers} >= {"MatMul", "LayerNormalization"}


def test_sqnr_of_known_arrays() -> None:
    assert sqnr_db(np.array([3.0, 4.0]), np.array([3.0, 4.5])) == pytest.approx(20.0)  # |x| = 5, |noise| = 0.5
    assert sqnr_db(np.ones(3), np.ones(3)) == float("inf")


def test_eval_command_prints_the_report(encoder: dict[str, Path], a16w8: dict[str, Path]) -> None:
    result = run_quiver(
        "eval", encoder["model"], a16w8["model"], "--input-list", encoder["list"], "--input-shape",
        f"input_ids=1,{SEQ}", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["samples"] == 4 and document["outputs"][0]["cosine"] > 0.99


def _activation_names(model: onnx.ModelProto, bits: int) -> set[str]:
    dtype = {8: onnx.TensorProto.UINT8, 16: onnx.TensorProto.UINT16}[bits]
    constants = {t.name: t for t in model.graph.initializer}
    return {
        n.input[0]
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and n.input[2] in constants and constants[n.input[2]].data_type == dtype
    }


def test_float_fallback_with_overrides_makes_a_mixed_precision_model(
    encoder: dict[str, Path], a16w8: dict[str, Path], tmp_path: Path
) -> None:
    full = json.loads(a16w8["encodings"].read_text())
    # Keep the encodings of the first layer's tensors only, and make one of them 8-bit.
    keep = [e for e in full["activation_encodings"] if e["name"] in {"t6_0", "t7_0", "t8_0", "t9_0"}]
    assert len(keep) >= 3
    eight_bit = keep[0]["name"]
    keep[0] = {**keep[0], "bw": 8, "scale": [keep[0]["scale"][0] * 257], "offset": [round(keep[0]["offset"][0] / 257)]}
    overrides = tmp_path / "overrides.encodings"
    overrides.write_text(json.dumps({**full, "activation_encodings": keep}))
    out = tmp_path / "mixed.onnx"
    result = run_quiver("quantize", encoder["model"], "-o", out, "--float-fallback", "--quantization-overrides",
                        overrides, "--encodings-out", tmp_path / "mixed.encodings")  # fmt: skip
    assert result.returncode == 0, result.stderr
    mixed = onnx.load(out)
    assert eight_bit in _activation_names(mixed, 8)
    assert {e["name"] for e in keep[1:]} <= _activation_names(mixed, 16)
    float_nodes = [n for n in mixed.graph.node if n.op_type == "Softmax"]
    assert float_nodes and not any(n.input[0].endswith("DequantizeLinear_Output") for n in float_nodes)
    # the given activation encodings are used exactly
    written = load_encodings(tmp_path / "mixed.encodings").tensors
    assert written[eight_bit].scale[0] == pytest.approx(keep[0]["scale"][0])
    assert written[eight_bit].offsets == (keep[0]["offset"][0],)
    _runs_the_same(out, tmp_path, written)


@pytest.mark.parametrize("act_bitwidth", ["16", "8"])
def test_16_bit_and_mixed_encodings_quiver_wrote_read_back_exactly_with_calibration(
    encoder: dict[str, Path], a16w8: dict[str, Path], tmp_path: Path, act_bitwidth: str
) -> None:
    """The a16w8 file mixes 8-bit (embedding tables, Gather outputs) and 16-bit tensors; read back with
    an input list (as `quantize` and `lora prepare` do), every encoding is the one given, whatever the
    default bit width, and the model computes the same."""
    out = tmp_path / "again.onnx"
    result = run_quiver("quantize", encoder["model"], "-o", out, "--act-bitwidth", act_bitwidth,
                        "--quantization-overrides", a16w8["encodings"], "--input-list", encoder["list"],
                        "--input-shape", f"input_ids=1,{SEQ}", "--encodings-out",
                        tmp_path / "again.encodings")  # fmt: skip
    assert result.returncode == 0, result.stderr
    given, written = json.loads(a16w8["encodings"].read_text()), json.loads((tmp_path / "again.encodings").read_text())
    assert {e["bw"] for e in given["activation_encodings"]} == {8, 16}
    for kind in ("activation_encodings", "param_encodings"):
        assert sorted(given[kind], key=lambda e: e["name"]) == sorted(written[kind], key=lambda e: e["name"])
    ids = sample_input_ids(SHAPE, 1, SEQ, seed=5)
    np.testing.assert_array_equal(_ort(out, ids), _ort(a16w8["model"], ids))


def _runs_the_same(model_path: Path, tmp_path: Path, encodings: dict) -> None:
    context = quiver.Context.create("cpu", workdir=tmp_path)
    context.add_graph("q", model_path)
    path = context.save(tmp_path / f"{model_path.stem}.qctx")
    ids = sample_input_ids(SHAPE, 1, SEQ, seed=7)
    theirs = _ort(model_path, ids)
    step = max((e.scale[0] for e in encodings.values() if not e.is_float and e.kind == "activation"), default=1e-3)
    for backend, steps in (("cpu", 1), ("reference", 8)):  # as in the a16w8 test
        with quiver.Context.from_binary(path, backend=backend) as runtime:
            ours = runtime.graph("q").execute({"input_ids": ids})["last_hidden_state"]
        bound = _bound(DEFAULT_ACCURACY_LEVEL, steps * step, theirs) if backend == "cpu" else steps * step
        assert np.abs(ours - theirs).max() <= bound, backend


def test_ort_overrides_with_convert_give_16_to_8_bit_conversions(encoder: dict[str, Path], tmp_path: Path) -> None:
    model = onnx.load(encoder["model"])
    first_ln = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    consumers = [n.name for n in model.graph.node if first_ln.output[0] in n.input]
    assert consumers
    overrides = tmp_path / "ort_overrides.json"
    overrides.write_text(json.dumps({first_ln.output[0]: [{"quant_type": "QUInt16", "convert": {
        "quant_type": "QUInt8", "recv_nodes": consumers}}]}))  # fmt: skip
    out = tmp_path / "converted.onnx"
    result = run_quiver("quantize", encoder["model"], "-o", out, "--input-list", encoder["list"], "--input-shape",
                        f"input_ids=1,{SEQ}", "--quantization-overrides", overrides)  # fmt: skip
    assert result.returncode == 0, result.stderr
    converted = onnx.load(out)
    quantizers = [n for n in converted.graph.node if n.op_type == "QuantizeLinear"]
    constants = {t.name: t.data_type for t in converted.graph.initializer}
    kinds = {constants[n.input[2]] for n in quantizers if n.input[0].startswith(first_ln.output[0])}
    assert kinds == {onnx.TensorProto.UINT16, onnx.TensorProto.UINT8}  # the 16-bit tensor and its 8-bit copy


def test_param_encodings_are_applied_exactly(encoder: dict[str, Path]) -> None:
    model = onnx.load(encoder["model"])
    matmul = next(n for n in model.graph.node if n.op_type == "MatMul" and n.input[1].startswith("val_"))
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == matmul.input[1]))
    scale, offset = 0.0123, -100  # QNN: real = scale·(q + offset)
    overrides = quiver.EncodingSet(
        {matmul.input[1]: quiver.Encoding.from_offsets(8, [scale], [offset], False, kind="param")}
    )
    samples = [{"input_ids": sample_input_ids(SHAPE, 1, SEQ, seed=i)} for i in range(2)]
    qdq, encodings = quantize(model, samples, QuantizeOptions(activation_bits=16, encodings=overrides))
    stored = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    expected = np.clip(np.rint(weight / np.float32(scale)) - offset, 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(stored[matmul.input[1] + "_quantized"], expected)
    assert stored[matmul.input[1] + "_scale"] == np.float32(scale)
    assert encodings.tensors[matmul.input[1]].offsets == (offset,)


def test_4_bit_weights_are_block_quantized_and_stored_packed(encoder: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "a16w4.onnx"
    result = run_quiver("quantize", encoder["model"], "-o", out, "--act-bitwidth", "16", "--weight-bitwidth", "4",
                        "--block-size", "32", "--input-list", encoder["list"], "--input-shape",
                        f"input_ids=1,{SEQ}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    qdq = onnx.load(out)
    blocked = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and any(
        a.name == "block_size" and a.i == 32 for a in n.attribute)]  # fmt: skip
    assert len(blocked) == 6 * SHAPE.layers  # every linear layer's weight
    sizes = {}
    for name, source in (("float", encoder["model"]), ("a16w4", out)):
        context = quiver.Context.create("cpu", workdir=tmp_path)
        context.add_graph(name, source)
        sizes[name] = context.save(tmp_path / f"{name}.qctx").stat().st_size
        context.close()
    assert sizes["a16w4"] <= 0.2 * sizes["float"], sizes
    with quiver.Context.from_binary(tmp_path / "a16w4.qctx") as runtime:
        skeleton = onnx.ModelProto.FromString(runtime.file.skeleton("a16w4"))
    assert sum(n.op_type == "MatMulNBits" for n in skeleton.graph.node) == 6 * SHAPE.layers
    ids = sample_input_ids(SHAPE, 1, SEQ, seed=5)
    for backend, level in BACKENDS_AND_LEVELS:
        theirs = _ort(out, ids, level)
        with quiver.Context.from_binary(tmp_path / "a16w4.qctx", backend=backend) as runtime:
            ours = runtime.graph("a16w4").execute({"input_ids": ids})["last_hidden_state"]
        # at level 4 Quiver's MatMulNBits (packed at build time) and ORT's own fusion of the QDQ pairs are
        # two int8 approximations of the same product (ORT < 1.32 blocks the activations differently):
        # within 2 % of the output's range of each other, not more
        atol = 2e-3 if level == 0 else 0.02 * float(np.abs(theirs).max())
        np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0, err_msg=str(backend))


def test_gptq_blocks_carry_zero_points_and_run_alike_in_quiver_and_onnx_runtime(
    encoder: dict[str, Path], tmp_path: Path
) -> None:
    outs = {}
    for quantizer in ("rtn-asym", "gptq-asym"):
        outs[quantizer] = tmp_path / f"{quantizer}.onnx"
        result = run_quiver("quantize", encoder["model"], "-o", outs[quantizer], "--act-bitwidth", "16",
                            "--weight-bitwidth", "4", "--block-size", "32", "--quantizer", quantizer, "--input-list",
                            encoder["list"], "--input-shape", f"input_ids=1,{SEQ}")  # fmt: skip
        assert result.returncode == 0, result.stderr
    stored = {t.name: t for t in onnx.load(outs["gptq-asym"]).graph.initializer}
    int4 = [t for t in stored.values() if t.data_type == onnx.TensorProto.INT4]
    zero_points = [t for t in int4 if t.name.endswith("_zero_point")]
    assert zero_points and any(np.frombuffer(t.raw_data, np.uint8).any() for t in zero_points)  # not all 0: asymmetric
    rounded = {t.name: t.raw_data for t in onnx.load(outs["rtn-asym"]).graph.initializer}
    assert any(rounded[name] != t.raw_data for name, t in stored.items() if name.endswith("_quantized"))
    context = quiver.Context.create("cpu", workdir=tmp_path)
    context.add_graph("gptq", outs["gptq-asym"])
    context.save(tmp_path / "gptq.qctx")
    context.close()
    ids = sample_input_ids(SHAPE, 1, SEQ, seed=5)
    with quiver.Context.from_binary(tmp_path / "gptq.qctx", backend=CpuBackend(accuracy_level=0)) as runtime:
        ours = runtime.graph("gptq").execute({"input_ids": ids})["last_hidden_state"]
    np.testing.assert_allclose(ours, _ort(outs["gptq-asym"], ids, 0), atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--weight-bitwidth", "8", "--quantizer", "gptq"], "--quantizer gptq makes 4-bit blocks"),
     (["--weight-bitwidth", "4", "--quantizer", "awq"], "Invalid value for '--quantizer'")],
)  # fmt: skip
def test_a_weight_quantizer_that_cannot_apply_is_refused_in_one_line(
    encoder: dict[str, Path], tmp_path: Path, flags: list[str], message: str
) -> None:
    result = run_quiver("quantize", encoder["model"], "-o", tmp_path / "q.onnx", "--input-list", encoder["list"],
                        "--input-shape", f"input_ids=1,{SEQ}", *flags)  # fmt: skip
    if "Invalid value" in message:  # click's own usage error: exit 2, its usage lines
        assert result.returncode == 2 and message in result.stderr, result.stderr
    else:
        assert_one_line_error(result, message)


def _dq_matmul_model(ints: np.ndarray, scale: np.ndarray, zero: np.ndarray, dtype: int, block: int) -> onnx.ModelProto:
    k, n = ints.shape
    tensors = [
        helper.make_tensor("w", dtype, [k, n], ints.ravel().tolist()),
        numpy_helper.from_array(scale, "scale"),
        helper.make_tensor("zero", dtype, list(zero.shape), zero.ravel().tolist()),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "scale", "zero"], ["wf"], axis=0, block_size=block),
        helper.make_node("MatMul", ["x", "wf"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, n])], tensors,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize(("dtype", "low", "high"), [(onnx.TensorProto.INT4, -8, 7), (onnx.TensorProto.UINT4, 0, 15)])
def test_matmul_nbits_matches_dequantize_then_matmul(dtype: int, low: int, high: int, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    k, n, block = 40, 3, 16  # K not a multiple of the block: the last block is partial
    blocks = -(-k // block)
    ints = rng.integers(low, high + 1, (k, n))
    zero = rng.integers(low, high + 1, (blocks, n))  # non-default zero points
    scale = rng.uniform(0.01, 0.1, (blocks, n)).astype(np.float32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    # the exact math: W[k, j] = (q[k, j] − z[k // block, j]) · s[k // block, j]
    weight = (ints - np.repeat(zero, block, axis=0)[:k]) * np.repeat(scale, block, axis=0)[:k]
    context = quiver.Context.create("cpu", workdir=tmp_path)
    context.add_graph("g", _dq_matmul_model(ints, scale, zero, dtype, block))
    path = context.save(tmp_path / "nbits.qctx")
    for backend in (CpuBackend(accuracy_level=0), "reference"):  # the packing, checked by exact math
        with quiver.Context.from_binary(path, backend=backend) as runtime:
            assert [n.op_type for n in onnx.ModelProto.FromString(runtime.file.skeleton("g")).graph.node] == [
                "MatMulNBits"
            ]
            y = runtime.graph("g").execute({"x": x})["y"]
        np.testing.assert_allclose(y, x @ weight, rtol=1e-5, atol=1e-5, err_msg=str(backend))


def _dq_weight_model(ints: np.ndarray, scale: float) -> onnx.ModelProto:
    tensors = [numpy_helper.from_array(ints, "w"), numpy_helper.from_array(np.float32(scale), "s"),
               numpy_helper.from_array(np.uint8(128), "z")]  # fmt: skip
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wf"]),
        helper.make_node("MatMul", ["x", "wf"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, ints.shape[0]])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, ints.shape[1]])], tensors,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_a_weight_is_shared_only_when_bytes_and_encoding_match(tmp_path: Path) -> None:
    ints = np.random.default_rng(1).integers(0, 256, (64, 32)).astype(np.uint8)  # 2 KiB: a stored weight
    models = {
        "a": _dq_weight_model(ints, 0.1),
        "same": _dq_weight_model(ints, 0.1),
        "rescaled": _dq_weight_model(ints, 0.2),
    }
    context = quiver.Context.create("cpu", workdir=tmp_path)
    for name, model in models.items():
        context.add_graph(name, model)
    context.save(tmp_path / "shared.qctx")
    report = quiver.describe_context(context)
    assert report["weights"]["unique_count"] == 2  # a and same share; rescaled has its own copy
    (conflict,) = report["encoding_conflicts"]
    tensors = [copy["tensors"] for copy in conflict["copies"]]
    # stored in MatMulNBits' layout (passes/nbits.py): the integers' name gains ".nbits"
    assert sorted(tensors) == [["a:w.nbits", "same:w.nbits"], ["rescaled:w.nbits"]]
    assert sorted(copy["encoding"]["scale"][0] for copy in conflict["copies"]) == pytest.approx([0.1, 0.2])
    for name in models:
        onnx.save(models[name], tmp_path / f"{name}.onnx")
    assert "w" in [a.name for a, _ in quiver.compare_models(tmp_path / "a.onnx", tmp_path / "same.onnx").identical]
    comparison = quiver.compare_models(tmp_path / "a.onnx", tmp_path / "rescaled.onnx")
    assert "w" not in [a.name for a, _ in comparison.identical]
    assert [(a.name, b.name) for a, b in comparison.encoding_conflicts] == [("w", "w")]
    result = run_quiver("compare", tmp_path / "a.onnx", tmp_path / "rescaled.onnx")
    assert result.returncode == 0 and "encodings differ" in result.stdout
    paths = [tmp_path / f"{name}.onnx" for name in models]
    result = run_quiver("build", "-o", tmp_path / "built.qctx", *paths)
    assert result.returncode == 0 and "encodings differ" in result.stdout and "rescaled:w" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--weight-bitwidth", "8", "--block-size", "32"], ["--block-size is for 4-bit weights"]),
        (["--float-fallback"], ["--float-fallback", "--quantization-overrides"]),
        (["--block-size", "24", "--weight-bitwidth", "4"], ["power of two"]),
    ],
)
def test_bad_options_end_in_one_line(encoder: dict[str, Path], tmp_path: Path, args: list, fragments: list) -> None:
    extra = (
        [] if "--float-fallback" in args else ["--input-list", encoder["list"], "--input-shape", f"input_ids=1,{SEQ}"]
    )
    result = run_quiver("quantize", encoder["model"], "-o", tmp_path / "x.onnx", *args, *extra)
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "x.onnx").exists()


def test_bad_overrides_and_missing_calibration_are_clear(encoder: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.encodings"
    entry = {"name": "t6_0", "bw": 8, "is_sym": False, "scale": [0.1], "offset": [3]}
    bad.write_text(json.dumps({"version": "1.0.0", "activation_encodings": [entry]}))
    result = run_quiver("quantize", encoder["model"], "-o", tmp_path / "x.onnx", "--float-fallback",
                        "--quantization-overrides", bad)  # fmt: skip
    assert_one_line_error(result, "bad.encodings", "offsets must be ≤ 0")
    result = run_quiver("quantize", encoder["model"], "-o", tmp_path / "x.onnx")
    assert result.returncode == 2 and "--input-list" in result.stderr


def test_per_channel_weights_percentile_calibration_and_aimet_200_out(encoder: dict[str, Path], tmp_path: Path) -> None:
    out, encodings = tmp_path / "per_channel.onnx", tmp_path / "per_channel.encodings"
    result = run_quiver("quantize", encoder["model"], "-o", out, "--per-channel", "--calibration", "percentile",
                        "--input-list", encoder["list"], "--input-shape", f"input_ids=1,{SEQ}", "--encodings-out",
                        encodings, "--encodings-version", "2.0.0", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["encodings_out"] == str(encodings)  # stdout is only the JSON
    document = json.loads(encodings.read_text())
    assert document["version"] == "2.0.0"
    model = onnx.load(out)
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    matmul_weights = [n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1].endswith("_Output")]
    per_channel = {
        n.input[0]: stored[n.input[1]].size
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.output[0] in matmul_weights and n.input[0] in stored
    }
    # one scale per output column of each linear weight [in, out]
    assert per_channel and all(size == stored[name].shape[1] for name, size in per_channel.items())
    by_name = {e["name"]: e for e in document["encodings"]}
    name = next(iter(per_channel)).removesuffix("_quantized")
    assert isinstance(by_name[name]["y_scale"], list) and by_name[name]["axis"] == 1
    ids = sample_input_ids(SHAPE, 1, SEQ, seed=9)
    assert _cos(_ort(encoder["model"], ids), _ort(out, ids)) > 0.99


@pytest.mark.parametrize("method", ["percentile", "entropy"])
def test_other_calibration_methods(encoder: dict[str, Path], method: str) -> None:
    samples = [{"input_ids": sample_input_ids(SHAPE, 1, SEQ, seed=i)} for i in range(2)]
    model = onnx.load(encoder["model"])
    qdq, encodings = quantize(model, samples, QuantizeOptions(activation_bits=8, calibration=method))
    assert encodings.activations()
    ids = sample_input_ids(SHAPE, 1, SEQ, seed=11)
    assert _cos(_ort(model, ids), _ort(qdq, ids)) > 0.99
    if method == "percentile":  # clips the tails: other scales than minmax's
        minmax, _ = quantize(model, samples, QuantizeOptions(activation_bits=8))
        assert _scales(qdq) != _scales(minmax)


def _scales(model: onnx.ModelProto) -> dict[str, float]:
    return {t.name: float(numpy_helper.to_array(t).ravel()[0]) for t in model.graph.initializer
            if t.name.endswith("_scale")}  # fmt: skip


@pytest.mark.parametrize(("dtype", "low", "high"), [(onnx.TensorProto.INT4, -8, 7), (onnx.TensorProto.UINT4, 0, 15)])
def test_4_bit_tensors_unpack_as_onnx_unpacks_them(dtype: int, low: int, high: int) -> None:
    from quiver.passes.nbits import pack_nibbles, unpack_nibbles

    values = np.random.default_rng(1).integers(low, high + 1, (5, 7))  # an odd count: the last byte is half used
    flat = np.append(values.ravel(), 0)
    tensor = helper.make_tensor("t", dtype, [5, 7], pack_nibbles(flat & 0x0F).tobytes(), raw=True)
    np.testing.assert_array_equal(unpack_nibbles(tensor), values)
    np.testing.assert_array_equal(numpy_helper.to_array(tensor).astype(np.int64), values)


def test_float_fallback_keeps_a_real_detectors_fused_conv_relu_pairs_quantized(real_wheel_models: Path) -> None:
    """AIMET (and ORT's quantizer) write no encoding between a Conv and the Relu or Clip fused after it, only
    on the pair's output: --float-fallback with such encodings quantizes the pair as QNN does, and leaves
    no op of RapidOCR's detector float."""
    import warnings

    from quiver.commands.quantize import load_float_model
    from tests.real.wheel_corpus import MODELS

    model = load_float_model(real_wheel_models / "ocr_det.onnx")
    for dim, size in zip(model.graph.input[0].type.tensor_type.shape.dim, MODELS["ocr_det"]["x"]):
        dim.dim_value = size  # replaces the dynamic dim's name
    rng = np.random.default_rng(0)
    samples = [{"x": rng.random(MODELS["ocr_det"]["x"]).astype(np.float32)} for _ in range(2)]
    _, given = quantize(model, samples, QuantizeOptions(activation_bits=8))
    producers = {output: node for node in model.graph.node for output in node.output}
    pairs = [n for n in model.graph.node if n.op_type in ("Relu", "Clip") and n.input[0] in producers]
    pairs = [n for n in pairs if producers[n.input[0]].op_type in ("Conv", "Add")]
    assert len(pairs) >= 30 and not any(n.input[0] in given.tensors for n in pairs)  # AIMET's layout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback, used = quantize(model, [], QuantizeOptions(activation_bits=8, float_fallback=True, encodings=given))
    assert not [str(w.message) for w in caught if "stay float" in str(w.message)]
    quantized_inputs = {n.input[0] for n in fallback.graph.node if n.op_type == "QuantizeLinear"}
    assert all(n.output[0] in quantized_inputs for n in pairs)  # each pair quantized, its Relu/Clip folded
    assert {name: (e.scale, e.zero_point) for name, e in used.tensors.items()} == {
        name: (e.scale, e.zero_point) for name, e in given.tensors.items()
    }


def test_a_given_activation_encoding_that_qnns_rules_overrule_is_named() -> None:
    """ORT's QNN rules fix a 16-bit Tanh's output encoding (scale 2/65536, zero point 32768), whatever the
    overrides say: the result uses theirs, and the warning names the tensor whose given encoding was not used."""
    from quiver.formats.encodings import Encoding, EncodingSet

    graph = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["t"], name="tanh")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [1, 4])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    given = EncodingSet({
        "x": Encoding("uint16", (3e-4,), (32768,), kind="activation"),
        "t": Encoding("uint16", (1e-4,), (32768,), kind="activation"),
    })  # fmt: skip
    with pytest.warns(UserWarning, match=r"1 given activation encoding\(s\) were replaced .*: t;"):
        _, used = quantize(model, [], QuantizeOptions(activation_bits=16, float_fallback=True, encodings=given))
    assert used.tensors["t"].scale == (2 / 65536,) and used.tensors["x"].scale == (float(np.float32(3e-4)),)

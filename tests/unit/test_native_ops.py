"""Quiver's own 4-bit MatMul (`MatMul4Bits`): its kernel, built here with the machine's compiler, and the ONNX
Runtime operators it is lowered to where the kernel is not used, against the float64 product of its blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quiver.backends.base import FinalizedGraph
from quiver.backends.cpu import native_ops
from quiver.backends.cpu.native_ops import NativeOps, built_library, lowered
from quiver.backends.cpu.session_model import session_model
from quiver.backends.cpu.settings import SessionSettings
from quiver.ir.nibbles import pack_nibbles
from quiver.ir.quiver_ops import MATMUL_4BITS, QUIVER_DOMAIN

BLOCK = 32


def _blocks(rng: np.random.Generator, k: int, n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Random blocks (q, and float16 scales and minimums) in every form the node takes, and W [K, N] in
    float64 from them."""
    count = k // BLOCK
    q = rng.integers(0, 16, (n, count, BLOCK), dtype=np.uint8)
    halves = np.stack([rng.uniform(0.001, 0.02, (n, count)), rng.uniform(-0.15, 0.0, (n, count))], 1).astype(np.float16)
    scales, minimums = halves[:, 0].astype(np.float32), halves[:, 1].astype(np.float32)
    tensors = {
        "B": pack_nibbles(q),
        "halves": halves,
        "scales": scales.reshape(-1),
        "offsets": np.ascontiguousarray((minimums + 8 * scales).T),
    }
    w = q.astype(np.float64) * scales[..., None].astype(np.float64) + minimums[..., None].astype(np.float64)
    return tensors, w.reshape(n, k).T


def _model(k: int, n: int, tensors: dict[str, np.ndarray], rank: int, few_rows: int = 1) -> onnx.ModelProto:
    node = helper.make_node(
        MATMUL_4BITS, ["x", *tensors], ["y"], name="projection", domain=QUIVER_DOMAIN, K=k, N=n, few_rows=few_rows
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None] * (rank - 1) + [k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, name) for name, v in tensors.items()],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(QUIVER_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _library() -> Path:
    built = built_library()
    assert isinstance(built, Path), f"the kernel could not be built here: {built}"
    return built


def _run(model: onnx.ModelProto, x: np.ndarray, library: Path | None, threads: int = 2) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library is not None:
        options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def _on_8_bits(x: np.ndarray) -> np.ndarray:
    """x with each block of 32 rounded to 8 bits as ORT's int8 kernels and Quiver's (a prompt's) round it:
    to the nearest of 255 steps of its largest magnitude / 127, in float32."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, BLOCK)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), 0).astype(np.float32)
    return (np.rint(blocks * inverse) * (largest / np.float32(127))).reshape(x.shape)


@pytest.mark.parametrize(
    ("k", "n", "shape", "tolerance"),
    [
        (576, 96, (1, 1), 1e-4),  # a decode step: one row, 16-bit activations
        (544, 41, (2, 3), 1e-4),  # an odd count of blocks, columns not a multiple of 4, rows in a group of 4 + 2
        (96, 37, (1, 9), 1e-5),  # a prompt: activations on 8 bits, a last tile of 5 columns
        (1056, 24, (130,), 1e-5),  # 2-D A, many rows
        (64, 8, (0,), 0.0),  # no rows
    ],
)
@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
def test_the_kernel_computes_the_float_product_of_its_blocks(
    k: int, n: int, shape: tuple[int, ...], tolerance: float, build: str, native_builds: dict[str, Path]
) -> None:
    """Against the float64 product of its blocks; a prompt's rows (8 and more, AVX-512's path) after
    rounding them to 8 bits a block (the minimums' term too)."""
    rng = np.random.default_rng(k + n)
    tensors, w = _blocks(rng, k, n)
    x = (rng.standard_normal((*shape, k)) * np.where(rng.random(k) < 0.02, 30, 1)).astype(np.float32)
    y = _run(_model(k, n, tensors, len(shape) + 1), x, native_builds[build])
    want = x.astype(np.float64) @ w
    if int(np.prod(shape)) >= 8:
        if build == "native":
            want = _with_8_bit_rows(x, w)
        else:
            tolerance = 1e-4  # those paths take a prompt's rows on 16 bits too
    assert y.shape == (*shape, n)
    assert np.abs(y - want).max(initial=0) <= tolerance * np.abs(want).max(initial=1)


def _with_8_bit_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The float64 product of x's blocks on 8 bits by w's blocks (the minimums' term on the 8-bit rows too)."""
    return _on_8_bits(x).astype(np.float64) @ w


@pytest.mark.parametrize(
    ("k", "n", "rows"),
    [(576, 96, 1), (544, 41, 3), (96, 37, 5), (1056, 24, 4), (224, 9, 7)],  # block counts 18, 17, 3, 33, 7
)
def test_a_few_rows_at_level_4_are_on_8_bits_as_mlas_rounds_them(k: int, n: int, rows: int) -> None:
    """A node not marked few_rows (`rtn`'s) at accuracy level 4: a decode step's rows on 8 bits a block too
    (AVX-512 VNNI's path: four blocks of a column a load, the last group ragged)."""
    rng = np.random.default_rng(k + rows)
    tensors, w = _blocks(rng, k, n)
    x = (rng.standard_normal((rows, k)) * np.where(rng.random(k) < 0.02, 30, 1)).astype(np.float32)
    y = _run(_model(k, n, {"B": tensors["B"], "halves": tensors["halves"]}, 2, few_rows=0), x, _library())
    want = _with_8_bit_rows(x, w)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    exact = x.astype(np.float64) @ w
    assert np.abs(y - exact).max() > 1e-4 * np.abs(exact).max()  # not the 16-bit path's


def test_below_accuracy_level_4_a_prompt_keeps_about_16_bits() -> None:
    """A node at accuracy level 0 (a float activations' request) takes a prompt's rows on 8 bits twice (x,
    then what that loses): within the 16-bit paths' error of the float product, far below 8 bits'."""
    rng = np.random.default_rng(8)
    tensors, w = _blocks(rng, 256, 48)
    x = (rng.standard_normal((12, 256)) * np.where(rng.random(256) < 0.02, 30, 1)).astype(np.float32)
    want = x.astype(np.float64) @ w
    model = _model(256, 48, tensors, 2)
    eight = np.abs(_run(model, x, _library()) - want).max()
    model.graph.node[0].attribute.append(helper.make_attribute("accuracy_level", 0))
    sixteen = np.abs(_run(model, x, _library()) - want).max()
    assert sixteen <= 1e-4 * np.abs(want).max() and sixteen < eight / 20, (sixteen, eight)


def test_the_kernel_reads_only_the_blocks_and_its_threads_agree() -> None:
    """The two ORT-form inputs are not read by the kernel (zeros there change nothing); one thread and
    two give the same numbers."""
    rng = np.random.default_rng(3)
    tensors, _ = _blocks(rng, 256, 64)
    x = rng.standard_normal((1, 1, 256)).astype(np.float32)
    library = _library()
    y = _run(_model(256, 64, tensors, 3), x, library)
    zeroed = {**tensors, "scales": np.zeros_like(tensors["scales"]), "offsets": np.zeros_like(tensors["offsets"])}
    assert np.array_equal(_run(_model(256, 64, zeroed, 3), x, library), y)
    assert np.array_equal(_run(_model(256, 64, tensors, 3), x, library, threads=1), y)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x_width": 250}, "A's last dimension is not K"),
        ({"B": np.zeros(10, np.uint8)}, "B does not hold N x K / 32 blocks"),
        ({"halves": np.zeros((64, 2, 7), np.float16)}, "the scales and minimums are not N x 2 x K / 32"),
        ({"halves": np.zeros((64, 2, 8), np.float32)}, r"input parameter \(halves\) of operator \(MatMul4Bits\)"),
    ],
)
def test_a_malformed_node_fails_with_what_is_wrong(change: dict[str, object], message: str) -> None:
    rng = np.random.default_rng(4)
    tensors, _ = _blocks(rng, 256, 64)
    tensors.update({name: value for name, value in change.items() if name != "x_width"})  # type: ignore[misc]
    width = int(change.get("x_width", 256))  # type: ignore[call-overload]
    model = _model(256, 64, tensors, 2)
    model.graph.input[0].type.tensor_type.shape.dim[-1].dim_value = width
    with pytest.raises(Exception, match=message):
        _run(model, rng.standard_normal((1, width)).astype(np.float32), _library())


def test_k_not_a_multiple_of_the_block_is_refused_when_the_session_is_made() -> None:
    tensors, _ = _blocks(np.random.default_rng(5), 64, 8)
    model = _model(64, 8, tensors, 2)
    next(a for a in model.graph.node[0].attribute if a.name == "K").i = 60
    with pytest.raises(Exception, match="K a multiple of 32"):
        _run(model, np.zeros((1, 60), np.float32), _library())


def _product(model: onnx.ModelProto, x: np.ndarray, level: int) -> np.ndarray:
    """ORT alone on the lowered model, its MatMulNBits at `level` unless a node sets its own."""
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
            node.attribute.append(helper.make_attribute("accuracy_level", level))
    return _run(model, x, None, threads=1)


def test_ort_operators_in_its_place_compute_the_same_product() -> None:
    """Lowered for a decode step (`few_rows`): ORT's int8 activations round each block of x to 255 steps,
    the remainder fed as a second row brings the product back within ~1/200 of that error (activations with
    outliers, as a norm's output has); for a prompt, float activations set on the nodes."""
    rng = np.random.default_rng(5)
    k, n = 192, 96
    tensors, w = _blocks(rng, k, n)
    x = (rng.standard_normal((1, 3, k)) * np.where(rng.random(k) < 0.02, 30, 1)).astype(np.float32)
    want = x.astype(np.float64) @ w
    decode = lowered(_model(k, n, tensors, 3))
    assert {node.domain for node in decode.graph.node} <= {"", "com.microsoft"}
    error = {level: np.abs(_product(lowered(_model(k, n, tensors, 3)), x, level) - want).max() for level in (0, 4)}
    for node in decode.graph.node:
        if node.name.endswith(".lost"):  # x minus x itself: the second row zero, the int8 grid alone
            node.input[1] = node.input[0]
    error["int8 alone"] = np.abs(_product(decode, x, 4) - want).max()
    assert error[0] < 1e-4 * np.abs(want).max() and error[4] < error["int8 alone"] / 50, error
    prompt = lowered(_model(k, n, tensors, 3, few_rows=0))
    levels = [a.i for node in prompt.graph.node if node.op_type == "MatMulNBits" for a in node.attribute
              if a.name == "accuracy_level"]  # fmt: skip
    assert levels == [0]
    assert np.abs(_product(prompt, x, 4) - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("few_rows", [0, 1])
def test_ort_operators_in_its_place_make_their_tensors_of_the_halves(few_rows: int) -> None:
    """A node naming only the blocks and their halves (as exports write it): ORT's scales and offsets are
    made of the halves in the graph, the same product."""
    rng = np.random.default_rng(9)
    k, n = 160, 40
    tensors, w = _blocks(rng, k, n)
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    model = lowered(_model(k, n, {"B": tensors["B"], "halves": tensors["halves"]}, 3, few_rows=few_rows))
    assert {node.domain for node in model.graph.node} <= {"", "com.microsoft"}
    want = x.astype(np.float64) @ w
    assert np.abs(_product(model, x, 4) - want).max() < 1e-4 * np.abs(want).max()


def test_symmetric_blocks_are_one_matmulnbits_without_the_kernel() -> None:
    """`symmetric` (m = -8 s, `rtn`'s blocks): ORT's MatMulNBits alone at the session's accuracy level, as
    ORT's own quantizer writes it; the kernel gives the same product (at level 4 on 8-bit activations)."""
    rng = np.random.default_rng(10)
    k, n = 128, 24
    tensors, _ = _blocks(rng, k, n)
    halves = tensors["halves"].copy()
    halves[:, 1] = -8 * halves[:, 0].astype(np.float32)
    q = np.stack([tensors["B"] & 15, tensors["B"] >> 4], -1).reshape(n, k // BLOCK, BLOCK)  # low nibble first
    w = ((q.astype(np.float64) - 8) * halves[:, 0, :, None].astype(np.float64)).reshape(n, k).T
    node = _model(k, n, {"B": tensors["B"], "halves": halves}, 2, few_rows=0)
    node.graph.node[0].attribute.append(helper.make_attribute("symmetric", 1))
    model = lowered(node)
    assert [n.op_type for n in model.graph.node if n.op_type.startswith("MatMul")] == ["MatMulNBits"]
    x = rng.standard_normal((1, k)).astype(np.float32)
    want = x.astype(np.float64) @ w
    assert np.abs(_product(model, x, 0) - want).max() < 1e-4 * np.abs(want).max()  # ORT's, at float activations
    on_8_bits = _with_8_bit_rows(x, w)  # the kernel's at level 4, as ORT's int8 kernel
    assert np.abs(_run(node, x, _library()) - on_8_bits).max() < 1e-5 * np.abs(want).max()


def test_without_the_kernel_a_session_model_has_ort_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors, _ = _blocks(np.random.default_rng(6), 64, 8)
    graph = FinalizedGraph(name="g", model=_model(64, 8, tensors, 2), weights={}, inputs=(), outputs=())
    monkeypatch.setattr(native_ops, "_built", NativeOps(None, "not built, for the test"))
    model, _ = session_model(graph, SessionSettings())
    assert MATMUL_4BITS not in {node.op_type for node in model.graph.node}
    assert "MatMulNBits" in {node.op_type for node in model.graph.node}


def test_no_compiler_is_a_reason_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("QUIVER_NATIVE", str(tmp_path / "native"))
    assert built_library() == "no C compiler found (set CC, or install gcc or clang)"
    monkeypatch.setenv("QUIVER_NATIVE", "off")
    assert "turned off" in str(built_library())


def test_a_failed_build_is_a_reason_and_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'cc: error: out of luck' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("QUIVER_NATIVE", str(tmp_path / "native"))
    assert built_library() == f"its build failed ({compiler}: cc: error: out of luck)"
    assert not list((tmp_path / "native").rglob("*.so"))


def test_a_build_folder_others_may_write_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("QUIVER_NATIVE", str(shared))
    assert "is not this user's alone" in str(built_library())
    shared.chmod(0o700)
    assert isinstance(built_library(), Path) and (shared.stat().st_mode & 0o777) == 0o700


_BUILD_FAMILY = """
import sys, quiver
from quiver.testing.family import SMALL, make_family
context = quiver.Context.create("cpu")
for name, model in make_family(SMALL, count=2, tuned_layers=1, seed=7).items():
    context.add_graph(name, model)
sys.stdout.buffer.write(context.get_binary())
"""


def test_a_context_built_after_the_kernel_ran_is_the_same_file() -> None:
    """ORT writes every custom-op domain its process has met into the optimized graphs it saves (a context's
    prepared forms): Quiver leaves `ai.quiver` out of those that do not use it."""
    import subprocess
    import sys

    import quiver
    from quiver.testing.family import SMALL, make_family

    tensors, _ = _blocks(np.random.default_rng(7), 64, 8)
    _run(_model(64, 8, tensors, 2), np.ones((1, 64), np.float32), _library())  # the domain met in this process
    context = quiver.Context.create("cpu")
    for name, model in make_family(SMALL, count=2, tuned_layers=1, seed=7).items():
        context.add_graph(name, model)
    fresh = subprocess.run([sys.executable, "-c", _BUILD_FAMILY], capture_output=True, check=True).stdout
    assert context.get_binary() == fresh

"""Weight quantizers of `quiver t2t export` (`--quantizer`, `--override`): rtn, rtn-asym and rtn-min, the accuracy
level the config asks for, and the report of what quantizing cost, on the tiny model against the numpy forward pass."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from safetensors.numpy import save_file

import quiver
from quiver.backends.cpu import native_ops
from quiver.backends.cpu import session_model as session_model_module
from quiver.backends.cpu.native_ops import built_library, lowered
from quiver.errors import QuantizationError
from quiver.ir.quiver_ops import MATMUL_4BITS, QUIVER_DOMAIN
from quiver.t2t import batch as batch_module
from quiver.t2t import export as export_module
from quiver.t2t.batch import BatchDecoder
from quiver.t2t.config import read_dialog_config
from quiver.t2t.dialog import Dialog
from quiver.t2t.export import ExportOptions, export
from quiver.t2t.graph import LM_HEAD_NODE
from quiver.t2t.quality import DEFAULT_PROMPTS, quality_report
from quiver.t2t.quantizers import (
    CALIBRATED,
    HEAD_WEIGHT,
    QUANTIZERS,
    SHORTLIST,
    SHORTLIST_SIZE,
    TABLE,
    _ort_rtn,
    _with_block_minimums,
    block_minimums,
    carried_head,
    head_bits,
    hqq_minimums,
    parse_override,
    quantize_weights,
)
from tests.support.greedy import dialog_greedy
from tests.support.tiny_llm import forward, tiny_adapter, tiny_decoder

IDS = [5, 17, 42, 8, 99]
BLOCK = 32
EXACT = 5e-4  # logits from exact blocks, activations rounded to ~16 bits: within this of the float model's


def _on_a_q4_1_grid(weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A Linear weight [out, in] as GGUF's Q4_1 stores one: blocks of 32 along `in`, each s q + m with q
    spanning 0..15 (its minimum and maximum present), s and m float16 values."""
    out, size = weight.shape
    q = rng.integers(0, 16, (out, size // BLOCK, BLOCK))
    q[..., 0], q[..., 1] = 0, 15
    scales = rng.uniform(0.002, 0.02, (out, size // BLOCK, 1)).astype(np.float16).astype(np.float64)
    minimums = rng.uniform(-0.15, 0.0, (out, size // BLOCK, 1)).astype(np.float16).astype(np.float64)
    return (scales * q + minimums).astype(np.float32).reshape(out, size)


@pytest.fixture(scope="module")
def gridded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """The tiny model with every projection on a Q4_1 grid (as SmolLM2's weights are)."""
    folder = tmp_path_factory.mktemp("gridded") / "model"
    weights = tiny_decoder(folder)
    rng = np.random.default_rng(3)
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        weights[name] = _on_a_q4_1_grid(weights[name], rng)
    save_file(weights, str(folder / "model.safetensors"))
    return folder, weights


def _logits(config: Path) -> np.ndarray:
    with Dialog.from_config(config) as dialog:
        dialog.token_query(IDS, max_new_tokens=1)
        return dialog._logits.reshape(-1).astype(np.float64)


def test_block_minimums_recover_a_q4_1_grid_and_round_anything_else_to_half_a_step() -> None:
    rng = np.random.default_rng(0)
    grid = _on_a_q4_1_grid(rng.standard_normal((48, 64)).astype(np.float32), rng).T  # [K, N]
    q, scales, minimums = block_minimums(grid, BLOCK)
    rebuilt = (scales[..., None] * q + minimums[..., None]).reshape(48, 64).T
    np.testing.assert_allclose(rebuilt, grid, rtol=0, atol=1e-6)
    noise = rng.standard_normal((64, 48)).astype(np.float32)
    q, scales, minimums = block_minimums(noise, BLOCK)
    rebuilt = (scales[..., None] * q + minimums[..., None]).reshape(48, 64).T
    step = np.repeat(scales, BLOCK, axis=1).T
    assert np.all(np.abs(rebuilt - noise) <= step / 2 + 1e-6) and q.max() == 15 and q.min() == 0


def test_hqq_keeps_a_q4_1_grid_and_rounds_other_weights_closer_than_their_range_does() -> None:
    rng = np.random.default_rng(4)
    grid = _on_a_q4_1_grid(rng.standard_normal((48, 64)).astype(np.float32), rng).T  # [K, N]
    q, scales, minimums = hqq_minimums(grid, BLOCK)
    np.testing.assert_allclose((scales[..., None] * q + minimums[..., None]).reshape(48, 64).T, grid, atol=1e-6)
    weights = rng.standard_normal((256, 96)).astype(np.float32)
    errors = {}
    for fit in (block_minimums, hqq_minimums):
        q, scales, minimums = fit(weights, BLOCK)
        errors[fit.__name__] = np.abs((scales[..., None] * q + minimums[..., None]).reshape(96, 256).T - weights).mean()
    assert errors["hqq_minimums"] < 0.98 * errors["block_minimums"], errors


def test_rtn_min_exports_compute_what_the_float_weights_compute(gridded: tuple[Path, dict], tmp_path: Path) -> None:
    folder, weights = gridded
    want = forward(weights, IDS)
    float_head = ExportOptions(context_size=64, weight_bits=4, quantizer="rtn-min", overrides=((HEAD_WEIGHT, None),))
    config = export(folder, tmp_path / "float-head", options=float_head).path
    assert read_dialog_config(config).accuracy_level is None
    # activations on ~16 bits (Quiver's kernel) or float (ORT's operators in its place): within their rounding
    np.testing.assert_allclose(_logits(config), want, rtol=0, atol=EXACT)
    # the default head (tied): a 4-bit shortlist whose best tokens' logits come from the table's rows, exact
    # where the table stays float (by default it is 8-bit: close, not exact)
    float_table = (("model.embed_tokens.weight", None),)
    options = ExportOptions(64, weight_bits=4, quantizer="rtn-min", overrides=float_table)
    shortlisted = _logits(export(folder, tmp_path / "rtn-min", options=options).path)
    exact = np.abs(shortlisted - want) <= EXACT
    assert exact.sum() >= SHORTLIST_SIZE and exact[np.argsort(want)[-8:]].all() and not exact.all()
    default = _logits(
        export(folder, tmp_path / "rtn-min-8", options=ExportOptions(64, weight_bits=4, quantizer="rtn-min")).path
    )
    best = np.argsort(want)[-8:]
    assert not np.allclose(default[best], want[best], rtol=0, atol=EXACT)
    np.testing.assert_allclose(default[best], want[best], rtol=0, atol=0.02 * np.abs(want[best]).max())
    rounded = _logits(export(folder, tmp_path / "rtn", options=ExportOptions(context_size=64, weight_bits=4)).path)
    assert np.abs(rounded - want).max() > 10 * EXACT  # symmetric blocks lose the grid


def _greedy_reply(config: Path) -> tuple[list[int], np.ndarray]:
    """12 greedy tokens after IDS and the last step's logits (on Quiver's kernels where they are built)."""
    with Dialog.from_config(config) as dialog:
        tokens = dialog.token_query(IDS, max_new_tokens=12, min_new_tokens=12, greedy=True).new_ids
        return tokens, dialog._logits.reshape(-1).astype(np.float64)


def test_rtn_min_decodes_the_same_tokens_with_ort_operators_in_place_of_quivers_kernel(
    gridded: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Quiver's kernel is not built (no compiler, another processor), the decode graph's MatMul4Bits
    nodes run as ORT's operators: the same greedy tokens, the same logits within the rounding."""
    folder, _ = gridded
    options = ExportOptions(64, weight_bits=4, quantizer="rtn-min", overrides=(("model.embed_tokens.weight", None),))
    config = export(folder, tmp_path / "rtn-min", options=options).path

    assert native_ops.native_ops().path is not None, native_ops.native_ops().reason
    kernel_tokens, kernel_logits = _greedy_reply(config)
    lowered_graphs: list[str] = []
    real_lowered = native_ops.lowered
    monkeypatch.setattr(native_ops, "_built", native_ops.NativeOps(None, "not used, for the test"))
    monkeypatch.setattr(
        session_model_module, "lowered", lambda m: lowered_graphs.append(m.graph.name) or real_lowered(m)
    )
    ort_tokens, ort_logits = _greedy_reply(config)
    assert lowered_graphs and ort_tokens == kernel_tokens
    finite = np.isfinite(kernel_logits)  # the shortlist's rescored logits; the others the same -inf on both
    assert finite.any() and np.array_equal(np.isfinite(ort_logits), finite)
    scale = np.abs(kernel_logits[finite]).max()
    np.testing.assert_allclose(ort_logits[finite], kernel_logits[finite], rtol=0, atol=1e-3 * scale)


def _attention_ops(config: Path, prompts: str, steps: str) -> None:
    """The export's graph `steps` attends with Quiver's DecodeAttention and `prompts` with ORT's
    GroupQueryAttention, neither with the other."""
    with quiver.Context.from_binary(config.parent / "model.qctx") as context:
        ops = {g: {n.op_type for n in context.finalized_graph(g).model.graph.node} for g in (prompts, steps)}
    assert "DecodeAttention" in ops[steps] and "GroupQueryAttention" not in ops[steps]
    assert "GroupQueryAttention" in ops[prompts] and "DecodeAttention" not in ops[prompts]


def _within_float32s_rounding(ort_logits: np.ndarray, kernel_logits: np.ndarray) -> None:
    """Logits of ORT's GroupQueryAttention and of Quiver's DecodeAttention on the same MatMul kernels: the
    same -inf ones (outside the head's shortlist), the others within float32's rounding, not all the same
    bits (the two attentions round apart: both graphs ran)."""
    finite = np.isfinite(kernel_logits)
    assert finite.any() and np.array_equal(np.isfinite(ort_logits), finite)
    scale = np.abs(kernel_logits[finite]).max()
    np.testing.assert_allclose(ort_logits[finite], kernel_logits[finite], rtol=0, atol=1e-5 * scale)
    assert not np.array_equal(ort_logits, kernel_logits)


def test_an_int4_decode_step_runs_quivers_attention_the_same_tokens_as_orts(
    gridded: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rtn's decode step (no float weights for ORT to pack) is a graph of its own whose attention is Quiver's
    DecodeAttention; the same greedy tokens and logits within float32's rounding as ORT's GroupQueryAttention
    in its place (the kernel not built); a float export's decode step stays the prefill graph's body."""
    folder, _ = gridded
    config = export(folder, tmp_path / "rtn", options=ExportOptions(64, weight_bits=4)).path
    _attention_ops(config, prompts="prefill", steps="decode")
    float_config = export(folder, tmp_path / "float", options=ExportOptions(64)).path
    with quiver.Context.from_binary(float_config.parent / "model.qctx") as context:
        assert "DecodeAttention" not in {n.op_type for n in context.finalized_graph("decode").model.graph.node}

    assert native_ops.native_ops().path is not None, native_ops.native_ops().reason
    kernel_tokens, kernel_logits = _greedy_reply(config)
    # the same export with ORT's GroupQueryAttention in the decode step (the same MatMul kernels): the same
    # within float32's rounding (the logits outside the head's shortlist are -inf in both)
    monkeypatch.setattr(export_module, "decode_step_graph", lambda model: model)
    gqa_config = export(folder, tmp_path / "gqa", options=ExportOptions(64, weight_bits=4)).path
    gqa_tokens, gqa_logits = _greedy_reply(gqa_config)
    assert gqa_tokens == kernel_tokens
    _within_float32s_rounding(gqa_logits, kernel_logits)
    # and without Quiver's library: every node ORT's own, the same tokens
    monkeypatch.setattr(native_ops, "_built", native_ops.NativeOps(None, "not used, for the test"))
    assert _greedy_reply(config)[0] == kernel_tokens


def _batch_greedy(
    config: Path, prompts: list[list[int]], tokens: int, adapters: list[str | None]
) -> tuple[list[list[int]], np.ndarray]:
    """`tokens` greedy tokens after each prompt from the serving decoder, every row in each decode step
    (rows of other lengths, each on its adapter: None for the base model), and the last step's logits."""
    decoder = BatchDecoder.from_config(config, max_batch=len(prompts))
    try:
        slots = [slot for slot in map(decoder.acquire_slot, adapters) if slot is not None]
        assert len(slots) == len(adapters)
        replies = [[int(np.argmax(decoder.prefill(row, p, 0, slots[row])))] for row, p in enumerate(prompts)]
        for step in range(tokens - 1):
            cached = [len(p) + step for p in prompts]
            logits = decoder.decode([r[-1] for r in replies], cached, slots)
            for reply, row in zip(replies, logits):
                reply.append(int(np.argmax(row)))
        return replies, logits.astype(np.float64)
    finally:
        decoder.close()


def test_an_int4_servers_decode_steps_run_quivers_attention_the_same_tokens_as_orts(
    gridded: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched graph's decode step is a graph of its own in an int4 export ("batch_decode", Quiver's
    DecodeAttention; prompts stay on "batch"): three rows of other lengths, the base model's and an
    adapter's, decode the same greedy tokens as with ORT's GroupQueryAttention in its place, and as the
    dialog does on the base model; a float export has no such graph."""
    folder, weights = gridded
    tiny_adapter(tmp_path / "adapter", weights, 4, ["q_proj", "v_proj", "down_proj"], seed=5)
    config = export(
        folder, tmp_path / "rtn", {"chat": tmp_path / "adapter"}, options=ExportOptions(64, weight_bits=4)
    ).path
    _attention_ops(config, prompts="batch", steps="batch_decode")
    float_config = export(folder, tmp_path / "float", options=ExportOptions(64)).path
    with quiver.Context.from_binary(float_config.parent / "model.qctx") as context:
        assert "batch_decode" not in context.graph_names

    prompts = [IDS, IDS[:2], [7, 3, 11, 2, 60, 31, 9, 14]]
    assert native_ops.native_ops().path is not None, native_ops.native_ops().reason
    base_tokens = _batch_greedy(config, prompts, 10, [None] * 3)[0]
    with Dialog.from_config(config) as dialog:
        assert dialog_greedy(dialog, prompts, 10) == base_tokens
    adapters: list[str | None] = [None, "chat", "chat"]  # a step of mixed adapters: each row its own tables
    kernel_tokens, kernel_logits = _batch_greedy(config, prompts, 10, adapters)
    assert kernel_tokens[0] == base_tokens[0] and kernel_tokens[1:] != base_tokens[1:]  # the adapter's text
    # the batched graph's own steps (ORT's GroupQueryAttention, the same MatMul kernels): the same within
    # float32's rounding
    monkeypatch.setattr(batch_module, "BATCH_DECODE_GRAPH", "no such graph")
    gqa_tokens, gqa_logits = _batch_greedy(config, prompts, 10, adapters)
    assert gqa_tokens == kernel_tokens
    _within_float32s_rounding(gqa_logits, kernel_logits)
    # without Quiver's library the step's graph is the batched graph's own again, node for node: the very
    # same logits on both
    monkeypatch.setattr(native_ops, "_built", native_ops.NativeOps(None, "not used, for the test"))
    lowered_tokens, lowered_logits = _batch_greedy(config, prompts, 10, adapters)
    monkeypatch.setattr(batch_module, "BATCH_DECODE_GRAPH", "batch_decode")
    step_tokens, step_logits = _batch_greedy(config, prompts, 10, adapters)
    assert step_tokens == lowered_tokens and np.array_equal(step_logits, lowered_logits)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's per-mapping RSS")
def test_an_int4_dialogs_two_sessions_read_one_mapping_of_the_blocks(
    gridded: tuple[Path, dict], tmp_path: Path
) -> None:
    """The prefill and the decode step are two ORT sessions of one context: Quiver's kernel's blocks reach
    both as views of the context's one mapping, where ORT mapped the file again for each session (the
    same pages twice in the RSS: a 1B model's 737 MiB counted as 1474)."""
    import re

    folder, _ = gridded
    config = export(folder, tmp_path / "rtn", options=ExportOptions(64, weight_bits=4)).path
    context_file = config.parent / "model.qctx"
    with Dialog.from_config(config) as dialog:
        dialog.token_query(IDS, max_new_tokens=4, min_new_tokens=4, greedy=True)
        dialog.context.wait_until_ready()
        dialog.token_query(IDS, max_new_tokens=4, min_new_tokens=4, greedy=True)
        mapped = [
            int(re.search(r"^Rss:\s+(\d+) kB", block, re.M).group(1)) * 1024  # type: ignore[union-attr]
            for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text())
            if block.split("\n")[0].endswith(str(context_file))
        ]
    # the rest: a few pages of the small weights other nodes read, mapped by ORT for each session
    assert mapped and sum(mapped) < 1.5 * context_file.stat().st_size, (sum(mapped), context_file.stat().st_size)


def _product(model: onnx.ModelProto, x: np.ndarray, level: int) -> np.ndarray:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:  # a node that sets its own level keeps it, as Quiver's backend runs it
        if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(copy.SerializeToString(), options).run(None, {"x": x})[0]


def test_float_minimum_blocks_are_one_node_of_quivers_kernel_for_a_prompt_and_a_decode_step() -> None:
    """Both forms are Quiver's MatMul4Bits (the kernel, or ORT's operators in its place: both tested in
    test_native_ops), a prompt's at accuracy level 0 (activations kept to ~16 bits, as a decode step's).
    Both compute x by the fitted blocks, their scales and minimums rounded to float16."""
    rng = np.random.default_rng(5)
    k, n = 192, 96
    weight = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="projection")], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, None, k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    opsets = [onnx.helper.make_opsetid("", 21)]
    decode = _with_block_minimums(onnx.helper.make_model(graph, opset_imports=opsets), BLOCK, {"projection"},
                                  exact_rows=True)  # fmt: skip
    prompt = _with_block_minimums(onnx.helper.make_model(graph, opset_imports=opsets), BLOCK, {"projection"})
    for model in (decode, prompt):
        assert [(node.domain, node.op_type) for node in model.graph.node] == [(QUIVER_DOMAIN, MATMUL_4BITS)]
    (levels,) = [[a.i for a in n.attribute if a.name == "accuracy_level"] for n in prompt.graph.node]
    assert levels == [0]
    q, scales, minimums = block_minimums(weight, BLOCK)
    scales, minimums = (a.astype(np.float16).astype(np.float64) for a in (scales, minimums))
    blocks = (scales[..., None] * q + minimums[..., None]).reshape(n, k).T
    library = built_library()
    assert isinstance(library, Path), library
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    for rows, model in ((3, decode), (12, prompt)):  # 12: a prompt's path (8 rows and more)
        x = (rng.standard_normal((1, rows, k)) * np.where(rng.random(k) < 0.02, 30, 1)).astype(np.float32)
        want = x.astype(np.float64) @ blocks
        got = ort.InferenceSession(model.SerializeToString(), options).run(None, {"x": x})[0]
        # x's blocks on ~16 bits: a block with an outlier (30x) has a 30x coarser step for the others
        assert np.abs(got - want).max() < 3e-4 * np.abs(want).max(), rows
    assert np.abs(_product(lowered(prompt), x, 4) - want).max() < 1e-4 * np.abs(want).max()


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _one_projection(k: int = 96, n: int = 40) -> tuple[onnx.ModelProto, np.ndarray]:
    """A graph of one MatMul by a constant [K, N] weight (a layer's, not the head), and that weight."""
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(11).standard_normal((k, n)).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="/model/layers.0/mlp/down_proj/MatMul")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), weight


def _kernel_weights(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray, bool]:
    """The one MatMul4Bits node's weight as its blocks dequantize ([K, N]: s q + m), its q, and `symmetric`."""
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == (QUIVER_DOMAIN, MATMUL_4BITS)
    tensors = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    packed, halves = tensors[node.input[1]], tensors[node.input[2]].astype(np.float32)
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(len(packed), -1, BLOCK).astype(np.float32)
    w = q * halves[:, 0, :, None] + halves[:, 1, :, None]
    symmetric = next(a.i for a in node.attribute if a.name == "symmetric")
    return w.reshape(len(w), -1).T, q.reshape(len(q), -1).T, bool(symmetric)


@pytest.mark.parametrize("quantizer", ["rtn-asym", "gptq", "gptq-asym"])
def test_blocks_with_zero_points_and_gptqs_are_quivers_kernels_blocks(quantizer: str) -> None:
    """`rtn-asym`'s and GPTQ's 4-bit blocks of 32 are MatMul4Bits nodes: each block's scale and minimum -z s
    (float16) hold the weights the quantizer made, within float16's rounding of the scale (GPTQ's own
    blocks; `rtn-asym`'s as ORT's MatMulNBits takes them: its zero points unpacked)."""
    model, weight = _one_projection()
    moments = {"x": np.eye(len(weight), dtype=np.float64)} if quantizer in CALIBRATED else None
    solved: dict[str, Any] = {}
    quantized = quantize_weights(_copy(model), 4, BLOCK, quantizer=quantizer, moments=moments, solved=solved)
    got, q, symmetric = _kernel_weights(quantized)
    assert symmetric == (quantizer == "gptq")
    if quantizer == "rtn-asym":  # ORT's own blocks of the same weight (MatMulNBits' tensors), zero points unpacked
        ort_form = _ort_rtn(_copy(model), 4, BLOCK, {model.graph.node[0].name}, symmetric=False)
        tensors = {t.name: numpy_helper.to_array(t) for t in ort_form.graph.initializer}
        packed, scales, points = (tensors[f"w_{part}"] for part in ("Q4", "scales", "zero_points"))
        nibbles = lambda a: np.stack([a & 15, a >> 4], axis=-1).reshape(len(a), -1).astype(np.float32)  # noqa: E731
        blocks = nibbles(packed.reshape(len(packed), -1)).reshape(len(packed), -1, BLOCK)
        zeros = nibbles(points)[:, : scales.shape[1]]
        want = ((blocks - zeros[..., None]) * scales[..., None]).reshape(len(blocks), -1).T
    else:
        blocks = solved["w"]
        assert np.array_equal(q, blocks.q)  # GPTQ's integers as it solved them
        want = blocks.dequantized()
    step = np.abs(weight).max() / 7.5
    assert np.abs(got - want).max() < 0.01 * step
    assert np.abs(got - weight).max() < step  # and each weight within a step of the float one


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_every_quantizer_stays_close_to_float_on_other_weights(tmp_path: Path, quantizer: str) -> None:
    weights = tiny_decoder(tmp_path / "model")
    calibration = DEFAULT_PROMPTS if quantizer in CALIBRATED else ()
    options = ExportOptions(context_size=64, weight_bits=4, quantizer=quantizer, calibration=calibration)
    logits, want = _logits(export(tmp_path / "model", tmp_path / "out", options=options).path), forward(weights, IDS)
    assert logits @ want / np.linalg.norm(logits) / np.linalg.norm(want) > 0.9


def test_the_accuracy_level_is_the_users_when_given(gridded: tuple[Path, dict], tmp_path: Path) -> None:
    options = ExportOptions(context_size=64, weight_bits=4, quantizer="rtn-min", accuracy_level=4)
    config = export(gridded[0], tmp_path, options=options).path
    assert read_dialog_config(config).accuracy_level == 4
    document = json.loads(config.read_text())
    assert document["dialog"]["engine"]["model"]["binary"]["quiver"]["accuracy-level"] == 4
    assert read_dialog_config(export(gridded[0], tmp_path / "float", options=ExportOptions(context_size=64)).path
                              ).accuracy_level is None  # fmt: skip
    document["dialog"]["engine"]["model"]["binary"]["quiver"]["accuracy-level"] = 7
    (tmp_path / "bad.json").write_text(json.dumps(document))
    with pytest.raises(quiver.DialogConfigError, match="accuracy-level"):
        read_dialog_config(tmp_path / "bad.json")


def test_quantizers_and_widths_that_do_not_exist_are_refused() -> None:
    import onnx

    model = onnx.ModelProto()
    with pytest.raises(QuantizationError, match="unknown quantizer 'awq'; choose one of rtn, rtn-asym, rtn-min, hqq"):
        quantize_weights(model, 4, 32, quantizer="awq")
    with pytest.raises(QuantizationError, match="rtn-min quantizer makes 4-bit weights"):
        quantize_weights(model, 8, 32, quantizer="rtn-min")
    with pytest.raises(QuantizationError, match="gptq quantizer needs calibration prompts"):
        quantize_weights(model, 4, 32, quantizer="gptq")


def test_gptq_without_calibration_prompts_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    tiny_decoder(tmp_path / "model")
    with pytest.raises(QuantizationError, match="give --calibration FILE"):
        export(tmp_path / "model", tmp_path / "out", options=ExportOptions(weight_bits=4, quantizer="gptq-asym"))
    assert not (tmp_path / "out").exists()


def test_the_cli_exports_with_a_named_quantizer(gridded: tuple[Path, dict], tmp_path: Path) -> None:
    import subprocess
    import sys

    command = [sys.executable, "-m", "quiver", "t2t", "export", "--model", str(gridded[0]), "-o", str(tmp_path),
               "--context-size", "64", "--weight-bitwidth", "4", "--override", "lm_head.weight=float",
               "--quantizer", "rtn-min"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "4-bit kernel is not used" not in result.stderr  # built on this machine
    without = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ,
                             "QUIVER_NATIVE": "off"})  # fmt: skip
    assert without.returncode == 0 and without.stderr.strip().splitlines()[-1] == (
        "quiver: note: Quiver's 4-bit kernel is not used here (turned off (QUIVER_NATIVE=off)): these blocks run "
        "on ONNX Runtime's operators instead, the same tokens, slower"
    )
    # rtn-min's blocks hold the grid: the float weights' logits (rtn's would be off by > 2e-3)
    np.testing.assert_allclose(_logits(tmp_path / "genie_config.json"), forward(gridded[1], IDS), rtol=0, atol=EXACT)
    refused = subprocess.run([*command[:-1], "awq"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "'awq' is not one of 'rtn', 'rtn-asym', 'rtn-min', 'hqq'" in refused.stderr
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\n")
    calibrated = [*command[:-1], "gptq-asym", "--calibration", str(prompts), "-o", str(tmp_path / "gptq")]
    result = subprocess.run(calibrated, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert read_dialog_config(tmp_path / "gptq" / "genie_config.json").accuracy_level is None
    bad = subprocess.run([*command, "--override", "lm_head.weight=2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "write PATTERN=4, PATTERN=8 or PATTERN=float" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _three_matmuls() -> Any:
    """Two projections and an LM head (named as `quiver t2t export` names it), each a MatMul by a weight."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
    nodes = [
        helper.make_node("MatMul", ["x", names[0]], ["h0"], name="/model/layers.0/mlp/down_proj/MatMul"),
        helper.make_node("MatMul", ["h0", names[1]], ["h1"], name="/model/layers.1/mlp/down_proj/MatMul"),
        helper.make_node("MatMul", ["h1", names[2]], ["y"], name=LM_HEAD_NODE),
    ]
    weights = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), n) for n in names]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], weights,
    )  # fmt: skip
    return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _bits(model: Any) -> dict[str, int | None]:
    """Each original MatMul's bits in the quantized graph (None: still a float MatMul)."""
    found: dict[str, int | None] = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            found[node.name.removesuffix(".q4").removesuffix("_Q4").removesuffix("_Q8")] = next(
                a.i for a in node.attribute if a.name == "bits"
            )
        elif node.op_type == "MatMul4Bits":  # Quiver's kernel: 4-bit blocks
            found[node.name.removesuffix("_Q4")] = 4
        elif node.op_type == "MatMul" and not node.name.endswith((".minimums", ".block_sums")):
            found.setdefault(node.name, None)
    return found


def test_overrides_set_each_weights_bits_and_the_last_match_wins() -> None:
    layer0, layer1 = "/model/layers.0/mlp/down_proj/MatMul", "/model/layers.1/mlp/down_proj/MatMul"
    default = _bits(quantize_weights(_three_matmuls(), 4, 32, head=LM_HEAD_NODE))
    assert default == {layer0: 4, layer1: 4, LM_HEAD_NODE: 8}
    rules = [parse_override(r) for r in ("lm_head.weight=4", "model.layers.*=float", "model.layers.0.*=8")]
    assert _bits(quantize_weights(_three_matmuls(), 4, 32, head=LM_HEAD_NODE, overrides=rules)) == {
        layer0: 8, layer1: None, LM_HEAD_NODE: 4,
    }  # fmt: skip
    # rtn-min keeps the head float unless told; 8-bit weights under it take symmetric blocks
    minimums = quantize_weights(_three_matmuls(), 4, 32, head=LM_HEAD_NODE, quantizer="rtn-min")
    assert _bits(minimums) == {layer0: 4, layer1: 4, LM_HEAD_NODE: None}
    assert head_bits("rtn-min") is None and head_bits("rtn-min", [("lm_head.weight", 8)]) == 8
    eight = [parse_override("lm_head.weight=8")]
    assert _bits(quantize_weights(_three_matmuls(), 4, 32, head=LM_HEAD_NODE, quantizer="rtn-min", overrides=eight))[
        LM_HEAD_NODE] == 8  # fmt: skip


def test_a_shortlist_head_takes_its_best_logits_from_the_float_rows() -> None:
    """The head at 4 bits ranks; its best SHORTLIST_SIZE logits are the float rows' products (ORT runs it)."""
    import onnxruntime as ort
    from onnx import numpy_helper

    model = _three_matmuls()
    head = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == HEAD_WEIGHT)  # [64, 64]
    model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(head.T), "rows"))
    shortlist = [(HEAD_WEIGHT, SHORTLIST)]
    quantized = quantize_weights(model, 4, 32, head=LM_HEAD_NODE, head_rows="rows", overrides=shortlist)
    assert {n.op_type for n in quantized.graph.node} >= {"TopK", "ScatterElements"}
    assert _bits(quantized)[LM_HEAD_NODE] == 4
    # it ranks with blocks as long as its rows allow (up to RANKING_BLOCK), each with a zero point
    ranking = next(n for n in quantized.graph.node if n.op_type == "MatMulNBits" and n.name.startswith(LM_HEAD_NODE))
    assert next(a.i for a in ranking.attribute if a.name == "block_size") == 64 and len(ranking.input) == 4
    x = {"x": np.random.default_rng(6).standard_normal((1, 64)).astype(np.float32)}

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(built_library()))  # the layers' blocks: Quiver's kernel

    def run(m: Any) -> np.ndarray:
        session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return np.asarray(session.run(None, x)[0])

    # what the head reads: the same quantized layers (ORT's rounding is deterministic), the head cut off
    body = quantize_weights(_three_matmuls(), 4, 32, head=LM_HEAD_NODE)
    kept = [n for n in body.graph.node if "y" not in n.output]
    del body.graph.node[:]
    body.graph.node.extend(kept)
    body.graph.output[0].name = "h1"
    h1 = run(body)
    want = (h1.astype(np.float64) @ head.astype(np.float64)).reshape(-1)
    got = run(quantized).reshape(-1).astype(np.float64)
    exact = np.abs(got - want) <= 1e-3  # float32's rounding of logits in the hundreds; the 4-bit ones are ~1 off
    assert exact.sum() == SHORTLIST_SIZE and exact[np.argsort(want)[-8:]].all()
    assert np.abs(got - want).max() > 1e-3  # the others keep their 4-bit values


def test_only_a_head_with_float_rows_is_a_shortlist() -> None:
    assert head_bits("hqq", tied=True) == head_bits("gptq", tied=True) == SHORTLIST and head_bits("rtn") == 8
    assert head_bits("rtn", tied=True) == head_bits("rtn-asym", tied=True) == TABLE
    assert parse_override("lm_head.weight=shortlist") == (HEAD_WEIGHT, SHORTLIST)
    with pytest.raises(QuantizationError, match="needs the head's float rows"):
        quantize_weights(_three_matmuls(), 4, 32, head=LM_HEAD_NODE, overrides=[(HEAD_WEIGHT, SHORTLIST)])
    with pytest.raises(QuantizationError, match="only the LM head"):
        quantize_weights(_three_matmuls(), 4, 32, head=LM_HEAD_NODE, overrides=[("model.*", SHORTLIST)])


@pytest.mark.parametrize("rule", ["lm_head.weight", "=4", "layers.*=3", "lm_head.weight=fp16"])
def test_an_override_that_is_not_pattern_equals_bits_is_refused(rule: str) -> None:
    with pytest.raises(QuantizationError, match="write PATTERN=4, PATTERN=8 or PATTERN=float"):
        parse_override(rule)


def test_an_override_that_matches_no_weight_is_refused() -> None:
    with pytest.raises(QuantizationError, match=r"'model\.layer\.0\.\*' matches no MatMul weight; weight names look"):
        quantize_weights(_three_matmuls(), 4, 32, head=LM_HEAD_NODE, overrides=[("model.layer.0.*", 8)])


def test_an_export_with_a_quantized_head_under_rtn_min_runs_close_to_float(
    gridded: tuple[Path, dict], tmp_path: Path
) -> None:
    folder, weights = gridded
    options = ExportOptions(context_size=64, weight_bits=4, quantizer="rtn-min", overrides=(("lm_head.weight", 8),))
    logits, want = _logits(export(folder, tmp_path, options=options).path), forward(weights, IDS)
    assert logits @ want / np.linalg.norm(logits) / np.linalg.norm(want) > 0.99
    assert not np.allclose(logits, want, rtol=0, atol=2e-4)  # the head rounded: no longer exact


def test_log_likelihoods_are_each_tokens_log_softmax_given_those_before(
    gridded: tuple[Path, dict], tmp_path: Path
) -> None:
    folder, weights = gridded
    config = export(folder, tmp_path, options=ExportOptions(context_size=64)).path
    ids = [3, *IDS, 7, 11]
    want = []
    for end in range(1, len(ids)):
        logits = forward(weights, ids[:end])
        want.append(logits[ids[end]] - logits.max() - np.log(np.exp(logits - logits.max()).sum()))
    with Dialog.from_config(config) as dialog:
        np.testing.assert_allclose(dialog.log_likelihoods(ids), want, rtol=0, atol=1e-4)
        with pytest.raises(quiver.GenerationError, match="scoring takes 2 to 63 tokens"):
            dialog.log_likelihoods([1])


def test_the_quality_report_sees_what_each_quantizer_kept(gridded: tuple[Path, dict], tmp_path: Path) -> None:
    folder, _ = gridded
    reference = export(folder, tmp_path / "float", options=ExportOptions(context_size=128)).path
    float_head = ExportOptions(128, weight_bits=4, quantizer="rtn-min", overrides=((HEAD_WEIGHT, None),))
    exact = export(folder, tmp_path / "min", options=float_head).path
    rounded = export(folder, tmp_path / "rtn", options=ExportOptions(128, weight_bits=4)).path
    kept = quality_report(reference, exact, tokens=8)
    assert kept.agreement == [8] * len(DEFAULT_PROMPTS) and kept.mean_agreement == 8
    assert kept.quantized_perplexity == pytest.approx(kept.float_perplexity, rel=1e-4)
    sizes = [(path.parent / "model.qctx").stat().st_size for path in (reference, exact)]
    assert [kept.float_bytes, kept.quantized_bytes] == sizes and sizes[1] < sizes[0]
    lost = quality_report(reference, rounded, tokens=8)
    assert abs(lost.quantized_perplexity - lost.float_perplexity) > 1e-3 * lost.float_perplexity


def test_the_cli_reports_what_quantizing_cost(gridded: tuple[Path, dict], tmp_path: Path) -> None:
    import subprocess
    import sys

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\n\nover the lazy dog\n")
    command = [sys.executable, "-m", "quiver", "t2t", "export", "--model", str(gridded[0]), "-o", str(tmp_path / "q"),
               "--context-size", "64", "--weight-bitwidth", "4", "--quantizer", "rtn-min", "--report",
               "--report-prompts", str(prompts), "--report-tokens", "4", "--json"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["report"]
    assert report["prompts"] == ["the quick brown fox", "over the lazy dog"] and report["agreement"] == [4, 4]
    assert report["quantized_bytes"] < report["float_bytes"]
    plain = command[:11] + command[15:]  # without --weight-bitwidth 4 --quantizer rtn-min
    refused = subprocess.run(plain, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "--report compares quantized weights with float ones" in refused.stderr
    (tmp_path / "empty.txt").write_text("\n  \n")
    empty = [*command[:7], "-o", str(tmp_path / "never"), *command[9:]]
    empty[empty.index(str(prompts))] = str(tmp_path / "empty.txt")
    bad = subprocess.run(empty, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no prompts; write one per line" in bad.stderr
    assert not (tmp_path / "never").exists()  # refused before anything was exported


@pytest.mark.parametrize("bits", [8, 4])
def test_a_token_table_in_blocks_gathers_its_rows_dequantized(bits: int) -> None:
    """`model.embed_tokens.weight=8|4`: the Gather reads the table's blocks (ORT's GatherBlockQuantized);
    each row comes back as symmetric rounding of its blocks of 32 gives it, computed here from the formula."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"], name="/model/embed_tokens/Gather", axis=0),
         helper.make_node("MatMul", ["rows", "w"], ["y"], name="/m/MatMul")], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 64])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.eye(64, dtype=np.float32), "w")],
    )  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    quantized = quantize_weights(model, 4, 32, exclude={"w"}, overrides=[("table", bits)])
    assert [n.op_type for n in quantized.graph.node][0] == "GatherBlockQuantized"
    assert "table" not in {t.name for t in quantized.graph.initializer}  # the float table is gone
    session = ort.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 17, 49]], np.int64)
    (rows,) = session.run(["y"], {"ids": ids})
    top = 2 ** (bits - 1) - 1
    blocks = table[ids[0]].reshape(3, 2, 32)
    step = np.abs(blocks).max(axis=-1, keepdims=True) / top
    expected = (np.clip(np.round(blocks / step), -top, top) * step).reshape(1, 3, 64)
    np.testing.assert_allclose(rows, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("quantizer", ["rtn", "rtn-asym"])
@pytest.mark.parametrize("ids_rank_known", [True, False])
def test_a_tied_head_s_4_bit_blocks_are_the_token_table_too(quantizer: str, ids_rank_known: bool) -> None:
    """The fast quantizers' default tied head (`TABLE`): one set of 4-bit blocks, which the embedding's
    Gather reads too: its rows equal the head's columns as ORT's MatMulNBits computes them (by the identity).
    Ids of a known rank (a graph input) reshape by constants; others by their shape, read in the graph."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    vocab, hidden = 50, 80  # hidden not a whole number of blocks: MatMulNBits pads the last one
    table = np.random.default_rng(9).standard_normal((vocab, hidden)).astype(np.float32)
    ids_name = "ids" if ids_rank_known else "ids_copy"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["ids"], ["ids_copy"], name="copy"),
         helper.make_node("Gather", ["table", ids_name], ["rows"], name="/model/embed_tokens/Gather", axis=0),
         helper.make_node("MatMul", ["x", HEAD_WEIGHT], ["y"], name=LM_HEAD_NODE)], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [hidden, hidden])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, 3, hidden]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [hidden, vocab])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.ascontiguousarray(table.T), HEAD_WEIGHT)],
    )  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    again = onnx.ModelProto()
    again.CopyFrom(model)  # quantize_weights edits the model it is given
    quantized = quantize_weights(model, 4, 32, head=LM_HEAD_NODE, head_rows="table", quantizer=quantizer)
    stored = {t.name for t in quantized.graph.initializer}
    assert "table" not in stored and not any(n.op_type == "GatherBlockQuantized" for n in quantized.graph.node)
    assert any(n.op_type == "Shape" for n in quantized.graph.node) != ids_rank_known
    session = ort.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 17, 49]], np.int64)
    rows, head = session.run(["rows", "y"], {"ids": ids, "x": np.eye(hidden, dtype=np.float32)})
    np.testing.assert_allclose(rows[0], head.T[ids[0]], rtol=0, atol=1e-6)  # the head's own numbers
    assert 0 < np.abs(rows[0] - table[ids[0]]).max() < 0.5 * np.abs(table).max()  # 4-bit, not float
    with pytest.raises(QuantizationError, match="no width of its own for that table"):
        quantize_weights(again, 4, 32, head=LM_HEAD_NODE, head_rows="table", overrides=[("table", 8)])


def test_a_token_table_the_float_head_also_reads_is_not_quantized_alone() -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(8).standard_normal((50, 64)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"], name="g", axis=0),
         helper.make_node("MatMul", ["rows", "table_t"], ["y"], name="m"),
         helper.make_node("Transpose", ["table"], ["table_t"], name="t")], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 50])], [numpy_helper.from_array(table, "table")],
    )  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    with pytest.raises(QuantizationError, match="read as float weights beside its Gather"):
        quantize_weights(model, 4, 32, overrides=[("table", 8)])


def test_a_quantized_export_has_an_8_bit_token_table_close_to_float_and_no_float_table(
    gridded: tuple[Path, dict], tmp_path: Path
) -> None:
    folder, weights = gridded
    float_table = (("model.embed_tokens.weight", None),)
    options = ExportOptions(context_size=64, weight_bits=4, quantizer="rtn-min", overrides=float_table)
    plain = export(folder, tmp_path / "plain", options=options)
    small = export(folder, tmp_path / "small", options=ExportOptions(64, weight_bits=4, quantizer="rtn-min"))
    logits, float_table_logits, want = _logits(small.path), _logits(plain.path), forward(weights, IDS)
    best = np.argsort(want)[-8:]  # the shortlist's rescored logits: from 8-bit rows instead of float ones
    np.testing.assert_allclose(logits[best], float_table_logits[best], rtol=0, atol=0.02 * np.abs(want[best]).max())
    assert int(np.argmax(logits)) == int(np.argmax(want))
    table_bytes = weights["model.embed_tokens.weight"].nbytes
    assert small.ctx_bins[0].stat().st_size < plain.ctx_bins[0].stat().st_size - table_bytes / 2  # a quarter


def test_beside_a_gguf_files_carried_blocks_only_the_head_takes_an_override() -> None:
    assert carried_head() == SHORTLIST and carried_head(tied=False) is None
    assert carried_head((parse_override("lm_head.weight=float"),)) is None
    assert carried_head((parse_override("lm_head.weight=8"),)) == 8
    with pytest.raises(QuantizationError, match="keep their own bits: only lm_head.weight"):
        carried_head((parse_override("model.layers.*=8"),))
    with pytest.raises(QuantizationError, match="is for `rtn` and `rtn-asym` exports"):
        carried_head((parse_override("lm_head.weight=table"),))


def _moe_model(
    experts: int, hidden: int, inner: int, top_k: int, normalize: int, rng: np.random.Generator
) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray, np.ndarray]:
    """One MoE layer as the export writes it (graph.py's `experts`: a router MatMul, then ORT's MoE on [rows,
    hidden] with the gate and up rows interleaved), its expert weights on a 4-bit grid that both `rtn` and
    `rtn-asym` keep exactly: blocks of 32 along `in` of s j, j in -8..7 (both ends present), s a power of two."""

    def gridded(out: int, size: int) -> np.ndarray:
        j = rng.integers(-8, 8, (experts, out, size // BLOCK, BLOCK))
        j[..., 0], j[..., 1] = -8, 7
        scales = 2.0 ** -rng.integers(6, 9, (experts, out, size // BLOCK, 1))
        return (scales * j).astype(np.float32).reshape(experts, out, size)

    router = (rng.standard_normal((hidden, experts)) * 0.5).astype(np.float32)
    fc1, fc2 = gridded(2 * inner, hidden), gridded(hidden, inner)
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "router"], ["logits"], name="router"),
        onnx.helper.make_node("MoE", ["x", "logits", "model.layers.0.mlp.experts.fc1", "",
                                      "model.layers.0.mlp.experts.fc2"], ["y"], name="moe", domain="com.microsoft",
                              k=top_k, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0,
                              activation_beta=0.0, swiglu_limit=float("inf"), normalize_routing_weights=normalize),
    ]  # fmt: skip
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, hidden])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(router, "router"), numpy_helper.from_array(fc1, "model.layers.0.mlp.experts.fc1"),
         numpy_helper.from_array(fc2, "model.layers.0.mlp.experts.fc2")],
    )  # fmt: skip
    opsets = [onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("com.microsoft", 1)]
    return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=10), router, fc1, fc2


def _moe_in_numpy(x: np.ndarray, router: np.ndarray, fc1: np.ndarray, fc2: np.ndarray, top_k: int,
                  normalize: bool) -> np.ndarray:  # fmt: skip
    """transformers' sparse MoE block in float64: softmax over every expert, the top k (their weights
    renormalized where `normalize`), each expert's SwiGLU (gate and up rows interleaved in fc1)."""
    logits = x.astype(np.float64) @ router
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    y = np.zeros(x.shape, np.float64)
    for row in range(x.shape[0]):
        chosen = np.argsort(-probabilities[row], kind="stable")[:top_k]
        weights = probabilities[row, chosen] / (probabilities[row, chosen].sum() if normalize else 1.0)
        for expert, weight in zip(chosen, weights):
            both = fc1[expert].astype(np.float64) @ x[row]
            gate, up = both[0::2], both[1::2]
            y[row] += weight * (fc2[expert] @ (gate / (1 + np.exp(-gate)) * up))
    return y


@pytest.mark.parametrize("normalize", [0, 1])
@pytest.mark.parametrize(("quantizer", "bits"), [("rtn", 4), ("rtn-asym", 4), ("rtn", 8)])
def test_mixture_of_experts_layers_quantize_to_qmoe_on_the_same_experts_and_routing(
    quantizer: str, bits: int, normalize: int
) -> None:
    """A 4-bit export's expert stacks become ORT's QMoE blocks (they were left float: a 2.4B Mixtral-shaped
    int4 export was 6.9 GB), and the layer still computes transformers' MoE: the experts on a grid the
    quantizers keep exactly, the top-k weights unnormalized (Qwen's) or normalized (Mixtral's)."""
    rng = np.random.default_rng(11)
    experts, hidden, inner, top_k = 4, 64, 96, 2
    model, router, fc1, fc2 = _moe_model(experts, hidden, inner, top_k, normalize, rng)
    quantized = quantize_weights(model, bits, BLOCK, exclude={"router"}, quantizer=quantizer)  # the router float
    assert [n.op_type for n in quantized.graph.node] == ["MatMul", *(["Softmax"] if not normalize else []), "QMoE"]
    sizes = {t.name: t.raw_data for t in quantized.graph.initializer}
    assert "model.layers.0.mlp.experts.fc1" not in sizes  # the float stacks are gone
    assert len(sizes[f"model.layers.0.mlp.experts.fc1_Q{bits}"]) == fc1.size * bits // 8
    assert len(sizes[f"model.layers.0.mlp.experts.fc2_Q{bits}"]) == fc2.size * bits // 8
    if not session_model_module._TRUSTED_MOE:
        return  # MoE and QMoE layers are refused at the first session (tests/integration/test_families.py)
    x = (rng.standard_normal((7, hidden))).astype(np.float32)
    got = ort.InferenceSession(quantized.SerializeToString()).run(None, {"x": x})[0]  # float activations
    want = _moe_in_numpy(x, router, fc1, fc2, top_k, bool(normalize))
    # 8-bit experts run on 8-bit activations whatever the level (1.2 % here, as 4-bit ones at level 4); a
    # wrong layout or routing is off by tens of percent
    assert np.abs(got - want).max() < (1e-4 if bits == 4 else 2e-2) * np.abs(want).max()


def test_mixture_of_experts_layers_refuse_quantizers_qmoe_cannot_hold_and_keep_float_on_request() -> None:
    model, *_ = _moe_model(4, 64, 96, 2, 1, np.random.default_rng(12))
    with pytest.raises(QuantizationError, match="mixture-of-experts.*rtn or rtn-asym.*experts"):
        quantize_weights(model, 4, BLOCK, quantizer="rtn-min")
    kept = quantize_weights(model, 4, BLOCK, quantizer="rtn-min", overrides=[parse_override("*.experts.*=float")])
    assert [n.op_type for n in kept.graph.node][-1] == "MoE"

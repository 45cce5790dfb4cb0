"""Quiver's DecodeAttention kernel against ONNX Runtime's own GroupQueryAttention on the same inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from quiver.backends.cpu.native_ops import built_library, lowered
from quiver.ir.quiver_ops import DECODE_ATTENTION, QUIVER_DOMAIN
from quiver.testing.attention import INPUTS, attention_model

MS_DOMAIN = "com.microsoft"


def _model(op: str, domain: str, packed: bool, rotary: bool, **attributes: Any) -> onnx.ModelProto:
    given = [n for n in INPUTS if not (packed and n in ("key", "value")) and (rotary or n not in ("cos", "sin"))]
    return attention_model(op, domain, given, do_rotary=int(rotary), **attributes)


def _session(model: onnx.ModelProto, library: Path | str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    library = library or built_library()
    assert not isinstance(library, str), f"the kernel could not be built here: {library}"
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray], shared: bool) -> list[np.ndarray]:
    """The three outputs; `shared`: the present key and value written into the past's own buffers."""
    feeds = {k: v.copy() for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
    if not shared:
        return [np.asarray(x) for x in session.run(None, feeds)]
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("out")
    for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
        binding.bind_output(present, "cpu", 0, np.float32, list(feeds[past].shape), feeds[past].ctypes.data)
    session.run_with_iobinding(binding)
    return [np.asarray(binding.copy_outputs_to_cpu()[0]), feeds["past_key"], feeds["past_value"]]


CASES = {  # name: (heads, kv heads, head size, rows, seqlens, buffer, rotary dims, attributes)
    "llama decode step": (8, 2, 64, 1, [37], 64, 64, {}),
    "two sequences of other lengths": (6, 3, 32, 1, [5, 40], 48, 32, {}),
    "three new rows": (4, 4, 16, 3, [20], 32, 16, {}),  # ORT takes one sequence where rows > 1
    "interleaved rotary": (4, 2, 32, 1, [17], 32, 32, {"rotary_interleaved": 1}),
    "partial rotary": (4, 2, 64, 1, [23], 32, 32, {}),
    "no rotary": (4, 1, 32, 1, [30], 32, 0, {}),
    "local window": (4, 2, 32, 2, [50], 64, 32, {"local_window_size": 16}),
    "softcap and a scale": (4, 2, 32, 1, [33], 48, 32, {"softcap": 30.0, "scale": 0.3}),
    "head size 48": (3, 1, 48, 1, [11], 16, 48, {}),
    "a long sequence, head size 128": (6, 2, 128, 1, [300], 320, 128, {}),  # many blocks, the largest rising
}


def _feeds(case: str, packed: bool, shared: bool) -> dict[str, np.ndarray]:
    heads, kv, dim, rows, seqlens, length, rotary_dims, _ = CASES[case]
    rng = np.random.default_rng(list(CASES).index(case))
    batch = len(seqlens)
    if not shared:  # a past exactly as long as the longest sequence's, the present one longer
        length = max(seqlens) + 1 - rows
    q = rng.standard_normal((batch, rows, heads * dim)).astype(np.float32)
    k = rng.standard_normal((batch, rows, kv * dim)).astype(np.float32)
    v = rng.standard_normal((batch, rows, kv * dim)).astype(np.float32)
    feeds = {
        "query": np.concatenate([q, k, v], -1) if packed else q,
        "key": k,
        "value": v,
        "past_key": rng.standard_normal((batch, kv, length, dim)).astype(np.float32),
        "past_value": rng.standard_normal((batch, kv, length, dim)).astype(np.float32),
        "seqlens_k": np.array(seqlens, np.int32),
        "total_sequence_length": np.array([max(seqlens) + 1], np.int32),
    }
    if rotary_dims:
        angles = rng.uniform(0, 6.3, (max(64, length, max(seqlens) + 1), rotary_dims // 2))
        feeds["cos"], feeds["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return feeds


def _ort(case: str, packed: bool, op: str = "GroupQueryAttention", library: Path | None = None) -> ort.InferenceSession:
    heads, kv, _, _, _, _, rotary_dims, attributes = CASES[case]
    domain = QUIVER_DOMAIN if op == DECODE_ATTENTION else MS_DOMAIN
    model = _model(op, domain, packed, bool(rotary_dims), num_heads=heads, kv_num_heads=kv, **attributes)
    return _session(model, library)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
def test_decode_attention_is_group_query_attention(
    case: str, packed: bool, shared: bool, build: str, native_builds: dict[str, Path]
) -> None:
    feeds = _feeds(case, packed, shared)
    ours = _run(_ort(case, packed, DECODE_ATTENTION, native_builds[build]), feeds, shared)
    theirs = _run(_ort(case, packed), feeds, shared)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    for b, seen in enumerate(feeds["seqlens_k"] + 1):  # the positions each sequence holds
        for mine, ort_s in zip(ours[1:], theirs[1:]):
            np.testing.assert_allclose(mine[b, :, :seen], ort_s[b, :, :seen], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("packed", [False, True])
def test_the_reference_backends_attention_is_group_query_attention(case: str, packed: bool) -> None:
    """The reference backend's GroupQueryAttention (and DecodeAttention) in numpy: ORT's numbers."""
    from quiver.backends.reference import _ms_group_query_attention

    heads, kv, _, _, _, _, rotary_dims, attributes = CASES[case]
    feeds = _feeds(case, packed, shared=True)
    theirs = _run(_ort(case, packed), feeds, shared=True)
    ours = _ms_group_query_attention(
        None,  # type: ignore[arg-type]
        *(None if packed and n in ("key", "value") else feeds.get(n) for n in INPUTS),
        num_heads=heads, kv_num_heads=kv, do_rotary=int(bool(rotary_dims)), **attributes,
    )  # fmt: skip
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-4, atol=1e-5)
    for mine, ort_s in zip(ours[1:], theirs[1:]):
        np.testing.assert_allclose(mine, ort_s, rtol=1e-6, atol=1e-6)


def test_without_the_kernel_it_is_group_query_attention() -> None:
    model = _model(DECODE_ATTENTION, QUIVER_DOMAIN, True, True, num_heads=4, kv_num_heads=2, local_window_size=8)
    node = lowered(model).graph.node[0]
    assert (node.domain, node.op_type) == (MS_DOMAIN, "GroupQueryAttention")
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == {
        "do_rotary": 1, "num_heads": 4, "kv_num_heads": 2, "local_window_size": 8,
    }  # fmt: skip
    assert list(node.input) == list(model.graph.node[0].input)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seqlens_k": np.array([40], np.int32)}, "seqlens_k is outside its present buffer"),
        (  # more past tokens than the past buffer holds, the present another buffer
            {"seqlens_k": np.array([35], np.int32), "total_sequence_length": np.array([40], np.int32)},
            "seqlens_k is outside its present buffer",
        ),
        ({"seqlens_k": np.array([5, 6], np.int32)}, "seqlens_k must hold one length a sequence"),
        ({"past_key": np.zeros((1, 2, 32, 16), np.float32)}, "the past key and value must be"),
        ({"query": np.zeros((1, 1, 100), np.float32)}, "the query's width is not the heads' whole dimension"),
        ({"cos": np.zeros((64, 40), np.float32)}, "cos and sin caches of one shape"),
    ],
)
def test_bad_inputs_fail_with_what_is_wrong(change: dict[str, np.ndarray], message: str) -> None:
    rng = np.random.default_rng(3)
    feeds = {
        "query": rng.standard_normal((1, 1, 8 * 32)).astype(np.float32),
        "past_key": np.zeros((1, 2, 32, 32), np.float32),
        "past_value": np.zeros((1, 2, 32, 32), np.float32),
        "seqlens_k": np.array([7], np.int32),
        "total_sequence_length": np.array([8], np.int32),
        "cos": np.ones((64, 16), np.float32),
        "sin": np.zeros((64, 16), np.float32),
    }
    session = _session(_model(DECODE_ATTENTION, QUIVER_DOMAIN, True, True, num_heads=4, kv_num_heads=2))
    with pytest.raises(Exception, match=message):
        session.run(None, feeds | change)

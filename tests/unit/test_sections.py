"""Updateable tensors and binary sections: stage, finalize, extract, apply, switch, refuse."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

import quiver
from quiver.formats.section import SectionFile
from quiver.ir.tensors import TensorType
from tests.support.lora_branch import BRANCH_X as X
from tests.support.lora_branch import IN, OUT, RANK, W
from tests.support.lora_branch import branch_adapter as _adapter
from tests.support.lora_branch import branch_expected as _expected
from tests.support.lora_branch import lora_branch_model as _lora_model


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    with quiver.Context.create("cpu") as context:
        context.add_graph("lora", _lora_model(), updateable=["lora_A", "lora_B"])
        return context.save(tmp_path / "lora.qctx")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_updates_take_effect_at_finalize_not_before(binary: Path, backend: str) -> None:
    context = quiver.Context.from_binary(binary, backend=backend)
    graph = context.graph("lora")
    np.testing.assert_allclose(graph.execute({"x": X})["y"], _expected(X, None), rtol=1e-5, atol=1e-5)
    adapter = _adapter(1)
    graph.update_tensors(adapter)
    np.testing.assert_allclose(graph.execute({"x": X})["y"], _expected(X, None), rtol=1e-5, atol=1e-5)
    graph.finalize()
    np.testing.assert_allclose(graph.execute({"x": X})["y"], _expected(X, adapter), rtol=1e-5, atol=1e-5)


def test_updateable_tensors_are_described_and_not_inputs(binary: Path) -> None:
    graph = quiver.Context.from_binary(binary).graph("lora")
    assert [i.name for i in graph.inputs] == ["x"]
    kinds = {t.name: t.tensor_type for t in graph.static_tensors}
    assert kinds == {
        "W": TensorType.STATIC,
        "lora_A": TensorType.UPDATEABLE_STATIC,
        "lora_B": TensorType.UPDATEABLE_STATIC,
    }


def test_bad_updates_are_refused_and_change_nothing(binary: Path) -> None:
    context = quiver.Context.from_binary(binary)
    graph = context.graph("lora")
    with pytest.raises(quiver.TensorUpdateError, match="no updateable tensor 'W'"):
        graph.update_tensors({"W": W})
    with pytest.raises(quiver.TensorUpdateError, match=r"float32\[16, 4\].*float32\[16, 5\]"):
        graph.update_tensors({"lora_A": np.zeros((IN, RANK + 1), np.float32)})
    with pytest.raises(quiver.TensorUpdateError, match="float64"):
        graph.update_tensors({"lora_A": np.zeros((IN, RANK), np.float64)})
    with pytest.raises(quiver.TensorUpdateError, match="no graph"):
        context.update_context_tensors({"nope": np.zeros(1)})
    context.finalize()
    np.testing.assert_allclose(graph.execute({"x": X})["y"], _expected(X, None), rtol=1e-5, atol=1e-5)


def test_staging_copies_so_later_changes_to_the_array_do_not_leak_in(binary: Path) -> None:
    context = quiver.Context.from_binary(binary)
    adapter = _adapter(2)
    expected = _expected(X, adapter)
    context.graph("lora").update_tensors(adapter)
    adapter["lora_A"][:] = 0
    context.graph("lora").finalize()
    np.testing.assert_allclose(context.graph("lora").execute({"x": X})["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_sections_switch_adapters_back_and_forth(binary: Path, tmp_path: Path, backend: str) -> None:
    maker = quiver.Context.from_binary(binary)
    sections = {}
    for name, seed in (("one", 1), ("two", 2)):
        maker.graph("lora").update_tensors(_adapter(seed))
        maker.graph("lora").finalize()
        sections[name] = tmp_path / f"{name}.qsec"
        sections[name].write_bytes(maker.get_binary_section("lora", metadata={"adapter": name}))
    context = quiver.Context.from_binary(binary, backend=backend)
    for name, seed in (("one", 1), ("two", 2), ("one", 1), ("two", 2)):
        applied = context.apply_binary_section("lora", sections[name])
        assert applied.metadata == {"adapter": name}
        np.testing.assert_allclose(
            context.graph("lora").execute({"x": X})["y"], _expected(X, _adapter(seed)), rtol=1e-4, atol=1e-4
        )


def test_applying_binds_the_mapped_section_without_copying(binary: Path, tmp_path: Path) -> None:
    maker = quiver.Context.from_binary(binary)
    maker.graph("lora").update_tensors(_adapter(3))
    maker.finalize()
    (tmp_path / "s.qsec").write_bytes(maker.get_binary_section())
    assert maker.get_binary_section_size() == (tmp_path / "s.qsec").stat().st_size  # QNN sizes its buffer first
    assert maker.get_binary_section_size("lora", {"adapter": "a"}) == len(
        maker.get_binary_section("lora", {"adapter": "a"})
    )
    section = SectionFile.open(tmp_path / "s.qsec")
    context = quiver.Context.from_binary(binary)
    context.apply_binary_section("lora", section)
    assert section.file_backed
    bound = context._state("lora").values["lora_A"]
    assert np.shares_memory(bound, np.frombuffer(section._buffer, np.uint8))


def test_a_section_for_another_context_is_refused_and_the_context_keeps_working(binary: Path, tmp_path: Path) -> None:
    other_model = _lora_model()
    other_model.graph.initializer[0].CopyFrom(numpy_helper.from_array(W * 2, "W"))
    with quiver.Context.create("cpu") as other:
        other.add_graph("lora", other_model, updateable=["lora_A", "lora_B"])
        other.finalize()
        other.graph("lora").update_tensors(_adapter(4))
        other.finalize()
        foreign = other.get_binary_section("lora")
    context = quiver.Context.from_binary(binary)
    with pytest.raises(quiver.SectionMismatchError, match="another context"):
        context.apply_binary_section("lora", foreign)
    np.testing.assert_allclose(context.graph("lora").execute({"x": X})["y"], _expected(X, None), rtol=1e-5, atol=1e-5)


def test_a_damaged_section_is_refused_and_nothing_changes(binary: Path, tmp_path: Path) -> None:
    maker = quiver.Context.from_binary(binary)
    maker.graph("lora").update_tensors(_adapter(5))
    maker.finalize()
    good = maker.get_binary_section("lora")
    section = SectionFile(good)
    flipped = bytearray(good)
    flipped[section.weights[0].offset + 5] ^= 0x40
    context = quiver.Context.from_binary(binary)
    context.apply_binary_section("lora", good)
    for damaged, error in (
        (bytes(flipped), quiver.ChecksumMismatchError),
        (good[:-3], quiver.TruncatedFileError),
        (b"QCTX" + good[4:], quiver.BadMagicError),
    ):
        with pytest.raises(error):
            context.apply_binary_section("lora", damaged)
        (tmp_path / "damaged.qsec").write_bytes(damaged)  # from a path: checked while it is copied
        with pytest.raises(error):
            context.apply_binary_section("lora", tmp_path / "damaged.qsec")
    np.testing.assert_allclose(
        context.graph("lora").execute({"x": X})["y"], _expected(X, _adapter(5)), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("memfd", [True, False])
def test_a_section_from_a_path_is_a_private_copy_of_its_file(
    binary: Path, tmp_path: Path, memfd: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not memfd:
        monkeypatch.delattr(os, "memfd_create", raising=False)  # the copy by one read, as where there is none
    maker = quiver.Context.from_binary(binary)
    maker.graph("lora").update_tensors(_adapter(5))
    maker.finalize()
    data = maker.get_binary_section("lora")
    (tmp_path / "s.qsec").write_bytes(data)
    section = SectionFile.open(tmp_path / "s.qsec", persistent=False)
    assert bytes(section.buffer) == data and not section.file_backed and section.damage() == []
    assert not section.weight_array(0).flags.writeable  # read-only, as over a mapped file
    (tmp_path / "s.qsec").write_bytes(bytes(len(data)))  # rewritten in place: the copy keeps its bytes
    assert bytes(section.buffer) == data
    section.close()


def test_a_section_for_a_graph_it_does_not_cover_is_refused() -> None:
    with quiver.Context.create("cpu") as context:
        context.add_graph("prefill", _lora_model("prefill"), updateable=["lora_A", "lora_B"])
        context.add_graph("decode", _lora_model("decode"), updateable=["lora_A", "lora_B"])
        context.finalize()
        only_prefill = context.get_binary_section("prefill")
        with pytest.raises(quiver.SectionMismatchError, match="no values for graph 'decode'"):
            context.apply_binary_section("decode", only_prefill)
        with pytest.raises(quiver.UnknownGraphError):
            context.apply_binary_section("missing", only_prefill)
        context.apply_binary_section(None, only_prefill)  # None: every graph the section covers


def test_a_super_section_stores_shared_adapter_tensors_once(tmp_path: Path) -> None:
    with quiver.Context.create("cpu") as context:
        context.add_graph("prefill", _lora_model("prefill", batch=8), updateable=["lora_A", "lora_B"])
        context.add_graph("decode", _lora_model("decode", batch=1), updateable=["lora_A", "lora_B"])
        context.finalize()
        adapter = _adapter(6)
        context.update_context_tensors(adapter)  # one update for both graphs
        context.finalize()
        both = context.get_binary_section()
        separate = len(context.get_binary_section("prefill")) + len(context.get_binary_section("decode"))
        binary = context.save(tmp_path / "llm.qctx")
    assert len(both) < 0.6 * separate
    assert set(SectionFile(both).graphs) == {"prefill", "decode"} and len(SectionFile(both).weights) == 2
    fresh = quiver.Context.from_binary(binary)
    fresh.apply_binary_section(None, both)
    x8 = np.random.default_rng(7).standard_normal((8, IN)).astype(np.float32)
    np.testing.assert_allclose(
        fresh.graph("prefill").execute({"x": x8})["y"], _expected(x8, adapter), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        fresh.graph("decode").execute({"x": x8[:1]})["y"], _expected(x8[:1], adapter), rtol=1e-4, atol=1e-4
    )


def test_small_updateable_tensors_stay_weights_and_unknown_ones_are_refused() -> None:
    tiny = _lora_model()
    with quiver.Context.create("reference") as context:
        context.add_graph("lora", tiny, updateable=["lora_B"])  # 192 bytes: below the inline limit
        context.finalize()
        assert "lora_B" in context.file.graphs["lora"].updateable
        with pytest.raises(quiver.ConversionError, match="not initializers"):
            quiver.Context.create().add_graph("x", tiny, updateable=["missing"])


def _two_graph_context(decode_rank: int = RANK) -> quiver.Context:
    decode = _lora_model("decode")
    for tensor in decode.graph.initializer:
        if tensor.name == "lora_A":
            tensor.CopyFrom(numpy_helper.from_array(np.zeros((IN, decode_rank), np.float32), "lora_A"))
        if tensor.name == "lora_B":
            tensor.CopyFrom(numpy_helper.from_array(np.zeros((decode_rank, OUT), np.float32), "lora_B"))
    context = quiver.Context.create("reference")
    context.add_graph("prefill", _lora_model("prefill"), updateable=["lora_A", "lora_B"])
    context.add_graph("decode", decode, updateable=["lora_A", "lora_B"])
    return context.finalize()


def test_a_super_section_covering_a_graph_that_is_not_enabled_is_refused_and_changes_nothing() -> None:
    with _two_graph_context() as built:
        built.update_context_tensors(_adapter(8))
        built.finalize()
        both, binary = built.get_binary_section(), built.get_binary()
    only_prefill = quiver.Context.from_binary(binary, backend="reference", enable_graphs=["prefill"])
    with pytest.raises(quiver.UnknownGraphError, match="decode"):
        only_prefill.apply_binary_section(None, both)
    np.testing.assert_allclose(only_prefill.graph("prefill").execute({"x": X})["y"], _expected(X, None), atol=1e-5)


def test_an_update_one_graph_refuses_is_staged_for_none() -> None:
    with _two_graph_context(decode_rank=RANK - 1) as context:
        with pytest.raises(quiver.TensorUpdateError, match="'decode'"):
            context.update_context_tensors(_adapter(9))  # fits prefill, not decode's smaller rank
        context.finalize()
        np.testing.assert_allclose(context.graph("prefill").execute({"x": X})["y"], _expected(X, None), atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_lower_rank_adapter_is_stored_at_its_rank_and_zero_extended_at_apply(
    binary: Path, tmp_path: Path, backend: str
) -> None:
    low = {name: value.copy() for name, value in _adapter(5).items()}
    low["lora_A"][:, 2:] = 0  # rank 2 in a rank-4 branch, as a smaller adapter is padded
    low["lora_B"][2:, :] = 0
    maker = quiver.Context.from_binary(binary)
    maker.graph("lora").update_tensors(low)
    maker.finalize()
    narrow = maker.get_binary_section("lora")
    maker.graph("lora").update_tensors(_adapter(6))
    maker.finalize()
    whole = maker.get_binary_section("lora")
    stored = {w.shape for w in SectionFile(narrow).weights}
    assert stored == {(IN, 2), (2, OUT)}
    assert len(narrow) < len(whole)
    (tmp_path / "narrow.qsec").write_bytes(narrow)
    with quiver.Context.from_binary(binary, backend=backend) as context:
        context.apply_binary_section("lora", tmp_path / "narrow.qsec")
        np.testing.assert_allclose(context.graph("lora").execute({"x": X})["y"], _expected(X, low), rtol=1e-5)
        (tmp_path / "narrow.qsec").write_bytes(whole)  # rewritten in place after the apply: changes nothing
        np.testing.assert_allclose(context.graph("lora").execute({"x": X})["y"], _expected(X, low), rtol=1e-5)


def test_a_section_tensor_larger_than_its_updateable_tensor_is_refused(binary: Path) -> None:
    with quiver.Context.create("reference") as other:
        wide = _lora_model()
        for tensor in wide.graph.initializer:
            if tensor.name == "lora_A":
                tensor.CopyFrom(numpy_helper.from_array(np.ones((IN, RANK + 1), np.float32), "lora_A"))
            if tensor.name == "lora_B":
                tensor.CopyFrom(numpy_helper.from_array(np.ones((RANK + 1, OUT), np.float32), "lora_B"))
        other.add_graph("lora", wide, updateable=["lora_A", "lora_B"])
        other.finalize()
        section = SectionFile(other.get_binary_section("lora"))
    with quiver.Context.from_binary(binary) as context:
        before = context.graph("lora").execute({"x": X})["y"]
        section.context_id = context.file.header_sha256  # past the identity check, to reach the shape check
        with pytest.raises(quiver.SectionMismatchError, match="needs float32"):
            context.apply_binary_section("lora", section)
        np.testing.assert_array_equal(context.graph("lora").execute({"x": X})["y"], before)


def test_a_section_file_is_verified_once_until_it_changes(binary: Path, tmp_path: Path) -> None:
    maker = quiver.Context.from_binary(binary)
    sections = {}
    for seed in (7, 8):
        maker.graph("lora").update_tensors(_adapter(seed))
        maker.finalize()
        sections[seed] = maker.get_binary_section("lora")
    path = tmp_path / "adapter.qsec"
    path.write_bytes(sections[7])
    with quiver.Context.from_binary(binary) as context:
        first = context.apply_binary_section("lora", path)
        assert context.apply_binary_section("lora", path) is first  # unchanged: not read nor hashed again
        path.write_bytes(sections[8])  # rewritten in place: another identity, read and verified again
        assert context.apply_binary_section("lora", path) is not first
        np.testing.assert_allclose(context.graph("lora").execute({"x": X})["y"], _expected(X, _adapter(8)), rtol=1e-5)
        damaged = bytearray(sections[7])
        damaged[-len(damaged) // 3] ^= 0xFF  # somewhere in a tensor or the header
        path.write_bytes(bytes(damaged))
        with pytest.raises(quiver.QuiverError):
            context.apply_binary_section("lora", path)
        np.testing.assert_allclose(context.graph("lora").execute({"x": X})["y"], _expected(X, _adapter(8)), rtol=1e-5)

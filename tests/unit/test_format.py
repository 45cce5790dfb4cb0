"""The .qctx reader and writer: round trips, determinism, dedup by content, and one bad file per error."""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import quiver
from quiver.formats.layout import DATA_START, MAGIC, PREAMBLE_SIZE, Preamble
from quiver.formats.reader import ContextFile
from quiver.formats.writer import ContextWriter, PreparedRecord
from quiver.passes.load import TensorSource
from tests.fuzz.harness import reseal


def _write(tmp_path: Path, arrays: list[np.ndarray], graphs: dict[str, dict[str, int]] | None = None) -> Path:
    with ContextWriter(tmp_path) as writer:
        for array in arrays:
            writer.add_weight(str(array.dtype), array.shape, [array.tobytes()])
        for name, mapping in (graphs or {}).items():
            writer.add_graph(name, b"skeleton-" + name.encode(), mapping)
        return writer.finish(tmp_path / "out.qctx")


def _rewrite_header(data: bytes, mutate: Callable[[dict], None]) -> bytes:
    """Applies `mutate` to the JSON header and re-seals the file (valid preamble and checksum)."""
    _, pre = Preamble.unpack(data[:PREAMBLE_SIZE])
    header = json.loads(data[pre.header_offset :])
    mutate(header)
    return reseal(data, json.dumps(header).encode())


@pytest.fixture
def good(tmp_path: Path) -> bytes:
    a = np.arange(20000, dtype=np.float32).reshape(100, 200)  # page-aligned (>= 64 KiB)
    b = np.arange(300, dtype=np.int64)
    return _write(tmp_path, [a, b], {"g1": {"w": 0, "b": 1}, "g2": {"w": 0}}).read_bytes()


def test_round_trip_gives_back_the_same_arrays(tmp_path: Path) -> None:
    arrays = [
        np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32),
        np.arange(7, dtype=np.int8),
        np.array(3.5, dtype=np.float16),
        np.zeros((0, 4), np.float32),
    ]
    file = ContextFile.open(_write(tmp_path, arrays))
    for index, array in enumerate(arrays):
        view = file.weight_array(index)
        assert view.dtype == array.dtype and view.shape == array.shape
        np.testing.assert_array_equal(view, array)
        assert not view.flags.writeable


def test_identical_content_under_different_names_is_stored_once(tmp_path: Path) -> None:
    weight = np.ones((128, 128), np.float32)
    with ContextWriter(tmp_path) as writer:
        first = writer.add_weight("float32", weight.shape, [weight.tobytes()])
        second = writer.add_weight("float32", weight.shape, [weight.copy().tobytes()])
        writer.add_graph("a", b"x", {"val_1": first})
        writer.add_graph("b", b"y", {"val_1001": second})
        path = writer.finish(tmp_path / "c.qctx")
    assert first == second
    assert len(ContextFile.open(path).weights) == 1


def test_initializers_with_different_shapes_are_not_deduplicated(tmp_path: Path) -> None:
    data = np.arange(64, dtype=np.float32)
    file = ContextFile.open(_write(tmp_path, [data.reshape(8, 8), data.reshape(4, 16), data.view(np.int32)]))
    assert len(file.weights) == 3


def test_weights_are_aligned_and_large_ones_page_aligned(tmp_path: Path) -> None:
    arrays = [np.ones(3, np.float32), np.ones(70000, np.uint8), np.ones(5, np.int16), np.ones(20000, np.float32)]
    file = ContextFile.open(_write(tmp_path, arrays))
    for weight in file.weights:
        assert weight.offset % (4096 if weight.length >= 65536 else 64) == 0


def _zero_bytes_between_weights(file: ContextFile) -> int:
    spans = sorted((w.offset, w.offset + w.length) for w in file.weights)
    return sum(start - end for (_, end), (start, _) in itertools.pairwise([(0, DATA_START), *spans]))


def test_small_weights_fill_the_slack_before_a_page_aligned_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    arrays: dict[str, np.ndarray] = {}
    for i in range(4):  # a graph's order: a matrix ending mid-page (68,000 B), its scales, its biases
        arrays[f"w{i}"] = rng.standard_normal(17000).astype(np.float32)
        arrays[f"s{i}"] = rng.standard_normal(4500).astype(np.float32)  # 18,000 B: more than the slack
        for j in range(3):
            arrays[f"b{i}{j}"] = rng.standard_normal(100).astype(np.float32)  # 400 B
    tensors = {name: TensorSource("float32", array.shape, array) for name, array in arrays.items()}
    with ContextWriter(tmp_path) as writer:
        mapping = writer.add_weights(tensors, {})
        writer.add_graph("g", b"skeleton", mapping)
        packed = ContextFile.open(writer.finish(tmp_path / "packed.qctx"))
    assert list(mapping) == list(tensors)
    for name, index in mapping.items():
        np.testing.assert_array_equal(packed.weight_array(index), arrays[name])
    in_order = ContextFile.open(_write(tmp_path, list(arrays.values())))
    # in order, each later matrix waits for the page after its predecessor's scales and biases (~3 KB of
    # zeros each); packed, the biases sit in the slack after each matrix and the scales go last
    assert _zero_bytes_between_weights(in_order) > 8_000
    assert _zero_bytes_between_weights(packed) < 2_000


def test_the_same_input_gives_the_same_bytes(tmp_path: Path) -> None:
    arrays = [np.arange(1000, dtype=np.float32), np.arange(10, dtype=np.int64)]
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    one = _write(tmp_path / "1", arrays, {"g": {"a": 0, "b": 1}}).read_bytes()
    two = _write(tmp_path / "2", arrays, {"g": {"a": 0, "b": 1}}).read_bytes()
    assert one == two
    assert one[:8] == MAGIC


def test_golden_preamble_layout(good: bytes) -> None:
    magic, major, minor, flags, header_offset, header_length, file_length, sha, reserved = struct.unpack(
        "<8sHHIQQQ32sQ", good[:80]
    )
    assert (magic, major, minor, flags, reserved) == (b"QCTX\r\n\x1a\n", 1, 7, 0, 0)  # skeletons too small to deflate
    assert file_length == len(good) and header_offset + header_length == len(good)
    assert sha == hashlib.sha256(good[header_offset:]).digest()
    assert good[80:DATA_START] == bytes(DATA_START - 80)


def test_an_aborted_write_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), ContextWriter(tmp_path) as writer:
        writer.add_weight("float32", [4], [np.ones(4, np.float32).tobytes()])
        raise RuntimeError("crash in the middle of a build")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_keeps_the_previous_file(tmp_path: Path, family: dict) -> None:
    target = tmp_path / "family.qctx"
    target.write_bytes(b"previous contents")
    context = quiver.Context.create("cpu", workdir=tmp_path)
    context.add_graph("base", family["base"])
    with pytest.raises(quiver.ModelLoadError):
        context.add_graph("broken", tmp_path / "missing.onnx")
    assert target.read_bytes() == b"previous contents"
    context.save(target)
    assert ContextFile.open(target).graphs.keys() == {"base"}
    assert [p.name for p in tmp_path.iterdir()] == ["family.qctx"]


def test_a_length_that_does_not_fit_the_shape_is_refused_by_the_writer(tmp_path: Path) -> None:
    with ContextWriter(tmp_path) as writer, pytest.raises(quiver.ContextStateError, match="needs 16 bytes"):
        writer.add_weight("float32", [4], [b"\0" * 12])


def test_verify_finds_a_flipped_bit_in_the_weights(tmp_path: Path, good: bytes) -> None:
    file = ContextFile(good)
    assert file.verify() == []
    damaged = bytearray(good)
    damaged[file.weights[0].offset + 100] ^= 0x10
    problems = ContextFile(bytes(damaged)).verify()
    assert problems == ["weight 0 (float32[100, 200]) checksum mismatch"]


def test_each_weight_records_the_crc32_of_its_bytes(good: bytes) -> None:
    _, pre = Preamble.unpack(good[:PREAMBLE_SIZE])
    for raw in json.loads(good[pre.header_offset :])["weights"]:
        assert raw["crc32"] == zlib.crc32(good[raw["offset"] : raw["offset"] + raw["length"]])


def test_damage_finds_a_flipped_bit_by_crc32_and_by_sha256_without_one(good: bytes) -> None:
    file = ContextFile(good)
    assert file.damage() == []
    damaged = bytearray(good)
    damaged[file.weights[0].offset + 100] ^= 0x10
    assert ContextFile(bytes(damaged)).damage() == ["weight 0 (float32[100, 200]) checksum mismatch"]
    # a 1.4 file records no CRC-32: its SHA-256 finds the bit
    without = _rewrite_header(bytes(damaged), lambda h: [w.pop("crc32") for w in h["weights"]])
    assert ContextFile(without).weights[0].crc32 is None
    assert ContextFile(without).damage() == ["weight 0 (float32[100, 200]) checksum mismatch"]


@pytest.mark.parametrize("value", [-1, 2**32, "12", 1.5])
def test_a_crc32_that_is_not_a_32_bit_integer_is_refused(good: bytes, value: object) -> None:
    def set_crc(header: dict) -> None:
        header["weights"][0]["crc32"] = value

    with pytest.raises(quiver.InvalidHeaderError, match="crc32"):
        ContextFile(_rewrite_header(good, set_crc))


def test_verify_finds_non_zero_padding(good: bytes) -> None:
    damaged = bytearray(good)
    damaged[PREAMBLE_SIZE + 5] = 1
    assert "non-zero padding" in ContextFile(bytes(damaged)).verify()[0]


# --- one hand-built bad file per reader error ------------------------------------------------------


def test_empty_and_short_files_are_truncated() -> None:
    for data in (b"", MAGIC, b"\0" * 79):
        with pytest.raises(quiver.TruncatedFileError):
            ContextFile(data)


def test_a_file_cut_short_is_truncated(good: bytes) -> None:
    for cut in (100, DATA_START, len(good) // 2, len(good) - 1):
        with pytest.raises(quiver.TruncatedFileError):
            ContextFile(good[:cut])


def test_wrong_magic_is_refused(good: bytes) -> None:
    with pytest.raises(quiver.BadMagicError, match="not a Quiver context binary"):
        ContextFile(b"PK\x03\x04" + good[4:])


def test_a_newer_major_version_names_the_upgrade(good: bytes) -> None:
    newer = good[:8] + struct.pack("<H", 2) + good[10:]
    with pytest.raises(quiver.UnsupportedVersionError, match="upgrade Quiver"):
        ContextFile(newer)


def test_a_newer_minor_version_is_read(good: bytes) -> None:
    newer = good[:10] + struct.pack("<H", 7) + good[12:]
    assert ContextFile(newer).minor_version == 7


def test_unknown_flags_are_unsupported(good: bytes) -> None:
    with pytest.raises(quiver.UnsupportedVersionError):
        ContextFile(good[:12] + struct.pack("<I", 2) + good[16:])


def test_an_absurd_header_length_is_refused_before_reading(good: bytes) -> None:
    huge = good[:24] + struct.pack("<Q", 2**62) + good[32:]
    with pytest.raises(quiver.HeaderTooLargeError):
        ContextFile(huge)


def test_a_header_that_is_not_the_tail_is_out_of_bounds(good: bytes) -> None:
    _, pre = Preamble.unpack(good[:PREAMBLE_SIZE])
    moved = good[:16] + struct.pack("<Q", pre.header_offset - 8) + good[24:]
    with pytest.raises(quiver.OutOfBoundsError):
        ContextFile(moved)


def test_a_flipped_bit_in_the_header_fails_its_checksum(good: bytes) -> None:
    damaged = bytearray(good)
    damaged[-10] ^= 0x01
    with pytest.raises(quiver.ChecksumMismatchError, match="header"):
        ContextFile(bytes(damaged))


def test_a_flipped_bit_in_a_skeleton_fails_its_checksum_on_use(good: bytes) -> None:
    file = ContextFile(good)
    damaged = bytearray(good)
    damaged[file.graphs["g1"].offset] ^= 0x01
    with pytest.raises(quiver.ChecksumMismatchError, match="g1"):
        ContextFile(bytes(damaged)).skeleton("g1")


def test_a_header_that_is_not_json_is_invalid(good: bytes) -> None:
    _, pre = Preamble.unpack(good[:PREAMBLE_SIZE])
    junk = b"\xff{not json"
    sealed = (
        Preamble(
            1, 0, 0, pre.header_offset, len(junk), pre.header_offset + len(junk), hashlib.sha256(junk).digest()
        ).pack()
        + good[PREAMBLE_SIZE : pre.header_offset]
        + junk
    )
    with pytest.raises(quiver.InvalidHeaderError, match="not UTF-8 JSON"):
        ContextFile(sealed)


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda h: h["weights"][0].update(length=2**70), quiver.InvalidHeaderError, "records"),
        (lambda h: h["weights"][0].update(shape=[2**40, 2**40], length=2**82), quiver.OutOfBoundsError, "outside"),
        (lambda h: h["weights"][0].update(shape=[-1, 200]), quiver.InvalidHeaderError, "non-negative"),
        (lambda h: h["weights"][0].update(shape=[1] * 33), quiver.InvalidHeaderError, "at most 32"),
        (lambda h: h["weights"][0].update(dtype="complex64"), quiver.InvalidHeaderError, "dtype"),
        (lambda h: h["weights"][0].update(offset=10), quiver.OutOfBoundsError, "outside"),
        (lambda h: h["weights"][0].update(offset=h["weights"][0]["offset"] + 64), quiver.MisalignedTensorError, "4096"),
        (lambda h: h["weights"][1].update(offset=h["weights"][0]["offset"]), quiver.OverlappingRegionsError, "before"),
        (lambda h: h["graphs"][1].update(offset=h["graphs"][0]["offset"]), quiver.OverlappingRegionsError, "before"),
        (lambda h: h["graphs"][0].update(length=2**63), quiver.OutOfBoundsError, "outside"),
        (lambda h: h["graphs"][0]["weights"].update(w=99), quiver.InvalidHeaderError, "there are 2"),
        (lambda h: h["graphs"][1].update(name="g1"), quiver.InvalidHeaderError, "appears twice"),
        (lambda h: h["graphs"][0].update(name=""), quiver.InvalidHeaderError, "empty"),
        (lambda h: h["weights"].append(dict(h["weights"][0])), quiver.InvalidHeaderError, "same content key"),
        (lambda h: h.update(format="zip"), quiver.InvalidHeaderError, "format"),
        (lambda h: h.update(weights={}), quiver.InvalidHeaderError, "lists"),
        (lambda h: h["weights"][0].update(sha256="XYZ"), quiver.InvalidHeaderError, "hex"),
        (lambda h: h["weights"][0].update(offset="4096"), quiver.InvalidHeaderError, "integer"),
        (lambda h: h["weights"][0].update(offset=True), quiver.InvalidHeaderError, "integer"),
    ],
)
def test_each_broken_header_rule_has_its_error(good: bytes, mutate: Callable, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ContextFile(_rewrite_header(good, mutate))


def test_every_error_is_a_quiver_error_that_says_what_to_do(good: bytes) -> None:
    with pytest.raises(quiver.CorruptFileError) as info:
        ContextFile(good[:-1])
    assert isinstance(info.value, quiver.QuiverError)
    assert "copy it again or rebuild it" in str(info.value)


def test_random_corruption_never_escapes_as_anything_but_a_quiver_error(good: bytes) -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        damaged = bytearray(good)
        for position in rng.integers(0, len(good), size=rng.integers(1, 8)):
            damaged[position] = rng.integers(0, 256)
        try:
            file = ContextFile(bytes(damaged))
            for name in file.graphs:
                file.skeleton(name)
            file.verify()
        except quiver.QuiverError:
            pass


def _reseal_skeleton(data: bytes, graph: str, skeleton: bytes, **fields: object) -> bytes:
    """Replaces a graph's stored skeleton bytes (same length), stored as they are (not deflated) unless
    `fields` say otherwise, and fixes its checksum: damage the checksum cannot see."""
    file = ContextFile(data)
    entry = file.graphs[graph]
    assert len(skeleton) == entry.length
    body = data[: entry.offset] + skeleton + data[entry.offset + entry.length :]

    def fix(header: dict) -> None:
        for g in header["graphs"]:
            if g["name"] == graph:
                g["sha256"] = hashlib.sha256(skeleton).hexdigest()
                g.pop("compression", None)
                g.pop("inflated_length", None)
                g.update(fields)

    return _rewrite_header(body, fix)


def test_skeletons_are_stored_deflated_and_read_back_whole(family_context: Path) -> None:
    file = ContextFile(family_context.read_bytes())
    entry = file.graphs["base"]
    assert entry.inflated_length is not None and entry.length < entry.inflated_length
    assert len(file.skeleton("base")) == entry.inflated_length


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"compression": "zlib", "inflated_length": 10}, "does not inflate to the 10 bytes"),
        ({"compression": "lz4", "inflated_length": 10}, "compression 'lz4' is not one this Quiver reads"),
        ({"inflated_length": 10}, "inflated_length but no compression"),
        ({"compression": "zlib", "inflated_length": 1 << 40}, "more than deflate can give"),
    ],
)
def test_a_deflated_skeleton_that_lies_about_its_length_is_refused(
    family_context: Path, fields: dict, message: str
) -> None:
    data = family_context.read_bytes()
    file = ContextFile(data)
    entry = file.graphs["base"]
    stored = bytes(file.buffer[entry.offset : entry.offset + entry.length])  # the real deflated bytes
    with pytest.raises(quiver.InvalidHeaderError, match=message):
        quiver.Context.from_binary(_reseal_skeleton(data, "base", stored, **fields)).graph("base")


def test_a_skeleton_that_is_not_onnx_is_refused_when_its_graph_is_opened(family_context: Path) -> None:
    data = family_context.read_bytes()
    length = ContextFile(data).graphs["base"].length
    damaged = _reseal_skeleton(data, "base", b"\xff" * length)
    context = quiver.Context.from_binary(damaged)
    with pytest.raises(quiver.InvalidHeaderError, match="not a valid ONNX structure"):
        context.graph("base")
    assert context.graph("finetune_1").name == "finetune_1"  # the other graphs still open


def test_a_skeleton_whose_placeholders_do_not_match_the_weights_is_refused(family_context: Path) -> None:
    data = family_context.read_bytes()

    def drop_one(header: dict) -> None:
        header["graphs"][0]["weights"].pop(next(iter(header["graphs"][0]["weights"])))

    def point_elsewhere(header: dict) -> None:
        weights = header["graphs"][0]["weights"]
        first = next(iter(weights))
        # a weight of another shape: the last one stored is a fine-tune's, the first is the embedding
        weights[first] = 0 if weights[first] != 0 else len(header["weights"]) - 1

    with pytest.raises(quiver.InvalidHeaderError, match="weight map does not match"):
        quiver.Context.from_binary(_rewrite_header(data, drop_one)).graph("base")
    with pytest.raises(quiver.InvalidHeaderError, match="does not match weight"):
        quiver.Context.from_binary(_rewrite_header(data, point_elsewhere)).graph("base")


def _with_prepared(tmp_path: Path) -> bytes:
    """Two graphs, the first with a prepared form (format 1.6) mapping one weight under another name."""
    a = np.arange(20000, dtype=np.float32).reshape(100, 200)
    b = np.arange(300, dtype=np.int64)
    with ContextWriter(tmp_path) as writer:
        for array in (a, b):
            writer.add_weight(str(array.dtype), array.shape, [array.tobytes()])
        writer.add_graph("g1", b"skeleton-g1", {"w": 0, "b": 1})
        writer.add_graph("g2", b"skeleton-g2", {"w": 0})
        writer.add_prepared("g1", PreparedRecord("onnxruntime 9.9.9", "ab" * 32, b"prepared-g1", {"w_fused": 0}))
        return writer.finish(tmp_path / "prepared.qctx").read_bytes()


def test_a_prepared_form_is_stored_after_its_graph_and_read_back(tmp_path: Path) -> None:
    file = ContextFile(_with_prepared(tmp_path))
    g1, g2 = file.graphs["g1"], file.graphs["g2"]
    (form,) = g1.prepared
    assert (form.runtime, form.source, form.weights) == ("onnxruntime 9.9.9", "ab" * 32, {"w_fused": 0})
    assert g1.offset + g1.length <= form.offset < form.offset + form.length <= g2.offset
    assert file.prepared_skeleton("g1", 0) == b"prepared-g1"
    assert g2.prepared == () and file.verify() == []


def test_a_flipped_bit_in_a_prepared_form_fails_its_checksum(tmp_path: Path) -> None:
    data = bytearray(_with_prepared(tmp_path))
    form = ContextFile(bytes(data)).graphs["g1"].prepared[0]
    data[form.offset] ^= 0x01
    damaged = ContextFile(bytes(data))
    with pytest.raises(quiver.ChecksumMismatchError, match="g1.*prepared form 0"):
        damaged.prepared_skeleton("g1", 0)
    assert any("prepared form 0" in problem for problem in damaged.verify())


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda g: g.update(prepared={}), quiver.InvalidHeaderError, "must be a list"),
        (lambda g: g["prepared"][0].pop("runtime"), quiver.InvalidHeaderError, "runtime must be a string"),
        (lambda g: g["prepared"][0].update(source="x"), quiver.InvalidHeaderError, "source must be 64"),
        (lambda g: g["prepared"][0]["weights"].update(w_fused=7), quiver.InvalidHeaderError, "there are 2"),
        (lambda g: g["prepared"][0].update(offset=g["offset"]), quiver.OverlappingRegionsError, "before"),
        (lambda g: g["prepared"][0].update(length=2**63), quiver.OutOfBoundsError, "outside"),
    ],
)
def test_each_broken_prepared_form_has_its_error(tmp_path: Path, mutate: Callable, error: type, match: str) -> None:
    def change_g1(header: dict) -> None:
        mutate(next(g for g in header["graphs"] if g["name"] == "g1"))

    with pytest.raises(error, match=match):
        ContextFile(_rewrite_header(_with_prepared(tmp_path), change_g1))


def test_the_crc32_in_use_is_zlibs_over_chunks_and_views() -> None:
    from quiver.formats.checksums import crc32

    data = np.random.default_rng(3).integers(0, 256, 3_000_001, dtype=np.uint8).tobytes()
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1_000_000:], crc32(data[:1_000_000])) == zlib.crc32(data)  # continued, as the writer streams
    assert crc32(memoryview(data)[7:99_999]) == zlib.crc32(data[7:99_999])


def test_a_deflated_skeleton_that_is_not_deflate_data_is_refused(family_context: Path) -> None:
    data = family_context.read_bytes()
    entry = ContextFile(data).graphs["base"]
    garbage = b"\xff" * entry.length
    damaged = _reseal_skeleton(data, "base", garbage, compression="zlib", inflated_length=entry.length)
    with pytest.raises(quiver.InvalidHeaderError, match="does not inflate \\("):
        quiver.Context.from_binary(damaged).graph("base")


def test_a_reader_refuses_flags_it_does_not_know_and_deflation_the_preamble_does_not_flag(
    family_context: Path,
) -> None:
    data = bytearray(family_context.read_bytes())
    assert ContextFile(bytes(data)).flags == 1  # its skeletons are deflated: readers before 1.7 refuse it
    unknown = bytearray(data)
    unknown[12:16] = (0x3).to_bytes(4, "little")
    with pytest.raises(quiver.UnsupportedVersionError, match="flags 0x3"):
        ContextFile(bytes(unknown))
    unflagged = bytearray(data)
    unflagged[12:16] = (0).to_bytes(4, "little")
    with pytest.raises(quiver.InvalidHeaderError, match="does not flag it"):
        ContextFile(bytes(unflagged))

"""AIMET encodings 0.6.1 / 1.0.0 / 2.0.0: round trips through the internal model, and QNN ⇄ ONNX conversion."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from quiver.errors import EncodingsError, QuiverError
from quiver.formats.encodings import Encoding, load_encodings, parse_encodings, save_encodings, to_document

# Documents laid out as AIMET writes them (values chosen by hand).
AIMET_061 = {
    "version": "0.6.1",
    "activation_encodings": {
        "input": [
            {"bitwidth": 16, "dtype": "int", "is_symmetric": "False", "max": 3.0, "min": -1.0, "offset": -16384,
             "scale": 6.103608758678569e-05}
        ],
        "gelu_out": [{"bitwidth": 16, "dtype": "float"}],
    },
    "param_encodings": {
        "fc.weight": [
            {"bitwidth": 8, "dtype": "int", "is_symmetric": "True", "max": 1.27, "min": -1.28, "offset": -128,
             "scale": 0.01},
            {"bitwidth": 8, "dtype": "int", "is_symmetric": "True", "max": 0.635, "min": -0.64, "offset": -128,
             "scale": 0.005},
        ]
    },
    "excluded_layers": [],
    "quantizer_args": {"activation_bitwidth": 16, "param_bitwidth": 8, "per_channel_quantization": True},
}  # fmt: skip

AIMET_100 = {
    "version": "1.0.0",
    "activation_encodings": [
        {"name": "input", "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False, "bw": 16,
         "scale": [6.103608758678569e-05], "offset": [-16384]},
        {"name": "softmax_out", "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False, "bw": 8,
         "scale": [0.00392156862745098], "offset": [0]},
        {"name": "gelu_out", "dtype": "FLOAT", "enc_type": "PER_TENSOR", "bw": 16},
    ],
    "param_encodings": [
        {"name": "fc.weight", "dtype": "INT", "enc_type": "PER_CHANNEL", "is_sym": True, "bw": 8,
         "scale": [0.01, 0.005], "offset": [-128, -128]},
        {"name": "proj.weight", "dtype": "INT", "enc_type": "PER_BLOCK", "is_sym": True, "bw": 4,
         "scale": [0.1, 0.2, 0.3, 0.4], "offset": [-8, -8, -8, -8], "block_size": 32},
        {"name": "fc.bias", "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": True, "bw": 32,
         "scale": [1e-06], "offset": [-2147483648]},
    ],
    "excluded_layers": [],
    "quantizer_args": {"activation_bitwidth": 16, "param_bitwidth": 8},
}  # fmt: skip

AIMET_200 = {
    "version": "2.0.0",
    "encodings": [
        {"name": "input", "output_dtype": "uint16", "y_scale": 6.103608758678569e-05, "y_zero_point": 16384},
        {"name": "fc.weight", "output_dtype": "int8", "y_scale": [0.01, 0.005], "axis": 0},
        {"name": "proj.weight", "output_dtype": "int4", "y_scale": [0.1, 0.2, 0.3, 0.4], "axis": 1, "block_size": 32},
        {"name": "gelu_out", "output_dtype": "float16"},
    ],
}  # fmt: skip


@pytest.mark.parametrize("document", [AIMET_061, AIMET_100, AIMET_200], ids=["0.6.1", "1.0.0", "2.0.0"])
def test_each_version_round_trips_without_loss(document: dict, tmp_path: Path) -> None:
    original = copy.deepcopy(document)
    parsed = parse_encodings(document)
    assert to_document(parsed) == original
    path = save_encodings(parsed, tmp_path / "out.encodings")
    assert json.loads(path.read_text()) == original
    assert load_encodings(path).tensors == parsed.tensors


def test_the_versions_describe_the_same_encodings() -> None:
    old, new, onnx_style = (parse_encodings(d).tensors for d in (AIMET_061, AIMET_100, AIMET_200))
    assert old["input"] == new["input"]
    assert (old["fc.weight"].scale, old["fc.weight"].zero_point) == (new["fc.weight"].scale, (0, 0))
    for name in ("input", "fc.weight", "proj.weight"):
        a, b = new[name], onnx_style[name]
        assert (a.dtype, a.scale, a.zero_point, a.block_size) == (b.dtype, b.scale, b.zero_point, b.block_size)
    assert new["gelu_out"].is_float and onnx_style["gelu_out"].is_float and old["gelu_out"].is_float


def test_converting_between_versions_keeps_scales_and_offsets() -> None:
    as_200 = parse_encodings(to_document(parse_encodings(AIMET_100), "2.0.0")).tensors
    for name, encoding in parse_encodings(AIMET_100).tensors.items():
        assert (as_200[name].dtype, as_200[name].scale, as_200[name].offsets) == (
            encoding.dtype,
            encoding.scale,
            encoding.offsets,
        )


def _reals_qnn(scale: float, offset: int, bitwidth: int) -> np.ndarray:
    """QNN: real = scale·(q + offset), q = 0 .. 2^bw − 1."""
    q = np.arange(1 << bitwidth, dtype=np.float64)
    return scale * (q + offset)


def _reals_onnx(scale: float, zero_point: int, low: int, high: int) -> np.ndarray:
    """ONNX: real = scale·(q − zero_point), q over the integer type's range."""
    q = np.arange(low, high + 1, dtype=np.float64)
    return scale * (q - zero_point)


@pytest.mark.parametrize(
    ("bitwidth", "offset", "symmetric", "dtype", "zero_point", "low", "high"),
    [
        (8, -128, True, "int8", 0, -128, 127),  # symmetric int8
        (8, -3, False, "uint8", 3, 0, 255),
        (16, -32768, False, "uint16", 32768, 0, 65535),  # asymmetric uint16 centred (not symmetric)
        (16, -1000, False, "uint16", 1000, 0, 65535),
        (16, -32768, True, "int16", 0, -32768, 32767),
        (4, -8, True, "int4", 0, -8, 7),  # symmetric 4-bit
        (4, -3, False, "uint4", 3, 0, 15),
    ],
)
def test_qnn_offsets_and_onnx_zero_points_give_the_same_reals(
    bitwidth: int, offset: int, symmetric: bool, dtype: str, zero_point: int, low: int, high: int
) -> None:
    encoding = Encoding.from_offsets(bitwidth, [0.125], [offset], symmetric)
    assert (encoding.dtype, encoding.zero_point) == (dtype, (zero_point,))
    np.testing.assert_array_equal(_reals_onnx(0.125, zero_point, low, high), _reals_qnn(0.125, offset, bitwidth))
    assert encoding.offsets == (offset,)


def test_an_encoding_moves_between_signed_and_unsigned_types_exactly() -> None:
    signed = Encoding("int8", (0.5,), (0,), symmetric=True)
    unsigned = signed.with_dtype("uint8")
    assert unsigned.zero_point == (128,) and unsigned.offsets == signed.offsets == (-128,)
    assert unsigned.with_dtype("int8") == signed
    np.testing.assert_array_equal(_reals_onnx(0.5, 128, 0, 255), _reals_onnx(0.5, 0, -128, 127))


def test_quantize_rounds_half_to_even_and_clips() -> None:
    encoding = Encoding("uint8", (0.5,), (10,))
    values = np.array([0.25, 0.75, -100.0, 1000.0, 1.0], np.float32)
    # 0.25/0.5 = 0.5 -> 0 (+10); 0.75/0.5 = 1.5 -> 2 (+10); clipped to 0 and 255; 1.0/0.5 = 2 (+10)
    np.testing.assert_array_equal(encoding.quantize(values), [10, 12, 0, 255, 12])


@pytest.mark.parametrize(
    ("document", "needle"),
    [
        ({"version": "3.0.0"}, "version 3.0.0 is not supported"),
        ({"version": "1.0.0", "param_encodings": [{"name": "w", "bw": 8, "is_sym": False, "scale": [0.1],
                                                   "offset": [5]}]}, "offsets must be ≤ 0"),
        ({"version": "1.0.0", "param_encodings": [{"name": "w", "bw": 8, "scale": [0.1]}]}, "not an AIMET 1.0.0"),
        ({"version": "1.0.0", "param_encodings": [{"name": "w", "bw": 8, "scale": [-1.0], "offset": [0]}]},
         "positive and finite"),
        ({"version": "2.0.0", "encodings": [{"name": "x", "output_dtype": "uint7", "y_scale": 1.0}]}, "uint7"),
        ({"version": "2.0.0", "encodings": [{"name": "x", "output_dtype": "uint8", "y_scale": 1.0,
                                             "y_zero_point": 300}]}, "outside uint8's range"),
        ({"version": "1.0.0", "param_encodings": [{"name": "w", "bw": 8, "enc_type": "VECTOR", "scale": [1.0],
                                                   "offset": [0]}]}, "enc_type VECTOR"),
        ([1, 2], "JSON object"),
    ],
)  # fmt: skip
def test_bad_encodings_are_refused_with_a_reason(document: object, needle: str) -> None:
    with pytest.raises(EncodingsError, match=needle):
        parse_encodings(document)  # type: ignore[arg-type]


def test_unreadable_files_are_encodings_errors(tmp_path: Path) -> None:
    with pytest.raises(QuiverError, match="no such encodings file"):
        load_encodings(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(EncodingsError, match="not a readable JSON"):
        load_encodings(tmp_path / "bad.json")


def test_per_block_encodings_cannot_be_written_as_061() -> None:
    with pytest.raises(EncodingsError, match="no per-block"):
        to_document(parse_encodings(AIMET_100), "0.6.1")

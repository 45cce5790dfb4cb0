"""One expert of a GGUF file's stacked experts is read alone: its slice of the blocks, dequantized, equals the
same expert of the whole tensor dequantized (Q8_0 and Q4_0 blocks, and float32)."""

from __future__ import annotations

from pathlib import Path

import gguf  # the test extras install it
import numpy as np
import pytest

from quiver.t2t.gguf_model import _float32
from tests.support.gguf_files import gguf_file

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_0"])
def test_one_expert_of_a_stacked_tensor_is_its_slice_of_the_whole(tmp_path: Path, kind: str) -> None:
    experts = np.random.default_rng(0).standard_normal((3, 8, 64)).astype(np.float32)  # [experts, rows, columns]
    kind_id = gguf.GGMLQuantizationType[kind]
    path = tmp_path / "experts.gguf"
    stored = experts if kind == "F32" else gguf.quants.quantize(experts, kind_id)
    with gguf_file(path, "qwen3moe") as writer:
        writer.add_tensor("blk.0.ffn_up_exps.weight", stored, raw_dtype=None if kind == "F32" else kind_id)
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    whole = _float32(path, tensor).reshape(3, 8, 64)
    tolerance = {"F32": 0.0, "Q8_0": 0.02, "Q4_0": 0.3}[kind]
    assert np.abs(whole - experts).max() <= tolerance * np.abs(experts).max()  # the blocks hold the experts
    for e in range(3):
        np.testing.assert_array_equal(_float32(path, tensor, e).reshape(8, 64), whole[e])
    assert not np.array_equal(whole[0], whole[1])

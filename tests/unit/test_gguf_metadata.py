"""A GGUF file's metadata read as llama.cpp reads it: Gemma's queries scaled by the head size, but the 27B
models' (46 layers of Gemma 2, 62 of Gemma 3) by hidden / heads; Gemma 2's soft-caps and window llama.cpp's
defaults where the file leaves them out, the file's own where it has them (Gemma 3's final soft-cap too);
Phi-3's window the model's, none where the file says 0; a Phi-2 file of fused q/k/v refused in one line;
Phi-3.5's longrope from its factor tensors and its attention factor (1 where the file has none, as llama.cpp
takes it), half of it refused in one line; a SentencePiece vocabulary whose scores do not match its pieces
refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf  # the test extras install it
import numpy as np
import pytest

from quiver.errors import ModelFolderError
from quiver.t2t.gguf_model import GgufModel
from quiver.t2t.rope import rotary_tables
from tests.support.gguf_files import gguf_file

pytestmark = pytest.mark.unit


def _metadata_only(
    path: Path, arch: str, layers: int, more: Callable[[gguf.GGUFWriter], None] = lambda writer: None, **floats: float
) -> Path:
    """A file of one architecture's metadata (hidden 4608, 32 heads of 128: Gemma 2 27B's widths), no tensors."""
    with gguf_file(path, arch) as writer:
        writer.add_block_count(layers)
        writer.add_embedding_length(4608)
        writer.add_feed_forward_length(36864)
        writer.add_head_count(32)
        writer.add_head_count_kv(16)
        writer.add_key_length(128)
        writer.add_value_length(128)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_uint32(f"{arch}.vocab_size", 256)
        if arch == "gemma3":  # its window is required (llama.cpp's too)
            writer.add_sliding_window(1024)
        for key, value in floats.items():
            writer.add_float32(f"{arch}.{key}", value)
        more(writer)
    return path


@pytest.mark.parametrize(
    ("arch", "layers", "scaled_by"),
    [("gemma2", 46, 4608 // 32), ("gemma2", 42, 128), ("gemma3", 62, 4608 // 32), ("gemma3", 34, 128),
     ("gemma", 46, 128)],
)  # fmt: skip
def test_queries_are_scaled_by_the_head_size_but_in_the_27b_models(
    tmp_path: Path, arch: str, layers: int, scaled_by: int
) -> None:
    config = GgufModel(_metadata_only(tmp_path / "m.gguf", arch, layers)).config
    assert config.head_dim == 128
    assert config.scale == pytest.approx(0.0 if arch == "gemma" else scaled_by**-0.5)  # 0: the head size's


def test_gemma2_soft_caps_and_window_are_llama_cpps_defaults_unless_the_file_has_its_own(tmp_path: Path) -> None:
    default = GgufModel(_metadata_only(tmp_path / "default.gguf", "gemma2", 26)).config
    assert (default.softcap, default.final_softcap) == (50.0, 30.0)
    assert [kind.window for kind in default.layer_kinds[:4]] == [4096, None, 4096, None]  # even layers slide
    own = _metadata_only(tmp_path / "own.gguf", "gemma2", 26, attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
    config = GgufModel(own).config
    assert (config.softcap, config.final_softcap) == (20.0, 10.0)
    gemma3 = GgufModel(_metadata_only(tmp_path / "gemma3.gguf", "gemma3", 26, final_logit_softcapping=10.0)).config
    assert gemma3.final_softcap == 10.0


@pytest.mark.parametrize(("window", "expected"), [(2047, 2047), (0, None)])
def test_a_phi3_window_is_the_models_and_none_where_the_file_says_0(
    tmp_path: Path, window: int, expected: int | None
) -> None:
    path = _metadata_only(tmp_path / "m.gguf", "phi3", 4, lambda writer: writer.add_sliding_window(window))
    assert {kind.window for kind in GgufModel(path).config.layer_kinds} == {expected}


@pytest.mark.parametrize("scores", [[0.0], None], ids=["fewer", "none"])
def test_sentencepiece_scores_that_do_not_match_the_pieces_are_refused_in_one_line(
    tmp_path: Path, scores: list[float] | None
) -> None:
    def vocabulary(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "\u2581a", "b"])
        if scores is not None:
            writer.add_token_scores(scores)

    path = _metadata_only(tmp_path / "m.gguf", "llama", 1, vocabulary)
    with pytest.raises(ModelFolderError, match="3 tokens and") as refused:
        GgufModel(path).write_tokenizer(tmp_path / "out")
    assert "\n" not in str(refused.value)


# Phi-3.5-mini's first and last longrope factors, spread over the 64 pairs of a 128-wide head
_SHORT = np.linspace(1.0, 2.7, 64, dtype=np.float32)
_LONG = np.linspace(1.08, 34.4, 64, dtype=np.float32)


def _longrope_file(path: Path, attention: float | None, **factors: np.ndarray) -> Path:
    """A phi3 file's metadata with longrope's factor tensors (`short`, `long`) and its `attn_factor`."""

    def rope(writer: gguf.GGUFWriter) -> None:
        writer.add_context_length(131072)
        writer.add_rope_scaling_orig_ctx_len(4096)
        if attention is not None:
            writer.add_rope_scaling_attn_factors(attention)
        for kind, values in factors.items():
            writer.add_tensor(f"rope_factors_{kind}.weight", values)

    return _metadata_only(path, "phi3", 4, rope)


@pytest.mark.parametrize("attention", [1.1902381, None], ids=["file's", "none"])
def test_phi3_longrope_comes_from_its_factor_tensors_with_the_files_attention_factor(
    tmp_path: Path, attention: float | None
) -> None:
    path = _longrope_file(tmp_path / "m.gguf", attention, short=_SHORT, long=_LONG)
    rope = GgufModel(path).config.layer_kinds[0].rope
    assert rope is not None and rope.kind == "longrope"
    cos, sin = rotary_tables(rope, 64, 131072)
    expected = 1.0 if attention is None else attention  # llama.cpp's scale where the file has none
    assert cos[0] == pytest.approx(np.full(64, expected, np.float32), rel=1e-6)
    # position 1's angles are the short factors' frequencies: 1 / (factor * 10000^(2i/128))
    angles = 1.0 / (_SHORT.astype(np.float64) * 10000.0 ** (np.arange(0, 128, 2) / 128))
    assert sin[1] == pytest.approx(expected * np.sin(angles), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize(
    ("factors", "attention", "words"),
    [({"short": _SHORT}, 1.19, "without 'rope_factors_long.weight'"),
     ({"long": _LONG}, 1.19, "without 'rope_factors_short.weight'"),
     ({}, 1.19, "attention factor (1.19"),
     ({"short": _SHORT, "long": _LONG[:32]}, None, "64 short and 32 long")],
    ids=["short alone", "long alone", "attention factor alone", "lengths differ"],
)  # fmt: skip
def test_part_of_a_longrope_is_refused_in_one_line(
    tmp_path: Path, factors: dict[str, np.ndarray], attention: float | None, words: str
) -> None:
    with pytest.raises(ModelFolderError) as refused:
        GgufModel(_longrope_file(tmp_path / "m.gguf", attention, **factors))
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_phi2_file_with_q_k_v_fused_in_one_tensor_is_refused_in_one_line(tmp_path: Path) -> None:
    # early Phi-2 conversions wrote `attn_qkv`; transformers' PhiForCausalLM keeps q, k and v apart
    def fused(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("blk.0.attn_qkv.weight", np.zeros((4, 4), np.float32))

    path = _metadata_only(tmp_path / "m.gguf", "phi2", 2, fused)
    with pytest.raises(ModelFolderError) as refused:
        GgufModel(path)
    assert "'blk.0.attn_qkv.weight' has no place" in str(refused.value) and "\n" not in str(refused.value)

"""A GGUF file's metadata read as llama.cpp reads it: Gemma's queries scaled by the head size, but the 27B
models' (46 layers of Gemma 2, 62 of Gemma 3) by hidden / heads; Gemma 2's soft-caps and window llama.cpp's
defaults where the file leaves them out, the file's own where it has them (Gemma 3's final soft-cap too);
Phi-3's window the model's, none where the file says 0; a SentencePiece vocabulary whose scores do not match
its pieces refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf  # the test extras install it
import pytest

from quiver.errors import ModelFolderError
from quiver.t2t.gguf_model import GgufModel
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

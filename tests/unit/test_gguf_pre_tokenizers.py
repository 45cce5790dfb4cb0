"""llama.cpp's pre-tokenizers, as a GGUF file's `tokenizer.ggml.pre` names them: each splits text where
llama.cpp's regexes (llama-vocab.cpp) split it; the pieces below follow those regexes by hand."""

from __future__ import annotations

import pytest

from quiver.t2t.gguf_model import pre_tokenizer

pytestmark = pytest.mark.unit

TEXT = "I'm (2024)\n\nyes"


def _pieces(pre: str) -> list[str]:
    # bytes as ByteLevel spells them: a space is "Ġ", a newline "Ċ"
    return [piece for piece, _ in pre_tokenizer(pre).pre_tokenize_str(TEXT)]


def test_qwen2s_pre_tokenizer_splits_digits_one_by_one_and_keeps_a_letters_leading_mark() -> None:
    # Qwen2's (and Qwen2.5's, Qwen3's): Llama 3's regex with \p{N} where Llama 3 has \p{N}{1,3}
    assert _pieces("qwen2") == ["I", "'m", "Ġ(", "2", "0", "2", "4", ")ĊĊ", "yes"]


def test_llama3s_pre_tokenizer_groups_digits_by_three() -> None:
    assert _pieces("llama-bpe") == ["I", "'m", "Ġ(", "202", "4", ")ĊĊ", "yes"]

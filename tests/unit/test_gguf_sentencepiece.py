"""A GGUF SentencePiece vocabulary whose scores do not match its pieces is refused in one line."""

from __future__ import annotations

from pathlib import Path

import gguf  # the test extras install it
import pytest

from quiver.errors import ModelFolderError
from quiver.t2t.gguf_model import GgufModel

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("scores", [[0.0], None], ids=["fewer", "none"])
def test_scores_that_do_not_match_the_pieces_are_refused_in_one_line(
    tmp_path: Path, scores: list[float] | None
) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "\u2581a", "b"])
    if scores is not None:
        writer.add_token_scores(scores)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFolderError, match="3 tokens and") as refused:
        GgufModel(tmp_path / "m.gguf").write_tokenizer(tmp_path / "out")
    assert "\n" not in str(refused.value)
